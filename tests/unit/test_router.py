"""Router: least-in-flight choice, group stickiness, exact drains; RetryPolicy decisions.

(docs/architecture.md, "Router".)
"""

from __future__ import annotations

import asyncio

import pytest

from relax.engines.client import EngineError, EngineUnavailable
from relax.rollout.dispatch.dispatcher import classify_error
from relax.rollout.routing.router import (
    FailureKind,
    NoEngineAvailable,
    RetryPolicy,
    Router,
    failure_from_finish_reason,
)


def router_with(*numbers: int) -> Router:
    router = Router()
    for n in numbers:
        router.add(f"engine_{n}")
    return router


def pinned(router: Router, group_key: str) -> str | None:
    """The engine a group is pinned to, if any and still routable (read without a request: one would pin it)."""
    engine_id = router._groups.get(group_key)
    return engine_id if engine_id in router.routable() else None


# -- choice ---------------------------------------------------------------------------------------------


def test_no_engine_available() -> None:
    router = Router()
    with pytest.raises(NoEngineAvailable):
        router.acquire()
    router.add("engine_0")
    router.remove("engine_0")
    with pytest.raises(NoEngineAvailable):
        router.acquire("group")
    assert router.in_flight("engine_0") == 0  # a failed acquire counts nothing


def test_least_in_flight_wins() -> None:
    router = router_with(0, 1, 2)
    assert [router.acquire() for _ in range(6)] == ["engine_0", "engine_1", "engine_2"] * 2
    router.release("engine_1")
    assert router.acquire() == "engine_1"
    router.release("engine_2")
    router.release("engine_2")
    assert [router.in_flight(e) for e in router.routable()] == [2, 2, 0]
    assert router.acquire() == "engine_2"


def test_ties_go_to_the_lowest_engine_number_not_string_order() -> None:
    router = router_with(10, 9, 2)
    assert router.acquire() == "engine_2"
    assert router.acquire() == "engine_9"
    assert router.acquire() == "engine_10"
    assert router.routable() == ["engine_2", "engine_9", "engine_10"]


def test_in_flight_counts_are_exact() -> None:
    router = router_with(0)
    for _ in range(5):
        router.acquire()
    assert router.in_flight("engine_0") == 5
    assert router.release("engine_0") == 4
    assert router.in_flight("engine_0") == 4
    assert router.in_flight("engine_7") == 0  # unknown engine: nothing in flight


def test_release_without_acquire_is_a_bug() -> None:
    router = router_with(0)
    with pytest.raises(ValueError, match="engine_0"):
        router.release("engine_0")
    with pytest.raises(ValueError):
        router.release("engine_5")
    router.acquire()
    router.release("engine_0")
    with pytest.raises(ValueError):
        router.release("engine_0")


def test_add_is_idempotent_and_validates_ids() -> None:
    router = router_with(0)
    router.acquire()
    router.add("engine_0")
    assert router.in_flight("engine_0") == 1 and len(router) == 1
    for bad in ["worker-1", "engine_", ""]:
        with pytest.raises(ValueError):
            router.add(bad)


# -- group stickiness -----------------------------------------------------------------------------------


def test_group_stays_on_its_engine_even_when_it_is_busier() -> None:
    router = router_with(0, 1)
    first = router.acquire("g1")
    assert first == "engine_0"
    assert [router.acquire("g1") for _ in range(3)] == ["engine_0"] * 3
    assert router.acquire("g2") == "engine_1"  # a new group takes the least loaded engine
    assert router.acquire() == "engine_1"  # ungrouped requests ignore pins
    assert pinned(router, "g1") == "engine_0" and pinned(router, "g2") == "engine_1"


def test_group_is_repicked_after_its_engine_is_removed() -> None:
    router = router_with(0, 1, 2)
    assert router.acquire("g") == "engine_0"
    router.acquire()  # engine_1 busier than engine_2
    router.remove("engine_0")
    assert pinned(router, "g") is None
    assert router.acquire("g") == "engine_2"
    assert router.acquire("g") == "engine_2"  # pinned to the new engine
    router.add("engine_0")  # coming back does not steal the group back
    assert router.acquire("g") == "engine_2"


def test_end_group_forgets_the_pin() -> None:
    router = router_with(0, 1)
    router.acquire("g")
    router.acquire("g")
    router.end_group("g")
    router.end_group("g")  # idempotent
    assert pinned(router, "g") is None
    assert router.acquire("g") == "engine_1"


def test_group_table_is_bounded_lru() -> None:
    router = Router(max_groups=2)
    router.add("engine_0")
    router.add("engine_1")
    router.acquire("a")  # engine_0
    router.acquire("b")  # engine_1
    router.acquire("a")  # touch a: b is now least recently used
    router.acquire("c")
    assert pinned(router, "b") is None
    assert pinned(router, "a") == "engine_0" and pinned(router, "c") is not None
    with pytest.raises(ValueError):
        Router(max_groups=0)


def test_exclude_avoids_failed_engines_and_repins_the_group() -> None:
    router = router_with(0, 1, 2)
    assert router.acquire("g") == "engine_0"
    assert router.acquire("g", exclude={"engine_0"}) == "engine_1"
    assert pinned(router, "g") == "engine_1"
    assert router.acquire(exclude={"engine_0", "engine_1"}) == "engine_2"


def test_exclude_falls_back_rather_than_losing_the_sample() -> None:
    router = router_with(0, 1)
    router.acquire()
    assert router.acquire(exclude={"engine_0", "engine_1"}) == "engine_1"  # least loaded of the excluded
    router = router_with(3)
    assert router.acquire(exclude={"engine_3"}) == "engine_3"


# -- drains -----------------------------------------------------------------------------------------------


def test_drained_only_when_releases_reach_zero_after_removal() -> None:
    router = router_with(0, 1)
    router.acquire("g")
    router.acquire("g")
    assert not router.drained("engine_0")  # still routable
    assert router.remove("engine_0") == 2
    assert router.routable() == ["engine_1"]
    assert router.in_flight("engine_0") == 2  # count survives removal
    assert not router.drained("engine_0")
    assert all(router.acquire() == "engine_1" for _ in range(3))  # no new request reaches it
    assert router.release("engine_0") == 1
    assert not router.drained("engine_0")
    assert router.release("engine_0") == 0
    assert router.drained("engine_0") and router.in_flight("engine_0") == 0
    with pytest.raises(ValueError):
        router.release("engine_0")


def test_idle_engine_is_drained_as_soon_as_it_leaves() -> None:
    router = router_with(0, 1)
    assert not router.drained("engine_1")
    assert router.remove("engine_1") == 0
    assert router.drained("engine_1")
    assert router.remove("engine_1") == 0  # idempotent
    assert router.drained("engine_9")  # never routed to: trivially drained


def test_readding_a_draining_engine_keeps_its_count() -> None:
    router = router_with(0)
    router.acquire()
    router.remove("engine_0")
    router.add("engine_0")
    assert router.in_flight("engine_0") == 1 and not router.drained("engine_0")
    router.release("engine_0")
    assert router.in_flight("engine_0") == 0 and router.routable() == ["engine_0"]


# -- retry policy -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "failure",
    [FailureKind.ENGINE_UNAVAILABLE, FailureKind.ENGINE_FAILED, FailureKind.EVICTED, FailureKind.SERVER_ERROR],
)
def test_engine_faults_are_retried_elsewhere(failure: FailureKind) -> None:
    decision = RetryPolicy(max_attempts=3).decide(failure, attempt=1, engine_id="engine_2")
    assert decision and decision.retry and decision.failure is failure
    assert decision.exclude == frozenset({"engine_2"})
    assert "engine_2" in decision.reason


def test_aborted_by_drain_is_retried_without_excluding_the_engine() -> None:
    decision = RetryPolicy().decide(FailureKind.ABORTED, attempt=1, engine_id="engine_2", excluded={"engine_1"})
    assert decision.retry
    assert decision.exclude == frozenset({"engine_1"})  # earlier exclusions carry over


@pytest.mark.parametrize("failure", [FailureKind.CLIENT_ERROR, FailureKind.OTHER])
def test_request_errors_are_not_retried(failure: FailureKind) -> None:
    decision = RetryPolicy().decide(failure, attempt=1, engine_id="engine_0")
    assert not decision and not decision.retry
    assert "not retried" in decision.reason


def test_exclusions_accumulate_until_attempts_run_out() -> None:
    policy = RetryPolicy(max_attempts=3)
    d1 = policy.decide(FailureKind.ENGINE_UNAVAILABLE, attempt=1, engine_id="engine_0")
    d2 = policy.decide(FailureKind.EVICTED, attempt=2, engine_id="engine_1", excluded=d1.exclude)
    assert d2.retry and d2.exclude == frozenset({"engine_0", "engine_1"})
    d3 = policy.decide(FailureKind.ENGINE_FAILED, attempt=3, engine_id="engine_2", excluded=d2.exclude)
    assert not d3.retry and "gave up after 3" in d3.reason
    assert d3.exclude == frozenset({"engine_0", "engine_1", "engine_2"})


def test_server_errors_can_be_made_final() -> None:
    policy = RetryPolicy(retry_server_errors=False)
    assert not policy.decide(FailureKind.SERVER_ERROR, attempt=1, engine_id="engine_0")
    assert policy.decide(FailureKind.ENGINE_UNAVAILABLE, attempt=1, engine_id="engine_0")


def test_retry_policy_validates() -> None:
    for bad in [0, -1, True]:
        with pytest.raises(ValueError):
            RetryPolicy(max_attempts=bad)
    with pytest.raises(ValueError):
        RetryPolicy().decide(FailureKind.ABORTED, attempt=0, engine_id=None)
    assert RetryPolicy(max_attempts=1).decide(FailureKind.ABORTED, attempt=1, engine_id=None).retry is False
    assert RetryPolicy().decide("evicted", attempt=1, engine_id=None).exclude == frozenset()


def test_retry_loop_with_router_never_loses_a_sample() -> None:
    """One request whose first two engines die is served by the third, never by a failed one."""
    router = router_with(0, 1, 2)
    policy = RetryPolicy(max_attempts=4)
    dead = {"engine_0", "engine_1"}
    excluded: frozenset[str] = frozenset()
    attempt = 0
    while True:
        attempt += 1
        engine_id = router.acquire("g", exclude=excluded)
        router.release(engine_id)
        if engine_id not in dead:
            break
        decision = policy.decide(
            FailureKind.ENGINE_UNAVAILABLE, attempt=attempt, engine_id=engine_id, excluded=excluded
        )
        assert decision.retry
        excluded = decision.exclude
    assert engine_id == "engine_2" and attempt == 3
    assert [router.in_flight(e) for e in ("engine_0", "engine_1", "engine_2")] == [0, 0, 0]


# -- classification ---------------------------------------------------------------------------------------


def _error(cls: type[EngineError], status: int | None) -> EngineError:
    return cls("boom", url="http://h:1", endpoint="/generate", status_code=status)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_error(EngineUnavailable, None), FailureKind.ENGINE_UNAVAILABLE),
        (_error(EngineUnavailable, 503), FailureKind.ENGINE_UNAVAILABLE),
        (_error(EngineError, 400), FailureKind.CLIENT_ERROR),
        (_error(EngineError, 422), FailureKind.CLIENT_ERROR),
        (_error(EngineError, 429), FailureKind.ENGINE_UNAVAILABLE),
        (_error(EngineError, 500), FailureKind.SERVER_ERROR),
        (_error(EngineError, None), FailureKind.SERVER_ERROR),
        (TimeoutError("slow"), FailureKind.ENGINE_UNAVAILABLE),
        (asyncio.TimeoutError(), FailureKind.ENGINE_UNAVAILABLE),
        (ConnectionResetError("reset"), FailureKind.ENGINE_UNAVAILABLE),
        (ValueError("our bug"), FailureKind.OTHER),
        (KeyError("output_ids"), FailureKind.OTHER),
    ],
)
def test_classify_error(exc: BaseException, expected: FailureKind) -> None:
    assert classify_error(exc) is expected


def test_failure_from_finish_reason() -> None:
    assert failure_from_finish_reason({"type": "abort", "message": "drained"}) is FailureKind.ABORTED
    assert failure_from_finish_reason("abort") is FailureKind.ABORTED
    assert failure_from_finish_reason({"type": "stop", "matched": 2}) is None
    assert failure_from_finish_reason({"type": "length", "length": 16}) is None
    assert failure_from_finish_reason(None) is None
