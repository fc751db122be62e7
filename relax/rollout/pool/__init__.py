"""The engines the run holds: each one's record and state, the log of what happened to them, how one is started.

Owns :class:`~relax.rollout.pool.engines.EnginePool` (every engine's record and the state machine it moves
through, pure), the :class:`~relax.rollout.pool.events.EventLog` of their transitions and scale events, the
``EngineLauncher`` port with its Ray implementation (one ``EngineActor`` per engine in a placement group of its
own), and the normal form of an attached engine's URL. This is the floor of the rollout: every other room reads
the pool, and the pool imports none of them (only ``relax.rollout.settings`` and the packages below the rollout).
"""
