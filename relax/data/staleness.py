"""The staleness gate of fully-async GRPO and the blocked-time signal it produces.

(docs/architecture.md, "Weights and staleness".)

Rollout runs ahead of training. Two rules bound how far:

1. **Weights.** Rollout step ``k`` may start only when the engines hold weights of version
   ``>= k - max_staleness``. Training step ``k`` publishes version ``k + 1``, so with ``max_staleness = 0``
   step ``k`` waits for the trainer to finish step ``k - 1``: strictly on-policy.
2. **Queue.** At most ``max_staleness + 1`` partitions may be waiting for the trainer, counting the one
   about to start. In a steady state rule 1 already implies this; rule 2 is the memory bound that still
   holds when version reports lag or an engine joins with newer weights than its peers.

The gate also measures how much of the time the rollout loop spends blocked. A loop that is often
blocked by the gate does not need more engines (they would only wait too); the autoscaler reads this
fraction as an RL-specific signal beside the engines' own metrics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

Clock = Callable[[], float]

__all__ = ["BlockedTimeTracker", "Decision", "GateReason", "StalenessGate"]


class GateReason(str, Enum):
    OK = "ok"
    WEIGHTS_TOO_OLD = "weights_too_old"
    TOO_MANY_WAITING = "too_many_waiting"


@dataclass(frozen=True)
class Decision:
    """Whether a rollout step may start, and if not, what it waits for (in words for logs)."""

    ok: bool
    reason: GateReason
    message: str = ""

    def __bool__(self) -> bool:
        return self.ok


class BlockedTimeTracker:
    """Accumulates the intervals during which a loop was blocked, on an injected clock.

    ``blocked_fraction(window)`` answers "what share of the last ``window`` seconds was blocked"; only
    intervals that can still overlap the longest window asked about (``history_secs``) are kept.
    """

    def __init__(self, clock: Clock, *, history_secs: float = 600.0) -> None:
        if history_secs <= 0:
            raise ValueError("history_secs must be > 0")
        self._clock = clock
        self._history = history_secs
        self._started = clock()
        self._blocked_since: float | None = None
        self._intervals: deque[tuple[float, float]] = deque()  # closed (start, end) blocked intervals

    @property
    def blocked(self) -> bool:
        return self._blocked_since is not None

    def set_blocked(self, blocked: bool) -> None:
        """Record the loop's state from now on; repeating the current state changes nothing."""
        now = self._clock()
        if blocked and self._blocked_since is None:
            self._blocked_since = now
        elif not blocked and self._blocked_since is not None:
            start, self._blocked_since = self._blocked_since, None
            self._intervals.append((start, now))
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._intervals and self._intervals[0][1] < now - self._history:
            self._intervals.popleft()

    def blocked_fraction(self, window_secs: float | None = None) -> float:
        """Share of the last ``window_secs`` (default: since creation, capped by history) spent blocked.

        A window longer than the tracker's life is shortened to its life, so a loop that has been
        blocked for its whole 5 s of existence reports 1.0, not 5/60.
        """
        now = self._clock()
        span = now - self._started
        if window_secs is not None:
            if window_secs <= 0:
                raise ValueError("window_secs must be > 0")
            span = min(span, window_secs)
        span = min(span, self._history)
        if span <= 0:
            return 1.0 if self.blocked else 0.0
        lo = now - span
        blocked = sum(max(0.0, end - max(start, lo)) for start, end in self._intervals)
        if self._blocked_since is not None:
            blocked += now - max(self._blocked_since, lo)
        return min(1.0, blocked / span)


class StalenessGate:
    """Decides whether rollout step ``k`` may start; pure except for the blocked-time bookkeeping."""

    def __init__(self, max_staleness: int, clock: Clock, *, history_secs: float = 600.0) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        self.max_staleness = max_staleness
        self.tracker = BlockedTimeTracker(clock, history_secs=history_secs)
        self._last: Decision | None = None

    @property
    def max_waiting_partitions(self) -> int:
        """Partitions that may wait for the trainer at once, including the one being started."""
        return self.max_staleness + 1

    def min_engine_version(self, step: int) -> int:
        """The oldest weight version allowed to generate step ``step``."""
        return step - self.max_staleness

    def can_start(self, step: int, engine_version: int, waiting_partitions: int, *, record: bool = True) -> Decision:
        """May rollout step ``step`` start now?

        ``engine_version`` is the *lowest* weight version among the engines that will serve the step;
        ``waiting_partitions`` counts partitions rollout has started (filling or complete) that the
        trainer has not taken yet, not counting ``step`` itself.

        With ``record`` (the default) the answer also updates the blocked-time tracker: the rollout loop
        calls this whenever it tries to start a step, so "last answer was no" is "the loop is blocked".
        Pass ``record=False`` for read-only queries (status pages).
        """
        if step < 0 or waiting_partitions < 0:
            raise ValueError("step and waiting_partitions must be >= 0")
        need = self.min_engine_version(step)
        if engine_version < need:
            decision = Decision(
                False,
                GateReason.WEIGHTS_TOO_OLD,
                f"step {step} needs weights >= v{need} (max_staleness {self.max_staleness}); "
                f"engines hold v{engine_version}",
            )
        elif waiting_partitions + 1 > self.max_waiting_partitions:
            decision = Decision(
                False,
                GateReason.TOO_MANY_WAITING,
                f"step {step} would make {waiting_partitions + 1} partitions wait for the trainer; "
                f"at most {self.max_waiting_partitions} may (max_staleness {self.max_staleness})",
            )
        else:
            decision = Decision(True, GateReason.OK)
        if record:
            self.tracker.set_blocked(not decision.ok)
            self._last = decision
        return decision

    @property
    def last_decision(self) -> Decision | None:
        return self._last

    def mark_idle(self) -> None:
        """The loop stopped trying (shutdown, end of training): stop counting time as blocked."""
        self.tracker.set_blocked(False)

    def blocked_fraction(self, window_secs: float | None = None) -> float:
        return self.tracker.blocked_fraction(window_secs)
