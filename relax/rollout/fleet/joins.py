"""How long an engine takes to join: from the decision to start it to its first answer on current weights.

Pure: the fleet reports the two moments it sees (an engine became ACTIVE; a request it served was answered)
and reads the records back for ``/rollout/engines``, ``RolloutManager.status()`` and Relax's ``/metrics``.

"First token" is bounded by the first *answer*: the engines report no per-request time to first token, and
an engine joins the router only once it holds the newest version, so its first answer was generated on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Join", "JoinLog"]


@dataclass
class Join:
    """One engine's join; times in seconds on the caller's clock (the pool's: ``time.time``)."""

    engine_id: str
    kind: str
    weight_version: int | None
    decided_at: float
    active_at: float
    answered_at: float | None = None
    answer_weight_version: int | None = None

    @property
    def decision_to_active_s(self) -> float:
        return round(self.active_at - self.decided_at, 3)

    @property
    def decision_to_first_answer_s(self) -> float | None:
        return None if self.answered_at is None else round(self.answered_at - self.decided_at, 3)

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "weight_version": self.weight_version,
                "decision_to_active_s": self.decision_to_active_s,
                "decision_to_first_answer_s": self.decision_to_first_answer_s,
                "answer_weight_version": self.answer_weight_version}

    def message(self) -> str:
        return (f"joined: decision -> ACTIVE {self.decision_to_active_s:.1f}s, -> first answer on weights "
                f"v{self.answer_weight_version} {self.decision_to_first_answer_s:.1f}s")


class JoinLog:
    """Every engine's join, in the order they became ACTIVE (a restarted engine is a new engine id)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._joins: dict[str, Join] = {}

    def active(self, engine_id: str, *, kind: str, weight_version: int | None, decided_at: float,
               active_at: float) -> Join:
        join = Join(engine_id, kind, weight_version, decided_at, active_at)
        self._joins[engine_id] = join
        return join

    def answered(self, engine_id: str, weight_version: int) -> Join | None:
        """Record an answer; returns the join when this was its first (the moment to report it), else None."""
        join = self._joins.get(engine_id)
        if join is None or join.answered_at is not None:
            return None
        join.answered_at = self._clock()
        join.answer_weight_version = weight_version
        return join

    def get(self, engine_id: str) -> Join | None:
        return self._joins.get(engine_id)

    def latest_answered(self) -> Join | None:
        """The newest engine that joined and answered (what the /metrics gauges show)."""
        return next((j for j in reversed(self._joins.values()) if j.answered_at is not None), None)

    def to_dict(self) -> dict[str, dict[str, object]]:
        return {engine_id: join.to_dict() for engine_id, join in self._joins.items()}
