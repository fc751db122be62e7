"""Scale request states: directions, kinds, the two status machines, and what counts as an engine.

(docs/architecture.md, "Scale requests".) A scale-out is in the phase its most advanced engine reached; a
scale-in drains its victims, then removes them. Terminal statuses are exported as plain names
(:data:`TERMINAL_STATUSES`, :data:`FAILED_STATUSES`) for callers that only see the REST JSON, such as the
autoscaler service and monitor.
"""

from __future__ import annotations

from enum import Enum

from relax.rollout.pool.engines import EnginePool, EngineState

DEFAULT_MODEL = "default"
"""The only model a Relax run serves; requests naming another are rejected."""

KNOWN_MODELS: tuple[str, ...] = (DEFAULT_MODEL,)
"""Models a run serves. Relax trains one policy, so the REST ``model_name`` can only be ``default``."""

__all__ = [
    "FAILED_STATUSES",
    "TERMINAL_STATUSES",
    "Direction",
    "ScaleInStatus",
    "ScaleKind",
    "ScaleOutStatus",
    "current_engine_count",
]


class Direction(str, Enum):
    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"


class ScaleKind(str, Enum):
    """How a scale-out gets its engines."""

    RAY_NATIVE = "ray_native"  # Relax creates placement groups and EngineActors (num_replicas)
    EXTERNAL = "external"  # running servers are attached by URL (engine_urls)


class ScaleOutStatus(str, Enum):
    """Scale-out request states. The request is in the phase its most advanced engine reached."""

    PENDING = "PENDING"
    CREATING = "CREATING"  # ray_native: placement groups requested, engine actors starting
    CONNECTING = "CONNECTING"  # external: attaching the URLs
    HEALTH_CHECKING = "HEALTH_CHECKING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"
    ACTIVE = "ACTIVE"  # every engine joined the router
    PARTIAL = "PARTIAL"  # some engines joined, the others failed and were cleaned up (keep_partial)
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in SCALE_OUT_TERMINAL

    def can_transition_to(self, target: ScaleOutStatus) -> bool:
        return ScaleOutStatus(target) in _SO_LEGAL[self]


_SO = ScaleOutStatus
SCALE_OUT_TERMINAL: frozenset[ScaleOutStatus] = frozenset({_SO.ACTIVE, _SO.PARTIAL, _SO.FAILED, _SO.CANCELLED})
_SO_LEGAL: dict[ScaleOutStatus, frozenset[ScaleOutStatus]] = {
    _SO.PENDING: frozenset({_SO.CREATING, _SO.CONNECTING, _SO.FAILED, _SO.CANCELLED}),
    _SO.CREATING: frozenset({_SO.HEALTH_CHECKING, _SO.FAILED, _SO.CANCELLED}),
    _SO.CONNECTING: frozenset({_SO.HEALTH_CHECKING, _SO.FAILED, _SO.CANCELLED}),
    _SO.HEALTH_CHECKING: frozenset({_SO.WEIGHT_SYNCING, _SO.FAILED, _SO.CANCELLED}),
    # ACTIVE/PARTIAL need at least one engine that reached weight sync, i.e. the request did.
    _SO.WEIGHT_SYNCING: frozenset({_SO.ACTIVE, _SO.PARTIAL, _SO.FAILED, _SO.CANCELLED}),
    **{s: frozenset() for s in SCALE_OUT_TERMINAL},
}
SCALE_OUT_RANK: dict[ScaleOutStatus, int] = {
    _SO.PENDING: 0,
    _SO.CREATING: 1,
    _SO.CONNECTING: 1,
    _SO.HEALTH_CHECKING: 2,
    _SO.WEIGHT_SYNCING: 3,
}
"""How far along a running scale-out is (CREATING and CONNECTING are the same step for the two kinds)."""


class ScaleInStatus(str, Enum):
    """Scale-in request states."""

    PENDING = "PENDING"
    DRAINING = "DRAINING"  # victims are out of the router; waiting for their in-flight requests
    REMOVING = "REMOVING"  # shutting engines down and removing their placement groups
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in SCALE_IN_TERMINAL

    def can_transition_to(self, target: ScaleInStatus) -> bool:
        return ScaleInStatus(target) in _SI_LEGAL[self]


_SI = ScaleInStatus
SCALE_IN_TERMINAL: frozenset[ScaleInStatus] = frozenset({_SI.COMPLETED, _SI.FAILED})
_SI_LEGAL: dict[ScaleInStatus, frozenset[ScaleInStatus]] = {
    _SI.PENDING: frozenset({_SI.DRAINING, _SI.FAILED}),
    _SI.DRAINING: frozenset({_SI.REMOVING, _SI.FAILED}),
    _SI.REMOVING: frozenset({_SI.COMPLETED, _SI.FAILED}),
    _SI.COMPLETED: frozenset(),
    _SI.FAILED: frozenset(),
}

TERMINAL_STATUSES: frozenset[str] = frozenset(s.value for s in SCALE_OUT_TERMINAL | SCALE_IN_TERMINAL)
"""Names of every status in which a scale request (either direction) has ended."""

FAILED_STATUSES: frozenset[str] = frozenset({ScaleOutStatus.FAILED.value, ScaleOutStatus.CANCELLED.value})
"""Names of the terminal statuses in which a request did not get what it asked for."""


# -- engines as the scaling rules see them ------------------------------------------------------------

ROLLBACK_STATES: frozenset[EngineState] = frozenset(
    {EngineState.PENDING, EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING}
)
"""Engine states from which a scale-out rollback may remove an engine directly (never served, nothing to drain)."""

ENGINE_RANK: dict[EngineState, int] = {
    EngineState.PENDING: 1,
    EngineState.STARTING: 1,
    EngineState.HEALTH_CHECKING: 2,
    EngineState.WEIGHT_SYNCING: 3,
    EngineState.ACTIVE: 3,
    EngineState.DRAINING: 3,
}
"""How far an engine state carries its scale-out request (see :class:`ScaleOutStatus`: the furthest engine decides)."""


def current_engine_count(pool: EnginePool) -> int:
    """Engines an absolute target is compared with: live and not ``DRAINING``.

    Starting engines count so a retried scale-out does not ask twice; draining ones do not, because they
    will never serve again: counting them would leave a scale-out short and make a scale-in remove one
    engine too many once the drain finishes.
    """
    return sum(1 for r in pool.live() if r.state is not EngineState.DRAINING)
