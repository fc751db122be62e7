"""Event history behind GET /rollout/events: ordering, limits, filters, bounded capacity.

(docs/architecture.md, "Scale requests".)
"""

from __future__ import annotations

import pytest

from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import Event, EventKind, EventLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_append_records_fields_on_the_injected_clock() -> None:
    log = EventLog(FakeClock())
    event = log.append(
        EventKind.SCALE_OUT_REQUESTED,
        "scale out to 6",
        engine_ids=["engine_4", "engine_5"],
        request_id="req-1",
        details={"num_replicas": 6},
    )
    assert event == Event(
        seq=0,
        kind=EventKind.SCALE_OUT_REQUESTED,
        timestamp=101.0,
        message="scale out to 6",
        engine_ids=("engine_4", "engine_5"),
        request_id="req-1",
        details={"num_replicas": 6},
    )
    assert event.to_dict() == {
        "seq": 0,
        "kind": "scale_out_requested",
        "timestamp": 101.0,
        "message": "scale out to 6",
        "engine_ids": ["engine_4", "engine_5"],
        "request_id": "req-1",
        "details": {"num_replicas": 6},
    }


def test_a_bare_engine_id_is_one_id() -> None:
    event = EventLog(FakeClock()).append(EventKind.ENGINE_EVICTED, engine_ids="engine_12")
    assert event.engine_ids == ("engine_12",)


def test_newest_first_with_limit_and_kind() -> None:
    log = EventLog(FakeClock())
    log.append(EventKind.SCALE_OUT_REQUESTED, "a")
    log.append(EventKind.ENGINE_STATE, "b", engine_ids=["engine_1"])
    log.append(EventKind.ENGINE_FAILED, "c", engine_ids=["engine_2"])
    log.append(EventKind.ENGINE_STATE, "d", engine_ids=["engine_2"])
    assert [e.message for e in log.newest()] == ["d", "c", "b", "a"]
    assert [e.message for e in log.newest(2)] == ["d", "c"]
    assert log.newest(0) == []
    assert [e.message for e in log.newest(kind=EventKind.ENGINE_STATE)] == ["d", "b"]
    assert [e.message for e in log.newest(1, kind="engine_state")] == ["d"]
    assert [e.message for e in log.newest(engine_id="engine_2")] == ["d", "c"]
    assert [e.message for e in log.newest(kind=EventKind.WEIGHTS_PUBLISHED)] == []
    timestamps = [e.timestamp for e in log.newest()]
    assert timestamps == sorted(timestamps, reverse=True)


def test_bad_arguments() -> None:
    log = EventLog(FakeClock())
    with pytest.raises(ValueError):
        log.newest(-1)
    with pytest.raises(ValueError):
        log.newest(kind="no_such_kind")
    with pytest.raises(ValueError):
        log.append("no_such_kind")  # type: ignore[arg-type]
    for bad in [0, -5, True]:
        with pytest.raises(ValueError):
            EventLog(FakeClock(), capacity=bad)


def test_capacity_drops_oldest_and_seq_keeps_counting() -> None:
    log = EventLog(FakeClock(), capacity=3)
    for i in range(5):
        log.append(EventKind.ENGINE_STATE, str(i))
    assert len(log) == 3 and log.capacity == 3
    assert log.total == 5 and log.dropped == 2
    assert [e.message for e in log.newest()] == ["4", "3", "2"]
    assert [e.seq for e in log.newest()] == [4, 3, 2]


def test_since_resumes_a_poller_oldest_first() -> None:
    log = EventLog(FakeClock())
    for i in range(4):
        log.append(EventKind.SCALE_COMPLETED, str(i))
    assert [e.message for e in log.since(1)] == ["2", "3"]
    assert log.since(3) == []
    assert [e.seq for e in log.since(-1)] == [0, 1, 2, 3]


def test_to_dict_is_the_rest_body() -> None:
    log = EventLog(FakeClock(), capacity=2)
    log.append(EventKind.SCALE_IN_REQUESTED, "x")
    log.append(EventKind.ENGINE_EVICTED, "y", engine_ids=["engine_3"])
    log.append(EventKind.ENGINE_STATE, "z", engine_ids=["engine_3"])
    body = log.to_dict(limit=1)
    assert body["total"] == 3 and body["dropped"] == 1
    assert [e["message"] for e in body["events"]] == ["z"]
    assert [e["kind"] for e in log.to_dict(kind=EventKind.ENGINE_EVICTED)["events"]] == ["engine_evicted"]


def test_pool_transitions_feed_the_log() -> None:
    """The manager wires EnginePool(on_transition=...) to the event log; every move is recorded in order."""
    clock = FakeClock()
    log = EventLog(clock)

    def on_transition(record, src, dst) -> None:  # noqa: ANN001
        kind = EventKind.ENGINE_FAILED if dst is EngineState.FAILED else EventKind.ENGINE_STATE
        log.append(
            kind, f"{src.value} -> {dst.value}", engine_ids=[record.engine_id], details={"error": record.last_error}
        )

    pool = EnginePool(clock, on_transition=on_transition)
    engine_id = pool.add(EngineKind.ELASTIC).engine_id
    pool.transition(engine_id, EngineState.STARTING)
    pool.transition(engine_id, EngineState.FAILED, error="OOM")
    assert [e.message for e in log.newest(engine_id=engine_id)] == ["STARTING -> FAILED", "PENDING -> STARTING"]
    assert log.newest(1)[0].kind is EventKind.ENGINE_FAILED and log.newest(1)[0].details == {"error": "OOM"}


def test_counts_are_monotonic_even_when_events_are_dropped() -> None:
    log = EventLog(capacity=2)
    for _ in range(5):
        log.append(EventKind.ENGINE_FAILED)
    log.append(EventKind.SCALE_COMPLETED)
    assert len(log) == 2
    assert log.counts() == {"engine_failed": 5, "scale_completed": 1}
