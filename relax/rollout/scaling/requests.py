"""Scale request records: what ``GET /rollout/scale_out/{id}`` and ``GET /rollout/scale_in/{id}`` show.

(docs/architecture.md, "Scale requests".) The RolloutManager's scale controller carries a plan out with Ray
and reports progress back into the record (``add_engine``, ``observe``, ``advance``). **Cancel is sticky**:
once a scale-out is asked to cancel it ends CANCELLED whatever the shell reports next, and the engines it
created that are not yet ACTIVE are the ones to roll back. No Ray, no HTTP, no asyncio; the clock is injected.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relax.rollout.pool.engines import EngineKind, EnginePool, EngineRecord, EngineState, engine_number
from relax.rollout.scaling.errors import IllegalRequestTransition, NotCancellable
from relax.rollout.scaling.planner import ScaleInPlan, ScaleOutPlan, _check_count, engine_phase_timings
from relax.rollout.scaling.states import (
    ENGINE_RANK,
    SCALE_OUT_RANK,
    Direction,
    ScaleInStatus,
    ScaleKind,
    ScaleOutStatus,
)

Clock = Callable[[], float]

__all__ = ["Clock", "EngineOutcome", "ScaleInRequest", "ScaleOutRequest", "ScaleRequest", "VictimOutcome"]


@dataclass
class EngineOutcome:
    """One engine of a scale-out request: last known lifecycle state, error, and phase timings."""

    engine_id: str
    url: str | None = None
    state: EngineState | None = None
    error: str | None = None
    timings: dict[str, float | None] = field(default_factory=dict)

    def update_from(self, record: EngineRecord) -> None:
        self.url = record.url or self.url
        self.state = record.state
        self.error = record.last_error or self.error
        self.timings = engine_phase_timings(record)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine_id": self.engine_id,
            "url": self.url,
            "state": self.state.value if self.state else None,
            "error": self.error,
        }
        for key in ("placement_wait_s", "start_s", "health_s", "weight_sync_s", "total_s"):
            out[key] = self.timings.get(key)
        return out


class _Lifecycle:
    """Status bookkeeping shared by both request kinds (``status``, ``transitions``, ``clock``)."""

    status: Any
    transitions: list[tuple[Any, float]]
    created_at: float
    request_id: str
    clock: Clock

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @property
    def finished_at(self) -> float | None:
        return self.transitions[-1][1] if self.terminal and self.transitions else None

    def _enter(self, status: Any) -> None:
        self.status = status
        self.transitions.append((status, self.clock()))

    def _in_status_s(self) -> dict[str, float]:
        """Seconds spent in each status passed through (the current one counts up to now while running)."""
        out: dict[str, float] = {}
        stamps = self.transitions
        for (status, start), (_, end) in itertools.pairwise(stamps):
            out[status.value] = out.get(status.value, 0.0) + max(0.0, end - start)
        if stamps and not self.terminal:
            status, start = stamps[-1]
            out[status.value] = out.get(status.value, 0.0) + max(0.0, self.clock() - start)
        return out

    def deadline(self, default_timeout_secs: float) -> float:
        """When the shell gives up: the request's own ``timeout_secs`` or the flag's default, from creation."""
        timeout = getattr(self, "timeout_secs", None)
        return self.created_at + (timeout if timeout is not None else default_timeout_secs)

    def _total_s(self) -> float | None:
        end = self.finished_at
        return None if end is None else max(0.0, end - self.created_at)


@dataclass(kw_only=True)
class ScaleOutRequest(_Lifecycle):
    """The record of one scale-out, as ``GET /rollout/scale_out/{id}`` shows it.

    The shell reports progress with :meth:`add_engine` (an engine was created / attached for this request),
    :meth:`observe` (refresh per-engine states and timings from the pool; the request status follows its
    most advanced engine), and :meth:`advance` (explicit moves, the terminal one included).
    """

    direction: ClassVar[Direction] = Direction.SCALE_OUT

    request_id: str
    model_name: str
    kind: ScaleKind
    created_at: float
    seq: int = 0
    target: int | None = None
    urls: tuple[str, ...] = ()
    engines_before: int = 0
    to_create: int = 0
    timeout_secs: float | None = None
    status: ScaleOutStatus = ScaleOutStatus.PENDING
    error: str | None = None
    cancel_requested: bool = False
    cancel_requested_at: float | None = None
    engines: dict[str, EngineOutcome] = field(default_factory=dict)
    transitions: list[tuple[ScaleOutStatus, float]] = field(default_factory=list)
    clock: Clock = field(default=time.time, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.transitions:
            self.transitions.append((self.status, self.created_at))

    @classmethod
    def from_plan(
        cls, plan: ScaleOutPlan, request_id: str, *, seq: int = 0, clock: Clock = time.time
    ) -> ScaleOutRequest:
        return cls(
            request_id=request_id,
            model_name=plan.model_name,
            kind=plan.kind,
            created_at=clock(),
            seq=seq,
            target=plan.target,
            urls=plan.urls,
            engines_before=plan.engines_before,
            to_create=plan.to_create,
            timeout_secs=plan.timeout_secs,
            clock=clock,
        )

    @property
    def engine_ids(self) -> list[str]:
        return list(self.engines)

    def add_engine(self, engine_id: str, url: str | None = None) -> EngineOutcome:
        """Record that ``engine_id`` was created (or attached) for this request; moves PENDING to CREATING
        (ray_native) or CONNECTING (external). Idempotent per engine."""
        engine_number(engine_id)
        if self.terminal:
            raise IllegalRequestTransition(self.request_id, self.status, self.status, "request already finished")
        outcome = self.engines.get(engine_id)
        if outcome is None:
            outcome = self.engines[engine_id] = EngineOutcome(engine_id, url=url, state=EngineState.PENDING)
        elif url is not None:
            outcome.url = url
        if self.status is ScaleOutStatus.PENDING:
            self._enter(self._first_phase)
        return outcome

    @property
    def _first_phase(self) -> ScaleOutStatus:
        return ScaleOutStatus.CREATING if self.kind is ScaleKind.RAY_NATIVE else ScaleOutStatus.CONNECTING

    def observe(self, pool: EnginePool) -> ScaleOutStatus:
        """Refresh engine outcomes from the pool and move the status up to the furthest phase any engine
        reached. Never ends the request (that is the shell's decision, see :func:`decide_partial_outcome`);
        after the end it still refreshes outcomes, e.g. to show rolled-back engines as REMOVED."""
        rank = 0
        for engine_id, outcome in self.engines.items():
            if engine_id in pool:
                record = pool.get(engine_id)
                outcome.update_from(record)
                rank = max([rank, *(ENGINE_RANK.get(state, 0) for state, _ in record.transitions)])
        if not self.terminal:
            chain = [self._first_phase, ScaleOutStatus.HEALTH_CHECKING, ScaleOutStatus.WEIGHT_SYNCING]
            for status in chain[: max(0, rank)]:
                if SCALE_OUT_RANK[status] > SCALE_OUT_RANK[self.status]:
                    self._enter(status)
        return self.status

    def advance(self, status: ScaleOutStatus | str, error: str | None = None) -> ScaleOutStatus:
        """Move to ``status`` (same status: no-op). Once cancel was requested, any end is CANCELLED.

        Raises :class:`IllegalRequestTransition` for a move the state machine forbids, or CREATING for an
        external request / CONNECTING for a ray_native one.
        """
        status = ScaleOutStatus(status)
        if status is self.status and not self.terminal:
            return self.status
        if self.terminal or not self.status.can_transition_to(status):
            raise IllegalRequestTransition(self.request_id, self.status, status)
        if status in (ScaleOutStatus.CREATING, ScaleOutStatus.CONNECTING) and status is not self._first_phase:
            raise IllegalRequestTransition(self.request_id, self.status, status, f"a {self.kind.value} request")
        if status.terminal and self.cancel_requested:
            status = ScaleOutStatus.CANCELLED  # sticky: whatever the shell saw last, the user asked to stop
        if error is not None:
            self.error = error
        elif status is ScaleOutStatus.FAILED and self.error is None:
            self.error = "scale-out failed"
        self._enter(status)
        return self.status

    def fail(self, error: str) -> ScaleOutStatus:
        return self.advance(ScaleOutStatus.FAILED, error)

    def request_cancel(self) -> bool:
        """Ask this request to stop; returns True the first time. Raises :class:`NotCancellable` once it ended.

        Only sets the sticky flag: the shell sees it at its next step, tears down the engines not yet ACTIVE and
        advances to CANCELLED (any other end is turned into CANCELLED).
        """
        if self.terminal:
            raise NotCancellable(self.request_id, self.status.value)
        if self.cancel_requested:
            return False
        self.cancel_requested = True
        self.cancel_requested_at = self.clock()
        return True

    def timings(self) -> dict[str, Any]:
        """Request totals: end-to-end ``total_s``, seconds per status, and per phase the slowest engine
        (engines start in parallel, so the slowest one is the phase's share of the end-to-end latency)."""
        out: dict[str, Any] = {"total_s": self._total_s(), "in_status_s": self._in_status_s()}
        for key in ("placement_wait_s", "start_s", "health_s", "weight_sync_s"):
            values = [o.timings[key] for o in self.engines.values() if o.timings.get(key) is not None]
            out[key] = max(values) if values else None
        return out

    def to_dict(self) -> dict[str, Any]:
        """The REST record (schema: ``ScaleOutRequestView``)."""
        return {
            "request_id": self.request_id,
            "direction": self.direction.value,
            "model_name": self.model_name,
            "kind": self.kind.value,
            "status": self.status.value,
            "target": self.target,
            "urls": list(self.urls),
            "engines_before": self.engines_before,
            "to_create": self.to_create,
            "timeout_secs": self.timeout_secs,
            "engine_ids": self.engine_ids,
            "engines": [o.to_dict() for o in self.engines.values()],
            "error": self.error,
            "cancel_requested": self.cancel_requested,
            "cancel_requested_at": self.cancel_requested_at,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "transitions": [{"status": s.value, "at": at} for s, at in self.transitions],
            "timings": self.timings(),
        }


@dataclass
class VictimOutcome:
    """One engine of a scale-in: where its removal got to, how long the drain and the shutdown took."""

    engine_id: str
    url: str | None
    kind: EngineKind
    state: EngineState | None = None
    error: str | None = None
    aborted_requests: int = 0  # left in flight at the drain timeout (or at once with force): retried elsewhere
    drain_started_at: float | None = None
    drained_at: float | None = None
    removed_at: float | None = None

    @property
    def drain_s(self) -> float | None:
        if self.drain_started_at is None or self.drained_at is None:
            return None
        return max(0.0, self.drained_at - self.drain_started_at)

    @property
    def shutdown_s(self) -> float | None:
        if self.drained_at is None or self.removed_at is None:
            return None
        return max(0.0, self.removed_at - self.drained_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "url": self.url,
            "kind": self.kind.value,
            "state": self.state.value if self.state else None,
            "error": self.error,
            "aborted_requests": self.aborted_requests,
            "drain_s": self.drain_s,
            "shutdown_s": self.shutdown_s,
        }


@dataclass(kw_only=True)
class ScaleInRequest(_Lifecycle):
    """The record of one scale-in, as ``GET /rollout/scale_in/{id}`` shows it. Scale-in is not cancellable:
    a half-drained engine is already out of the router, and putting it back would race the drain."""

    direction: ClassVar[Direction] = Direction.SCALE_IN

    request_id: str
    model_name: str
    created_at: float
    seq: int = 0
    target: int | None = None
    urls: tuple[str, ...] = ()
    engines_before: int = 0
    force: bool = False
    timeout_secs: float | None = None
    status: ScaleInStatus = ScaleInStatus.PENDING
    error: str | None = None
    victims: dict[str, VictimOutcome] = field(default_factory=dict)
    transitions: list[tuple[ScaleInStatus, float]] = field(default_factory=list)
    clock: Clock = field(default=time.time, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.transitions:
            self.transitions.append((self.status, self.created_at))

    @classmethod
    def from_plan(cls, plan: ScaleInPlan, request_id: str, *, seq: int = 0, clock: Clock = time.time) -> ScaleInRequest:
        if plan.dry_run:
            raise ValueError("a dry-run scale-in plan is only shown, never registered")
        return cls(
            request_id=request_id,
            model_name=plan.model_name,
            created_at=clock(),
            seq=seq,
            target=plan.target,
            urls=plan.urls,
            engines_before=plan.engines_before,
            force=plan.force,
            timeout_secs=plan.timeout_secs,
            victims={v.engine_id: VictimOutcome(v.engine_id, v.url, v.kind) for v in plan.victims},
            clock=clock,
        )

    @property
    def victim_ids(self) -> list[str]:
        return list(self.victims)

    def advance(self, status: ScaleInStatus | str, error: str | None = None) -> ScaleInStatus:
        """Move to ``status`` (same status: no-op); raises :class:`IllegalRequestTransition` otherwise."""
        status = ScaleInStatus(status)
        if status is self.status and not self.terminal:
            return self.status
        if not self.status.can_transition_to(status):
            raise IllegalRequestTransition(self.request_id, self.status, status)
        if error is not None:
            self.error = error
        elif status is ScaleInStatus.FAILED and self.error is None:
            self.error = "scale-in failed"
        self._enter(status)
        return self.status

    def fail(self, error: str) -> ScaleInStatus:
        return self.advance(ScaleInStatus.FAILED, error)

    def note_drained(self, engine_id: str, *, aborted_requests: int = 0) -> None:
        """The victim's in-flight count reached zero, or the drain timed out with ``aborted_requests`` left."""
        _check_count(aborted_requests, "aborted_requests")
        victim = self._victim(engine_id)
        victim.drained_at = self.clock()
        victim.aborted_requests = aborted_requests

    def note_error(self, engine_id: str, error: str) -> None:
        self._victim(engine_id).error = error

    def _victim(self, engine_id: str) -> VictimOutcome:
        try:
            return self.victims[engine_id]
        except KeyError:
            raise KeyError(f"{engine_id} is not a victim of {self.request_id}") from None

    def observe(self, pool: EnginePool) -> ScaleInStatus:
        """Refresh victim states and drain/removal timestamps from the pool."""
        for engine_id, victim in self.victims.items():
            if engine_id not in pool:
                continue
            record = pool.get(engine_id)
            victim.state = record.state
            victim.error = record.last_error or victim.error
            victim.drain_started_at = record.entered_at(EngineState.DRAINING)
            removed = record.entered_at(EngineState.REMOVED)
            victim.removed_at = removed if removed is not None else record.entered_at(EngineState.FAILED)
        return self.status

    def to_dict(self) -> dict[str, Any]:
        """The REST record (schema: ``ScaleInRequestView``)."""
        return {
            "request_id": self.request_id,
            "direction": self.direction.value,
            "model_name": self.model_name,
            "status": self.status.value,
            "target": self.target,
            "urls": list(self.urls),
            "engines_before": self.engines_before,
            "force": self.force,
            "timeout_secs": self.timeout_secs,
            "victims": [v.to_dict() for v in self.victims.values()],
            "error": self.error,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "transitions": [{"status": s.value, "at": at} for s, at in self.transitions],
            "timings": {"total_s": self._total_s(), "in_status_s": self._in_status_s()},
        }


ScaleRequest = ScaleOutRequest | ScaleInRequest
