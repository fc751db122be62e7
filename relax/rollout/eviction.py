"""Evictions from Ray's drain notices: which engines must leave, with how much time (pure).

The manager's drain watcher reads the draining nodes about once a second (``relax.cluster.drain``), and
this module turns them into evictions: every engine on a draining node that is not leaving yet gets one,
with the time left before the node's deadline minus a safety margin as its budget (the engine must be out,
its placement group removed, before the node goes). A deadline of 0 means Ray was given none: a configured
default applies. A deadline already past gives a budget of 0: the engine is taken out at once and its
requests retried or migrated, as after an abrupt loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Eviction", "EvictionSettings", "plan_evictions"]


@dataclass(frozen=True)
class EvictionSettings:
    margin_s: float = 5.0  # kept back from the deadline for stopping the server and removing the group
    default_budget_s: float = 30.0  # when the notice has no deadline (Ray's own default drain timeout)


@dataclass(frozen=True)
class Eviction:
    engine_id: str
    node_id: str
    budget_s: float  # time to finish or migrate in-flight work before the engine is stopped
    deadline_ms: int  # 0: none given


def plan_evictions(draining: Mapping[str, int], engines_by_node: Mapping[str, Iterable[str]], now_ms: int,
                   leaving: Iterable[str] = (), settings: EvictionSettings = EvictionSettings()) -> list[Eviction]:
    """One eviction per engine on a draining node that is not already leaving, soonest deadline first."""
    skip = set(leaving)
    out = []
    for node_id, deadline_ms in draining.items():
        if deadline_ms > 0:
            budget = max(0.0, (deadline_ms - now_ms) / 1000.0 - settings.margin_s)
        else:
            budget = settings.default_budget_s
        out.extend(Eviction(eid, node_id, budget, int(deadline_ms))
                   for eid in sorted(engines_by_node.get(node_id, ())) if eid not in skip)
    return sorted(out, key=lambda e: (e.budget_s, e.engine_id))
