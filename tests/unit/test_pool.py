"""Engine pool: lifecycle state machine, id allocation, queries, snapshot/restore.

(docs/architecture.md, "Engine lifecycle".)
"""

from __future__ import annotations

import itertools
import pickle

import pytest

from relax.rollout.pool.engines import (
    EngineKind,
    EnginePool,
    EngineRecord,
    EngineState,
    IllegalTransition,
    UnknownEngine,
    engine_can_join,
    engine_number,
    format_engine_id,
)

S = EngineState
CHAIN = [S.PENDING, S.STARTING, S.HEALTH_CHECKING, S.WEIGHT_SYNCING, S.ACTIVE, S.DRAINING, S.REMOVED]
LEGAL = {
    (S.PENDING, S.STARTING),
    (S.STARTING, S.HEALTH_CHECKING),
    (S.HEALTH_CHECKING, S.WEIGHT_SYNCING),
    (S.WEIGHT_SYNCING, S.ACTIVE),
    (S.ACTIVE, S.DRAINING),
    (S.DRAINING, S.REMOVED),
    # any non-terminal state may fail
    (S.PENDING, S.FAILED),
    (S.STARTING, S.FAILED),
    (S.HEALTH_CHECKING, S.FAILED),
    (S.WEIGHT_SYNCING, S.FAILED),
    (S.ACTIVE, S.FAILED),
    (S.DRAINING, S.FAILED),
    # rollback of a cancelled scale-out: engines that never served go straight to REMOVED
    (S.PENDING, S.REMOVED),
    (S.STARTING, S.REMOVED),
    (S.HEALTH_CHECKING, S.REMOVED),
    (S.WEIGHT_SYNCING, S.REMOVED),
}


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock: FakeClock) -> EnginePool:
    return EnginePool(clock)


def drive(pool: EnginePool, engine_id: str, target: EngineState, version: int = 0) -> None:
    """Walk an engine along the main chain from PENDING up to ``target``."""
    for state in CHAIN[1 : CHAIN.index(target) + 1]:
        if state is S.ACTIVE and pool.get(engine_id).weight_version is None:
            pool.set_weight_version(engine_id, version)
        pool.transition(engine_id, state)


def make(pool: EnginePool, kind: EngineKind, state: EngineState, version: int = 0) -> str:
    engine_id = pool.add(kind).engine_id
    drive(pool, engine_id, state, version)
    return engine_id


def at_state(pool: EnginePool, state: EngineState) -> str:
    """An engine in ``state``, reached legally (terminal states via their usual path)."""
    if state is S.FAILED:
        engine_id = make(pool, EngineKind.ELASTIC, S.PENDING)
        pool.transition(engine_id, S.FAILED)
        return engine_id
    return make(pool, EngineKind.ELASTIC, state)


# -- state machine ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(EngineState, EngineState)))
def test_every_transition_is_legal_exactly_when_the_lifecycle_allows_it(
    pool: EnginePool, src: EngineState, dst: EngineState
) -> None:
    engine_id = at_state(pool, src)
    pool.set_weight_version(engine_id, 0)  # ACTIVE also needs weights; here only the state machine is tested
    assert src.can_transition_to(dst) == ((src, dst) in LEGAL)
    if (src, dst) in LEGAL:
        record = pool.transition(engine_id, dst)
        assert record.state is dst
        assert record.transitions[-1][0] is dst
    else:
        with pytest.raises(IllegalTransition) as info:
            pool.transition(engine_id, dst)
        message = str(info.value)
        assert engine_id in message and src.value in message and dst.value in message
        assert (info.value.engine_id, info.value.src, info.value.dst) == (engine_id, src, dst)
        assert pool.get(engine_id).state is src  # an illegal move changes nothing


def test_terminal_states_and_active_never_skips_draining() -> None:
    assert S.REMOVED.terminal and S.FAILED.terminal
    assert not any(s.terminal for s in EngineState if s not in (S.REMOVED, S.FAILED))
    assert not S.ACTIVE.can_transition_to(S.REMOVED)
    assert not S.PENDING.can_transition_to(S.ACTIVE)


def test_illegal_transition_survives_pickling(pool: EnginePool) -> None:
    engine_id = pool.add(EngineKind.ELASTIC).engine_id
    with pytest.raises(IllegalTransition) as info:
        pool.transition(engine_id, S.ACTIVE)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.dst is S.ACTIVE


def test_transitions_are_timestamped_on_the_injected_clock(pool: EnginePool, clock: FakeClock) -> None:
    record = pool.add(EngineKind.INITIAL)
    assert record.created_at == 1000.0 and record.transitions == [(S.PENDING, 1000.0)]
    clock.advance(2.5)
    pool.transition(record.engine_id, S.STARTING)
    clock.advance(1.0)
    pool.transition(record.engine_id, S.FAILED, error="server exited with code 1")
    assert record.transitions == [(S.PENDING, 1000.0), (S.STARTING, 1002.5), (S.FAILED, 1003.5)]
    assert record.state_since == 1003.5
    assert record.entered_at(S.STARTING) == 1002.5 and record.entered_at(S.ACTIVE) is None
    assert record.last_error == "server exited with code 1"


def test_active_needs_a_known_weight_version(pool: EnginePool) -> None:
    engine_id = make(pool, EngineKind.ELASTIC, S.WEIGHT_SYNCING)
    with pytest.raises(ValueError, match="weight version"):
        pool.transition(engine_id, S.ACTIVE)
    assert pool.get(engine_id).state is S.WEIGHT_SYNCING
    pool.set_weight_version(engine_id, 3)
    assert pool.transition(engine_id, S.ACTIVE).state is S.ACTIVE


def test_transition_listener_sees_every_move(clock: FakeClock) -> None:
    seen: list[tuple[str, EngineState, EngineState]] = []
    pool = EnginePool(clock, on_transition=lambda r, a, b: seen.append((r.engine_id, a, b)))
    engine_id = pool.add(EngineKind.ELASTIC).engine_id
    pool.transition(engine_id, S.STARTING)
    pool.transition(engine_id, S.REMOVED)
    assert seen == [("engine_0", S.PENDING, S.STARTING), ("engine_0", S.STARTING, S.REMOVED)]


def test_unknown_engine(pool: EnginePool) -> None:
    with pytest.raises(UnknownEngine, match="engine_9"):
        pool.get("engine_9")
    with pytest.raises(UnknownEngine):
        pool.transition("engine_9", S.STARTING)
    with pytest.raises(LookupError):
        pool.set_url("engine_9", "http://h:1")


# -- engine_can_join -------------------------------------------------------------------------------------


def test_engine_joins_only_with_the_current_weight_version(pool: EnginePool) -> None:
    engine_id = make(pool, EngineKind.ELASTIC, S.WEIGHT_SYNCING)
    record = pool.get(engine_id)
    assert not engine_can_join(record, 3)  # no weights yet
    pool.set_weight_version(engine_id, 2)
    assert not engine_can_join(record, 3)  # missed a publication while starting
    pool.set_weight_version(engine_id, 3)
    assert engine_can_join(record, 3)
    assert engine_can_join(record, 2)  # holds a newer one than the caller knew of
    pool.transition(engine_id, S.ACTIVE)
    assert engine_can_join(record, 3) and not engine_can_join(record, 4)


@pytest.mark.parametrize("state", [S.PENDING, S.STARTING, S.HEALTH_CHECKING, S.DRAINING, S.REMOVED, S.FAILED])
def test_engine_cannot_join_outside_weight_sync_or_active(pool: EnginePool, state: EngineState) -> None:
    engine_id = at_state(pool, state)
    pool.set_weight_version(engine_id, 5)
    assert not engine_can_join(pool.get(engine_id), 5)


def test_engine_can_join_rejects_bad_version(pool: EnginePool) -> None:
    record = pool.get(make(pool, EngineKind.ELASTIC, S.ACTIVE))
    with pytest.raises(ValueError):
        engine_can_join(record, -1)


# -- ids ------------------------------------------------------------------------------------------------


def test_ids_are_monotonic_and_never_reused(pool: EnginePool) -> None:
    ids = [pool.add(EngineKind.INITIAL).engine_id for _ in range(3)]
    assert ids == ["engine_0", "engine_1", "engine_2"]
    pool.transition("engine_2", S.REMOVED)
    assert pool.add(EngineKind.ELASTIC).engine_id == "engine_3"


def test_ids_survive_snapshot_and_restore(pool: EnginePool, clock: FakeClock) -> None:
    for _ in range(5):
        pool.add(EngineKind.ELASTIC)
    pool.transition("engine_4", S.FAILED)
    snapshot = pool.to_dict()
    snapshot["engines"] = [e for e in snapshot["engines"] if e["engine_id"] != "engine_4"]  # only the counter knows it
    restored = EnginePool.from_dict(snapshot, clock)
    assert restored.next_number == 5
    assert restored.add(EngineKind.ELASTIC).engine_id == "engine_5"


def test_restore_never_goes_below_a_seen_id(clock: FakeClock) -> None:
    pool = EnginePool(clock)
    for _ in range(3):
        pool.add(EngineKind.INITIAL)
    snapshot = pool.to_dict()
    snapshot["next_number"] = 0  # stale or hand-edited counter
    assert EnginePool.from_dict(snapshot, clock).add(EngineKind.ELASTIC).engine_id == "engine_3"


def test_snapshot_round_trip_keeps_records(pool: EnginePool, clock: FakeClock) -> None:
    engine_id = make(pool, EngineKind.ELASTIC, S.ACTIVE, version=7)
    pool.set_url(engine_id, "http://10.0.0.5:30001")
    pool.set_node_id(engine_id, "node-a")
    pool.set_in_flight(engine_id, 2)
    pool.get(engine_id).bundle = "pg-123"
    restored = EnginePool.from_dict(pool.to_dict(), clock)
    assert restored.get(engine_id) == pool.get(engine_id)
    assert restored.to_dict() == pool.to_dict()


def test_snapshot_with_duplicate_id_is_rejected(pool: EnginePool, clock: FakeClock) -> None:
    pool.add(EngineKind.INITIAL)
    snapshot = pool.to_dict()
    snapshot["engines"].append(snapshot["engines"][0])
    with pytest.raises(ValueError, match="duplicate"):
        EnginePool.from_dict(snapshot, clock)


def test_engine_number_and_format() -> None:
    assert format_engine_id(12) == "engine_12"
    assert engine_number("engine_12") == 12
    for bad in ["engine_", "engine_x", "Engine_1", "e_1", "engine_1 ", 7]:
        with pytest.raises(ValueError):
            engine_number(bad)  # type: ignore[arg-type]


def test_next_number_must_be_valid() -> None:
    with pytest.raises(ValueError):
        EnginePool(next_number=-1)
    assert EnginePool(next_number=10).add(EngineKind.INITIAL).engine_id == "engine_10"


# -- queries --------------------------------------------------------------------------------------------


def test_records_filters_and_orders_by_number(clock: FakeClock) -> None:
    pool = EnginePool(clock, next_number=8)
    a = make(pool, EngineKind.INITIAL, S.ACTIVE)  # engine_8
    b = make(pool, EngineKind.ELASTIC, S.STARTING)  # engine_9
    c = make(pool, EngineKind.ELASTIC, S.ACTIVE)  # engine_10: must sort after engine_9
    d = make(pool, EngineKind.EXTERNAL, S.ACTIVE)
    assert [r.engine_id for r in pool.records()] == [a, b, c, d]
    assert [r.engine_id for r in pool.records(states=[S.ACTIVE])] == [a, c, d]
    assert [r.engine_id for r in pool.records(kinds=[EngineKind.ELASTIC])] == [b, c]
    assert [r.engine_id for r in pool.records(states=[S.ACTIVE], kinds=["elastic"])] == [c]
    assert [r.engine_id for r in pool.active()] == [a, c, d]
    assert pool.routable() == [a, c, d]


def test_routable_is_active_only(pool: EnginePool) -> None:
    ids = {state: at_state(pool, state) for state in EngineState}
    assert pool.routable() == [ids[S.ACTIVE]]


def test_counts_and_live(pool: EnginePool) -> None:
    for state in EngineState:
        at_state(pool, state)
    at_state(pool, S.ACTIVE)
    counts = pool.counts()
    assert set(counts) == set(EngineState)
    assert counts[S.ACTIVE] == 2 and counts[S.PENDING] == 1 and counts[S.FAILED] == 1
    assert sum(counts.values()) == len(pool) == 9
    assert len(pool.live()) == 7  # everything but REMOVED and FAILED, pending included
    assert [r for r in pool.live() if r.kind is EngineKind.INITIAL] == []
    assert [r.state for r in pool.live()] == [s for s in EngineState if not s.terminal] + [S.ACTIVE]


def test_empty_pool_counts(pool: EnginePool) -> None:
    assert pool.counts() == dict.fromkeys(EngineState, 0)
    assert pool.live() == [] and pool.min_active_weight_version() is None


def test_elastic_victims_are_newest_elastic_active_first(pool: EnginePool) -> None:
    initial = [make(pool, EngineKind.INITIAL, S.ACTIVE) for _ in range(2)]
    e2 = make(pool, EngineKind.ELASTIC, S.ACTIVE)
    ext = make(pool, EngineKind.EXTERNAL, S.ACTIVE)
    e4 = make(pool, EngineKind.ELASTIC, S.ACTIVE)
    make(pool, EngineKind.ELASTIC, S.WEIGHT_SYNCING)  # not serving: not a drain victim
    e6 = make(pool, EngineKind.ELASTIC, S.ACTIVE)
    make(pool, EngineKind.ELASTIC, S.DRAINING)  # already leaving
    assert [r.engine_id for r in pool.elastic_victims(2)] == [e6, e4]
    assert [r.engine_id for r in pool.elastic_victims(10)] == [e6, e4, e2]  # never the initial engines
    assert [r.engine_id for r in pool.elastic_victims(3, include_external=True)] == [e6, e4, ext]
    assert pool.elastic_victims(0) == []
    victims = {r.engine_id for r in pool.elastic_victims(100, include_external=True)}
    assert not victims & set(initial)
    with pytest.raises(ValueError):
        pool.elastic_victims(-1)


def test_elastic_victims_order_by_number_not_string(clock: FakeClock) -> None:
    pool = EnginePool(clock, next_number=9)
    e9 = make(pool, EngineKind.ELASTIC, S.ACTIVE)
    e10 = make(pool, EngineKind.ELASTIC, S.ACTIVE)
    assert [r.engine_id for r in pool.elastic_victims(2)] == [e10, e9]


def test_min_active_weight_version(pool: EnginePool) -> None:
    make(pool, EngineKind.INITIAL, S.ACTIVE, version=4)
    make(pool, EngineKind.ELASTIC, S.ACTIVE, version=3)
    syncing = make(pool, EngineKind.ELASTIC, S.WEIGHT_SYNCING)
    pool.set_weight_version(syncing, 1)  # not serving: does not hold back the gate
    draining = make(pool, EngineKind.ELASTIC, S.DRAINING, version=0)
    assert pool.get(draining).weight_version == 0
    assert pool.min_active_weight_version() == 3


def test_set_weight_version_validates(pool: EnginePool) -> None:
    engine_id = pool.add(EngineKind.INITIAL).engine_id
    for bad in [-1, 1.5, True, "3"]:
        with pytest.raises(ValueError):
            pool.set_weight_version(engine_id, bad)  # type: ignore[arg-type]
    pool.set_weight_version(engine_id, None)
    with pytest.raises(ValueError):
        pool.set_in_flight(engine_id, -1)


# -- REST shape -----------------------------------------------------------------------------------------


def test_record_to_dict_has_the_rest_fields(pool: EnginePool) -> None:
    record = pool.add(EngineKind.ELASTIC, url="http://10.0.0.1:30000", node_id="n1", bundle="pg-1")
    data = record.to_dict()
    assert {"engine_id", "url", "kind", "status", "weight_version", "in_flight", "node_id"} <= set(data)
    assert data["engine_id"] == "engine_0" and data["kind"] == "elastic" and data["status"] == "PENDING"
    assert data["url"] == "http://10.0.0.1:30000" and data["node_id"] == "n1" and data["bundle"] == "pg-1"
    assert data["weight_version"] is None and data["in_flight"] == 0
    assert data["transitions"] == [{"state": "PENDING", "at": 1000.0}]
    assert EngineRecord.from_dict(data) == record


def test_enum_values_match_the_rest_contract() -> None:
    assert [s.value for s in EngineState] == [
        "PENDING",
        "STARTING",
        "HEALTH_CHECKING",
        "WEIGHT_SYNCING",
        "ACTIVE",
        "DRAINING",
        "REMOVED",
        "FAILED",
    ]
    assert [k.value for k in EngineKind] == ["initial", "elastic", "external"]
    assert EngineState("ACTIVE") is S.ACTIVE and EngineKind("elastic") is EngineKind.ELASTIC
