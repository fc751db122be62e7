"""The event history behind ``GET /rollout/events`` (docs/architecture.md, "Scale requests").

Every scale action, engine state change, eviction and failure is appended here, so that an operator can
answer "what happened to engine_7 at 03:12?" without grepping logs across nodes. The log is bounded
(oldest events are dropped first) and pure: the clock is injected and nothing here does I/O.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from relax.rollout.pool.engines import EngineRecord, EngineState, TransitionListener

Clock = Callable[[], float]

__all__ = ["SCALE_EVENT_KINDS", "Event", "EventKind", "EventLog", "transition_recorder"]


class EventKind(str, Enum):
    SCALE_OUT_REQUESTED = "scale_out_requested"
    SCALE_IN_REQUESTED = "scale_in_requested"
    SCALE_COMPLETED = "scale_completed"
    SCALE_FAILED = "scale_failed"
    SCALE_CANCELLED = "scale_cancelled"
    ENGINE_STATE = "engine_state"  # a lifecycle transition (docs/architecture.md, "Engine lifecycle")
    ENGINE_FAILED = "engine_failed"
    ENGINE_EVICTED = "engine_evicted"
    ENGINE_RESTARTED = "engine_restarted"  # an initial engine replaced in its own bundle
    REQUESTS_RETRIED = "requests_retried"  # in-flight requests moved off a failing/draining engine
    WEIGHTS_PUBLISHED = "weights_published"
    WEIGHTS_MISMATCH = "weights_mismatch"  # an engine's served weights differ from the version it was sent
    AUTOSCALER_DECISION = "autoscaler_decision"


SCALE_EVENT_KINDS: tuple[EventKind, ...] = (
    EventKind.SCALE_OUT_REQUESTED,
    EventKind.SCALE_IN_REQUESTED,
    EventKind.SCALE_COMPLETED,
    EventKind.SCALE_FAILED,
    EventKind.SCALE_CANCELLED,
    EventKind.ENGINE_EVICTED,
    EventKind.ENGINE_FAILED,
    EventKind.ENGINE_RESTARTED,
)
"""The kinds counted by ``relax_scale_events_total``: scale actions, evictions and engine failures."""


@dataclass(frozen=True)
class Event:
    """One entry; ``seq`` increases by one per append and is never reused, so pollers can resume."""

    seq: int
    kind: EventKind
    timestamp: float
    message: str = ""
    engine_ids: tuple[str, ...] = ()
    request_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "kind": self.kind.value,
            "timestamp": self.timestamp,
            "message": self.message,
            "engine_ids": list(self.engine_ids),
            "request_id": self.request_id,
            "details": dict(self.details),
        }


class EventLog:
    """A bounded, append-only event history, newest answers first."""

    def __init__(self, clock: Clock = time.time, capacity: int = 1000) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self._clock = clock
        self._events: deque[Event] = deque(maxlen=capacity)
        self._next_seq = 0
        self._counts: dict[EventKind, int] = {}

    @property
    def capacity(self) -> int:
        return self._events.maxlen or 0

    @property
    def total(self) -> int:
        """Events ever appended, dropped ones included."""
        return self._next_seq

    def counts(self) -> dict[str, int]:
        """Events ever appended per kind (a monotonic counter: dropped events still count)."""
        return {kind.value: n for kind, n in self._counts.items()}

    @property
    def dropped(self) -> int:
        return self._next_seq - len(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def append(
        self,
        kind: EventKind,
        message: str = "",
        *,
        engine_ids: Iterable[str] = (),
        request_id: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> Event:
        if isinstance(engine_ids, str):  # one id passed bare would otherwise become its characters
            engine_ids = (engine_ids,)
        event = Event(
            seq=self._next_seq,
            kind=EventKind(kind),
            timestamp=self._clock(),
            message=message,
            engine_ids=tuple(engine_ids),
            request_id=request_id,
            details=dict(details or {}),
        )
        self._next_seq += 1
        self._counts[event.kind] = self._counts.get(event.kind, 0) + 1
        self._events.append(event)
        return event

    def newest(
        self,
        limit: int | None = None,
        kind: EventKind | str | None = None,
        *,
        engine_id: str | None = None,
    ) -> list[Event]:
        """Up to ``limit`` events (all when ``None``), newest first, optionally of one kind / one engine."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
        wanted = None if kind is None else EventKind(kind)
        out: list[Event] = []
        for event in reversed(self._events):
            if limit is not None and len(out) >= limit:
                break
            if wanted is not None and event.kind is not wanted:
                continue
            if engine_id is not None and engine_id not in event.engine_ids:
                continue
            out.append(event)
        return out

    def since(self, seq: int) -> list[Event]:
        """Events with ``seq`` greater than ``seq``, oldest first (for a monitor that polls incrementally)."""
        return [e for e in self._events if e.seq > seq]

    def to_dict(
        self, limit: int | None = None, kind: EventKind | str | None = None, *, engine_id: str | None = None
    ) -> dict[str, Any]:
        """The ``GET /rollout/events`` body."""
        events = self.newest(limit, kind, engine_id=engine_id)
        return {"events": [e.to_dict() for e in events], "total": self.total, "dropped": self.dropped}


def transition_recorder(log: EventLog, latest_published: Callable[[], int | None] = lambda: None) -> TransitionListener:
    """The pool's ``on_transition`` hook: every engine transition becomes one event, in order.

    A move to FAILED is an ``engine_failed`` event carrying the error; a move to ACTIVE says where the engine
    serves and which weights it holds next to the newest published version (``latest_published``), which
    is how an operator checks that no engine joined with stale weights.
    """

    def record(engine: EngineRecord, src: EngineState, dst: EngineState) -> None:
        if dst is EngineState.FAILED:
            log.append(EventKind.ENGINE_FAILED, f"FAILED while {src.value}: {engine.last_error or 'unknown error'}",
                       engine_ids=engine.engine_id, details={"error": engine.last_error, "from": src.value})
        elif dst is EngineState.ACTIVE:
            held = engine.weight_version
            log.append(EventKind.ENGINE_STATE, f"ACTIVE at {engine.url} with weights v{held}",
                       engine_ids=engine.engine_id,
                       details={"weight_version": held, "latest_published": latest_published() or 0})
        else:
            log.append(EventKind.ENGINE_STATE, f"{dst.value} (from {src.value})", engine_ids=engine.engine_id)

    return record
