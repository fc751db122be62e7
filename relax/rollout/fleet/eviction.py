"""Evictions: which engines must leave because the platform takes their node back, with how much time (pure).

Two notices mean the same thing and are planned here alike: Ray's drain notice for a node, and a SIGTERM that
reached an engine's actor (:func:`plan_notice`). The fleet carries out either the same way
(``EngineFleet.evict``): out of routing, in-flight work finished or migrated within the budget, then removed.

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
from enum import Enum

from relax.rollout.settings import EvictionSettings

__all__ = ["Eviction", "Notice", "plan_evictions", "plan_notice"]


class Notice(str, Enum):
    """How the platform said the engine must go."""

    NODE_DRAINING = "node draining"  # Ray's drain notice for the engine's node (autoscaler, preemption)
    SIGTERM = "SIGTERM"  # the engine's actor was sent SIGTERM (Ray's graceful termination of the worker)


@dataclass(frozen=True)
class Eviction:
    engine_id: str
    node_id: str
    budget_s: float  # time to finish or migrate in-flight work before the engine is stopped
    deadline_ms: int  # 0: none given
    notice: Notice = Notice.NODE_DRAINING

    def describe(self, now_ms: int) -> str:
        """The event's line: the notice, its deadline, and the time the engine has."""
        if self.notice is Notice.SIGTERM:
            said = "SIGTERM received"
        else:
            deadline = (f"deadline in {max(0.0, (self.deadline_ms - now_ms) / 1000):.0f}s" if self.deadline_ms
                        else "no deadline given")
            said = f"node {self.node_id[:12]} draining ({deadline})"
        return f"{said}: {self.budget_s:.0f}s to finish or migrate in-flight requests"


def plan_notice(engine_id: str, node_id: str | None, drain_timeout_s: float) -> Eviction:
    """A SIGTERM that reached the engine's actor: the same eviction as a drain notice without a deadline, with the
    run's drain timeout (``--scale-in-drain-timeout``) as its budget."""
    return Eviction(engine_id, node_id or "", max(0.0, drain_timeout_s), 0, Notice.SIGTERM)


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
