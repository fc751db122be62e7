"""An engine's bring-up, phase by phase: where the seconds from the decision to ACTIVE went.

Scale-out latency is what an operator of an elastic pool waits on, and it is made of very different parts:
capacity the provisioner has to add (minutes on a cloud), Ray starting the actor, the server loading the model
(tens of seconds), Relax's first answer through it, the weight sync and its check (sub-second to seconds).
Only the fleet sees the moments between them, so it reports each one here and reads the records back for
``/rollout/engines``, the events and ``/metrics``.

Pure, with an injected clock. The fleet can only see a phase change it causes or observes: while the launcher
starts the engine the current phase is ``start``; once the actor answers, its own figures split that span into
``actor``, ``prepare`` and ``server_start``. Likewise the check of the weights is split out of the weight sync
from the sync's own timings. The phases of one engine add up to its decision → end time.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from relax.logs import failure_cause

__all__ = ["BUCKETS_S", "BringUp", "BringUpLog", "Phase", "PhaseHistogram", "stop_reason"]


class Phase(str, Enum):
    """One part of a bring-up; the value is the name in ``/rollout/engines``, the events and ``/metrics``."""

    CAPACITY = "capacity"  # its placement group pending: the provisioner adding a node (elastic engines)
    START = "start"  # the launcher starting it (split into the three below once the actor answers)
    ACTOR = "actor"  # Ray starting the EngineActor's process on its node
    PREPARE = "prepare"  # the actor checking the backend on its node and staging the newest weights there
    SERVER_START = "server_start"  # the server process starting and loading the model until /health answers
    FIRST_ANSWER = "first_answer"  # Relax's first generation through it (/health_generate)
    WEIGHT_SYNC = "weight_sync"  # loading the newest weight version
    VERIFY = "verify"  # checking what it serves against the trainer's publication


#: Histogram buckets (seconds): sub-second syncs to minutes-long capacity waits.
BUCKETS_S: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class BringUp:
    """One engine's bring-up; times in seconds on the log's clock (the pool's: ``time.time``)."""

    engine_id: str
    decided_at: float
    phases: dict[Phase, float] = field(default_factory=dict)  # finished phases, in order, with their seconds
    current: Phase | None = None
    current_since: float | None = None
    ended_at: float | None = None
    outcome: str | None = None  # ACTIVE, or why it stopped

    def total_s(self, now: float) -> float:
        return round((self.ended_at if self.ended_at is not None else now) - self.decided_at, 3)

    def to_dict(self, now: float) -> dict[str, object]:
        return {"phases": {phase.value: round(seconds, 3) for phase, seconds in self.phases.items()},
                "current": self.current.value if self.current is not None else None,
                "current_for_s": None if self.current_since is None else round(now - self.current_since, 3),
                "total_s": self.total_s(now), "outcome": self.outcome}

    def summary(self) -> str:
        """``capacity 12.0s, actor 1.1s, server_start 20.3s, ... = 35.2s``: the line of the ACTIVE event."""
        parts = ", ".join(f"{phase.value} {seconds:.2f}s" for phase, seconds in self.phases.items())
        end = self.ended_at if self.ended_at is not None else self.decided_at
        return f"{parts} = {end - self.decided_at:.2f}s"


class PhaseHistogram:
    """Cumulative counts of finished phases per bucket (Prometheus' histogram shape), per phase."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts: dict[Phase, list[int]] = {}
        self.sums: dict[Phase, float] = {}

    def observe(self, phase: Phase, seconds: float) -> None:
        counts = self.counts.setdefault(phase, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sums[phase] = self.sums.get(phase, 0.0) + seconds

    def to_dict(self) -> dict[str, dict[str, object]]:
        """Per phase: ``buckets`` as ``[[le, cumulative count], ...]`` ending with ``"+Inf"``, ``count``, ``sum``."""
        out: dict[str, dict[str, object]] = {}
        for phase, counts in self.counts.items():
            running, cumulative = 0, []
            for bound, count in zip((*self.buckets, "+Inf"), counts, strict=True):
                running += count
                cumulative.append([bound, running])
            out[phase.value] = {"buckets": cumulative, "count": running, "sum": round(self.sums[phase], 6)}
        return out


class BringUpLog:
    """Every engine's bring-up, newest last; the phases of those that became ACTIVE also go into one histogram per
    phase."""

    def __init__(self, clock: Callable[[], float], keep: int = 256) -> None:
        self._clock = clock
        self._keep = keep
        self._bring_ups: dict[str, BringUp] = {}
        self.histogram = PhaseHistogram()

    def begin(self, engine_id: str, decided_at: float) -> BringUp:
        """Open (once) the record of an engine decided at ``decided_at``."""
        record = self._bring_ups.get(engine_id)
        if record is None:
            record = self._bring_ups[engine_id] = BringUp(engine_id, decided_at)
            while len(self._bring_ups) > self._keep:
                del self._bring_ups[next(iter(self._bring_ups))]
        return record

    def enter(self, engine_id: str, phase: Phase) -> None:
        """The engine moves on to ``phase``: the current one ends now (the first phase starts at the decision)."""
        record = self._bring_ups.get(engine_id)
        if record is None or record.ended_at is not None:
            return
        now = self._clock()
        self._close(record, now)
        # the first phase runs from the decision: the wait to be picked up (a scale request queued) counts in it
        first = record.current is None and not record.phases
        record.current, record.current_since = phase, record.decided_at if first else now

    def split(self, engine_id: str, phase: Phase, parts: Mapping[Phase, float | None]) -> None:
        """Replace the finished ``phase`` by ``parts`` (the actor's own figures, or the sync's), scaled to add up
        to it; the remainder goes to the first part. Unknown figures leave ``phase`` as it is."""
        record = self._bring_ups.get(engine_id)
        if record is None or phase not in record.phases or any(v is None or v < 0 for v in parts.values()):
            return
        whole = record.phases[phase]
        known = {p: float(v or 0.0) for p, v in parts.items()}
        if sum(known.values()) > whole:
            scale = whole / sum(known.values()) if sum(known.values()) else 0.0
            known = {p: v * scale for p, v in known.items()}
        first = next(iter(known))
        known[first] += whole - sum(known.values())
        phases = {}
        for existing, seconds in record.phases.items():
            if existing is phase:
                phases.update(known)
            else:
                phases[existing] = seconds
        record.phases = phases

    def end(self, engine_id: str, outcome: str,
            splits: Mapping[Phase, Mapping[Phase, float | None]] | None = None) -> BringUp | None:
        """The bring-up is over (``ACTIVE`` or why not): the current phase ends, ``splits`` apply (as
        :meth:`split`), and every phase is counted in the histogram."""
        record = self._bring_ups.get(engine_id)
        if record is None or record.ended_at is not None:
            return None
        now = self._clock()
        self._close(record, now)
        record.current = record.current_since = None
        for phase, parts in (splits or {}).items():
            self.split(engine_id, phase, parts)
        record.ended_at, record.outcome = now, outcome
        if outcome == "ACTIVE":  # the histogram describes bring-ups that made it; a stopped one is in its record
            for phase, seconds in record.phases.items():
                self.histogram.observe(phase, seconds)
        return record

    def get(self, engine_id: str) -> BringUp | None:
        return self._bring_ups.get(engine_id)

    def view(self, engine_id: str) -> dict[str, object] | None:
        record = self._bring_ups.get(engine_id)
        return None if record is None else record.to_dict(self._clock())

    @staticmethod
    def _close(record: BringUp, now: float) -> None:
        if record.current is not None and record.current_since is not None:
            spent = max(0.0, now - record.current_since)
            record.phases[record.current] = record.phases.get(record.current, 0.0) + spent


def stop_reason(exc: BaseException, state: str, *, shutting_down: bool, deadline_s: float | None,
                past_deadline: bool) -> tuple[str, bool]:
    """Why a bring-up stopped: ``exc`` is what stopped it, ``state`` the engine's state then.

    Returns ``(reason, failed)``: ``failed`` is False when the engine did nothing wrong (the run is shutting
    down), so it is removed rather than failed and not logged as a failure. A message the error carries is
    kept; a bare one is named by what really happened: the run's shutdown, the scale-out's deadline with its
    value, or a cancellation with no cause given.
    """
    if shutting_down:
        return f"stopped while {state}: the run is shutting down", False
    bare = isinstance(exc, asyncio.CancelledError | asyncio.TimeoutError | TimeoutError) and not str(exc)
    if not bare:
        return failure_cause(exc), True
    if past_deadline and deadline_s is not None:
        return (f"not ACTIVE within the scale-out timeout ({deadline_s:g} s, --scale-out-timeout or the request's "
                f"timeout_secs); it was {state}"), True
    return f"cancelled while {state} (no cause given)", True
