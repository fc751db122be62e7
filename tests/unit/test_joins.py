"""relax.rollout.fleet.joins: decision -> ACTIVE -> first answer, closed once, the newest answered one reported."""

from __future__ import annotations

from relax.rollout.fleet.joins import JoinLog


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_join_closes_on_its_first_answer_only() -> None:
    clock = Clock()
    log = JoinLog(clock)
    join = log.active("engine_2", kind="elastic", weight_version=4, decided_at=90.0, active_at=98.5)
    assert join.decision_to_active_s == 8.5 and join.decision_to_first_answer_s is None
    assert log.latest_answered() is None
    clock.now = 99.25
    assert log.answered("engine_2", 4) is join
    assert join.decision_to_first_answer_s == 9.25 and join.answer_weight_version == 4
    clock.now = 150.0
    assert log.answered("engine_2", 5) is None  # a later answer changes nothing
    assert log.to_dict()["engine_2"] == {"kind": "elastic", "weight_version": 4, "decision_to_active_s": 8.5,
                                         "decision_to_first_answer_s": 9.25, "answer_weight_version": 4}
    assert join.message() == "joined: decision -> ACTIVE 8.5s, -> first answer on weights v4 9.2s"


def test_answers_of_unknown_engines_are_ignored_and_the_newest_answered_join_is_reported() -> None:
    clock = Clock()
    log = JoinLog(clock)
    assert log.answered("engine_9", 0) is None and log.get("engine_9") is None
    log.active("engine_0", kind="initial", weight_version=0, decided_at=0.0, active_at=10.0)
    log.active("engine_1", kind="elastic", weight_version=1, decided_at=50.0, active_at=60.0)
    log.answered("engine_0", 0)
    assert log.latest_answered() is log.get("engine_0")  # engine_1 has not answered yet
    log.answered("engine_1", 1)
    assert log.latest_answered() is log.get("engine_1")
