"""The staleness gate and its blocked-time signal, on a hand-driven clock.

(docs/architecture.md, "Weights and staleness".)
"""

from __future__ import annotations

import pytest

from relax.data.staleness import BlockedTimeTracker, GateReason, StalenessGate


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def test_on_policy_waits_for_previous_training_step() -> None:
    gate = StalenessGate(0, FakeClock())
    assert gate.can_start(0, engine_version=0, waiting_partitions=0).ok
    d = gate.can_start(1, engine_version=0, waiting_partitions=0)
    assert not d.ok and d.reason is GateReason.WEIGHTS_TOO_OLD
    assert "needs weights >= v1" in d.message
    assert gate.can_start(1, engine_version=1, waiting_partitions=0)
    # version ok but partition 0 is still waiting for the trainer: only one may wait at once
    d = gate.can_start(1, engine_version=1, waiting_partitions=1)
    assert not d and d.reason is GateReason.TOO_MANY_WAITING


@pytest.mark.parametrize(
    ("s", "step", "version", "waiting", "ok"),
    [
        (2, 2, 0, 2, True),  # two steps ahead of v0 allowed; 3 would wait in total
        (2, 3, 0, 2, False),  # weights too old
        (2, 3, 1, 2, True),
        (2, 3, 1, 3, False),  # 4 partitions would wait
        (1, 5, 4, 1, True),
        (1, 5, 3, 0, False),
    ],
)
def test_gate_bounds(s: int, step: int, version: int, waiting: int, ok: bool) -> None:
    gate = StalenessGate(s, FakeClock())
    assert gate.max_waiting_partitions == s + 1
    assert gate.min_engine_version(step) == step - s
    assert gate.can_start(step, version, waiting).ok is ok


def test_weights_checked_before_queue() -> None:
    d = StalenessGate(1, FakeClock()).can_start(5, engine_version=0, waiting_partitions=9)
    assert d.reason is GateReason.WEIGHTS_TOO_OLD


def test_invalid_arguments() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            StalenessGate(bad, FakeClock())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StalenessGate(0, FakeClock()).can_start(-1, 0, 0)


def test_blocked_fraction_tracks_gate_answers() -> None:
    clock = FakeClock(100.0)
    gate = StalenessGate(0, clock)
    gate.can_start(0, 0, 0)  # ok -> running
    clock.advance(10)
    gate.can_start(1, 0, 0)  # blocked from t=110
    clock.advance(5)
    gate.can_start(1, 0, 0)  # still blocked: no double counting
    clock.advance(5)
    assert gate.blocked_fraction() == pytest.approx(10 / 20)
    gate.can_start(1, 1, 0)  # unblocked at t=120
    clock.advance(20)
    assert gate.blocked_fraction() == pytest.approx(10 / 40)
    assert gate.blocked_fraction(window_secs=25) == pytest.approx(5 / 25)
    assert gate.blocked_fraction(window_secs=10) == 0.0
    assert gate.last_decision is not None and gate.last_decision.ok


def test_read_only_query_does_not_record() -> None:
    clock = FakeClock()
    gate = StalenessGate(0, clock)
    gate.can_start(3, 0, 0, record=False)
    clock.advance(10)
    assert gate.blocked_fraction() == 0.0 and gate.last_decision is None


def test_tracker_ongoing_block_window_and_idle() -> None:
    clock = FakeClock()
    t = BlockedTimeTracker(clock, history_secs=100)
    assert t.blocked_fraction() == 0.0  # no time has passed
    t.set_blocked(True)
    assert t.blocked_fraction() == 1.0
    clock.advance(4)
    assert t.blocked_fraction(window_secs=60) == 1.0  # window capped at the tracker's life
    t.set_blocked(False)
    clock.advance(200)
    assert t.blocked_fraction() == 0.0  # history capped at 100 s; old interval pruned on next close
    t.set_blocked(True)
    clock.advance(50)
    assert t.blocked_fraction() == pytest.approx(0.5)
    assert t.blocked and t.blocked_fraction(window_secs=50) == 1.0  # the ongoing block counts up to now
    with pytest.raises(ValueError):
        t.blocked_fraction(0)


def test_mark_idle_stops_counting() -> None:
    clock = FakeClock()
    gate = StalenessGate(0, clock)
    gate.can_start(1, 0, 0)
    clock.advance(3)
    gate.mark_idle()
    clock.advance(3)
    assert gate.blocked_fraction() == pytest.approx(0.5)
