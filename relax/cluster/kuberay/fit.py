"""Does a run's plan fit a RayCluster? Answered from the manifest, in the words of the live start-up check.

The driver checks its plan against ``ray.cluster_resources()`` before it creates anything
(``relax.config.plan.validate_plan_against_cluster``). Here the same check runs against the resources the
manifest's groups give Ray at start (``groups.resources_at_start``), so a platform engineer reads the same
sentence before applying the manifest that the run would print after. Scale-out is checked beside it: the
groups without markers that the autoscaler may grow must hold the engines the autoscaler may ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax.cluster.kuberay.groups import RayGroup, resources_at_start
from relax.config.plan import Plan, validate_plan_against_cluster


@dataclass(frozen=True)
class ElasticGroup:
    """An autoscaled group without markers: where scaled-out engines land."""

    name: str
    added_pods: int  # maxReplicas - replicas at start
    engines_per_pod: int

    @property
    def engines(self) -> int:
        return self.added_pods * self.engines_per_pod


@dataclass(frozen=True)
class Fit:
    """The answer: what is missing (empty: the plan fits) and what the cluster offers."""

    problems: tuple[str, ...]
    start_resources: dict[str, float]
    elastic: tuple[ElasticGroup, ...]
    headroom_engines: int  # engines the autoscaler may add beyond the initial ones

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def elastic_engines(self) -> int:
        return sum(group.engines for group in self.elastic)


def _has_markers(group: RayGroup, plan: Plan) -> bool:
    return any(name in group.custom for name in plan.marker_resources) if plan.node_group else False


def elastic_groups(plan: Plan, groups: list[RayGroup]) -> tuple[ElasticGroup, ...]:
    """The worker groups Ray's autoscaler may grow that can hold an elastic engine (its GPUs and a CPU)."""
    found = []
    for group in groups:
        if group.is_head or group.max_replicas <= group.replicas or _has_markers(group, plan):
            continue
        per_pod = int(min(group.gpus // plan.gpus_per_engine, group.cpus)) if plan.gpus_per_engine else 0
        if per_pod > 0:
            found.append(ElasticGroup(group.name, group.max_replicas - group.replicas, per_pod))
    return tuple(found)


def plan_fit(plan: Plan, groups: list[RayGroup]) -> Fit:
    """What the cluster lacks for ``plan``: the baseline at start, then room for every elastic engine."""
    start = resources_at_start(groups)
    problems = validate_plan_against_cluster(plan, start)
    elastic = elastic_groups(plan, groups)
    room = sum(group.engines for group in elastic)
    if plan.autoscaler is not None and room < plan.headroom_engines:
        problems.append(
            f"the autoscaler may add {plan.headroom_engines} engine(s) (max_engines {plan.max_engines} - "
            f"{plan.engine_floor} initial) of {plan.gpus_per_engine} GPU and 1 CPU each, but the worker groups "
            f"without markers that can grow hold {room}; raise maxReplicas of the elastic group (one engine per "
            f"{plan.gpus_per_engine}-GPU pod) or lower max_engines"
        )
    return Fit(tuple(problems), start, elastic, plan.headroom_engines)


def describe_fit(fit: Fit, label: str) -> str:
    """Lines for ``--dry-run``: the verdict, then the problems or what the cluster gives."""
    if not fit.fits:
        return "\n".join([f"{label}: the plan does not fit"] + [f"  - {problem}" for problem in fit.problems])
    start = ", ".join(f"{k} {v:g}" for k, v in sorted(fit.start_resources.items()) if v)
    grow = "; ".join(f"group {g.name!r}: up to {g.added_pods} more pod(s) x {g.engines_per_pod} engine(s)"
                     for g in fit.elastic) or "no autoscaled group"
    return (f"{label}: the plan fits\n  at start: {start}\n"
            f"  scale-out: {fit.elastic_engines} engine(s) of room ({grow}); the autoscaler may add "
            f"{fit.headroom_engines}")
