"""The rollout: the elastic pool of engines, their weights, generation, and the control surface over them.

One room per concept (docs/architecture.md, "The rollout's rooms"): ``pool`` (the engines held), ``routing`` (who
serves what), ``refit`` (bringing engines to the newest weights), ``scaling`` (what a scale request means),
``fleet`` (the engines' lifecycle), ``dispatch`` (generation) and ``control`` (REST, metrics, the manager's
client). At this level only the composition: ``settings`` (every knob once), ``assembly`` (``build_rollout`` wires
the rooms without Ray) and ``manager`` (the Ray actor around them).
"""
