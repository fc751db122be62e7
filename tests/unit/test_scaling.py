"""Elastic scaling core: absolute targets, LIFO victims, one-at-a-time, sticky cancel, history.

(docs/architecture.md, "Scale requests".)
"""

from __future__ import annotations

import itertools
import pickle

import pytest

from relax.rollout.control.api_models import (
    CancelBatchResponse,
    InvalidBody,
    ScaleInBody,
    ScaleInDryRun,
    ScaleInRequestView,
    ScaleNoop,
    ScaleOutBody,
    ScaleOutRequestView,
    http_status_of,
    parse_body,
)
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.scaling import (
    FAILED_STATUSES,
    TERMINAL_STATUSES,
    CancelBatchResult,
    Direction,
    IllegalRequestTransition,
    Noop,
    NotCancellable,
    PartialSuccessPolicy,
    RejectedRequest,
    Rejection,
    ScaleConflict,
    ScaleInPlan,
    ScaleInRequest,
    ScaleInSpec,
    ScaleInStatus,
    ScaleKind,
    ScaleOutPlan,
    ScaleOutRequest,
    ScaleOutSpec,
    ScaleOutStatus,
    ScaleRequestRegistry,
    ScalingError,
    UnknownModel,
    UnknownRequest,
    current_engine_count,
    decide_partial_outcome,
    engine_phase_timings,
    plan_scale_in,
    plan_scale_out,
)

S = EngineState
SO = ScaleOutStatus
SI = ScaleInStatus
BRING_UP = (S.STARTING, S.HEALTH_CHECKING, S.WEIGHT_SYNCING)


class FakeClock:
    """Advances one second per reading, so every timestamp is distinct and durations are predictable."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def activate(pool: EnginePool, engine_id: str, version: int = 0) -> None:
    for state in BRING_UP:
        pool.transition(engine_id, state)
    pool.set_weight_version(engine_id, version)
    pool.transition(engine_id, S.ACTIVE)


def make_pool(initial: int = 4, elastic: int = 0, external: tuple[str, ...] = (), clock=None) -> EnginePool:
    """``initial`` + ``elastic`` ACTIVE engines at http://10.0.0.<n>:30000, then external ones."""
    pool = EnginePool(clock or FakeClock())
    for kind, count in ((EngineKind.INITIAL, initial), (EngineKind.ELASTIC, elastic)):
        for _ in range(count):
            record = pool.add(kind, url=f"http://10.0.0.{pool.next_number}:30000")
            activate(pool, record.engine_id)
    for url in external:
        activate(pool, pool.add(EngineKind.EXTERNAL, url=url).engine_id)
    return pool


def out_plan(pool: EnginePool, initial: int = 4, max_engines: int | None = None, **spec):
    return plan_scale_out(ScaleOutSpec(**spec), pool, initial_count=initial, max_engines=max_engines)


def in_plan(pool: EnginePool, initial: int = 4, **spec):
    return plan_scale_in(ScaleInSpec(**spec), pool, initial_count=initial)


# -- state machines ------------------------------------------------------------------------------------


def test_scale_out_status_terminal_states_and_transitions() -> None:
    assert {s for s in SO if s.terminal} == {SO.ACTIVE, SO.PARTIAL, SO.FAILED, SO.CANCELLED}
    legal = {(a, b) for a, b in itertools.product(SO, SO) if a.can_transition_to(b)}
    ends = {SO.FAILED, SO.CANCELLED}
    expected = {
        (SO.PENDING, SO.CREATING),
        (SO.PENDING, SO.CONNECTING),
        (SO.CREATING, SO.HEALTH_CHECKING),
        (SO.CONNECTING, SO.HEALTH_CHECKING),
        (SO.HEALTH_CHECKING, SO.WEIGHT_SYNCING),
        (SO.WEIGHT_SYNCING, SO.ACTIVE),
        (SO.WEIGHT_SYNCING, SO.PARTIAL),
    } | {(s, end) for s in SO if not s.terminal for end in ends}
    assert legal == expected


def test_scale_in_status_terminal_states_and_transitions() -> None:
    assert {s for s in SI if s.terminal} == {SI.COMPLETED, SI.FAILED}
    legal = {(a, b) for a, b in itertools.product(SI, SI) if a.can_transition_to(b)}
    assert legal == {
        (SI.PENDING, SI.DRAINING),
        (SI.DRAINING, SI.REMOVING),
        (SI.REMOVING, SI.COMPLETED),
        (SI.PENDING, SI.FAILED),
        (SI.DRAINING, SI.FAILED),
        (SI.REMOVING, SI.FAILED),
    }


def test_terminal_and_failed_status_names_cover_both_directions() -> None:
    assert {s.value for s in SO if s.terminal} | {s.value for s in SI if s.terminal} == TERMINAL_STATUSES
    assert {"ACTIVE", "PARTIAL", "FAILED", "CANCELLED", "COMPLETED"} == TERMINAL_STATUSES
    assert {"FAILED", "CANCELLED"} == FAILED_STATUSES and FAILED_STATUSES <= TERMINAL_STATUSES
    assert all(isinstance(name, str) for name in TERMINAL_STATUSES | FAILED_STATUSES)


# -- counting -------------------------------------------------------------------------------------------


def test_current_count_includes_starting_engines_and_excludes_draining_and_gone() -> None:
    pool = make_pool(initial=4, elastic=2)
    pool.add(EngineKind.ELASTIC)  # PENDING: counts, it will serve soon
    pool.transition("engine_5", S.DRAINING)  # leaving: does not count
    pool.transition("engine_4", S.DRAINING)
    pool.transition("engine_4", S.REMOVED)
    assert current_engine_count(pool) == 5


# -- scale-out planning ---------------------------------------------------------------------------------


def test_ray_native_target_is_absolute() -> None:
    pool = make_pool(initial=4, elastic=1)
    plan = out_plan(pool, num_replicas=8, timeout_secs=60)
    assert plan == ScaleOutPlan("default", ScaleKind.RAY_NATIVE, 5, 3, target=8, timeout_secs=60.0)
    assert plan.engines_after == 8


@pytest.mark.parametrize("target", [4, 5])
def test_ray_native_target_already_met_is_noop(target: int) -> None:
    pool = make_pool(initial=4, elastic=1)
    result = out_plan(pool, num_replicas=target)
    assert isinstance(result, Noop)
    assert result.to_dict()["status"] == "NOOP"
    assert ScaleNoop(**result.to_dict()).current_engines == 5


def test_retried_scale_out_is_noop_while_its_engines_are_still_starting() -> None:
    pool = make_pool(initial=4)
    plan = out_plan(pool, num_replicas=6)
    for _ in range(plan.to_create):
        pool.add(EngineKind.ELASTIC)  # PENDING placement groups
    assert isinstance(out_plan(pool, num_replicas=6), Noop)
    assert out_plan(pool, num_replicas=7).to_create == 1


def test_draining_engines_do_not_satisfy_a_target() -> None:
    pool = make_pool(initial=4, elastic=2)
    pool.transition("engine_5", S.DRAINING)  # e.g. being evicted
    assert out_plan(pool, num_replicas=6).to_create == 1


def test_scale_out_target_below_initial_count_is_rejected_as_a_delta_mistake() -> None:
    result = out_plan(make_pool(initial=4), num_replicas=2)
    assert isinstance(result, Rejection)
    assert (http_status_of(result.to_error()), result.code, result.field) == (400, "below_initial", "num_replicas")
    assert "num_replicas: 2 is below the initial engine count 4" in result.message
    assert "absolute total" in result.message


def test_scale_out_above_max_engines_is_rejected_naming_the_bound() -> None:
    pool = make_pool(initial=4)
    result = out_plan(pool, max_engines=8, num_replicas=9)
    assert isinstance(result, Rejection)
    assert (http_status_of(result.to_error()), result.code, result.field) == (400, "above_max", "num_replicas")
    assert "max_engines=8" in result.message
    assert out_plan(pool, max_engines=8, num_replicas=8).to_create == 4
    assert out_plan(pool, max_engines=None, num_replicas=100).to_create == 96


def test_external_scale_out_attaches_only_new_urls() -> None:
    pool = make_pool(initial=2, external=("http://ext-a:30000",))
    plan = out_plan(
        pool,
        initial=2,
        engine_urls=["HTTP://EXT-A:30000/", "http://ext-b:30000", "http://10.0.0.0:30000", "http://ext-c:30000"],
    )
    assert plan.kind is ScaleKind.EXTERNAL
    assert plan.urls == ("http://ext-b:30000", "http://ext-c:30000")
    assert (plan.engines_before, plan.to_create, plan.target) == (3, 2, None)


def test_external_scale_out_is_idempotent() -> None:
    pool = make_pool(initial=2, external=("http://ext-a:30000",))
    result = out_plan(pool, initial=2, engine_urls=["http://ext-a:30000", "http://10.0.0.1:30000/"])
    assert isinstance(result, Noop)
    assert "already attached" in result.message


def test_external_scale_out_counts_existing_urls_and_reattaches_gone_engines() -> None:
    pool = make_pool(initial=1, external=("http://ext-a:30000",))
    pool.transition("engine_1", S.DRAINING)
    pool.transition("engine_1", S.REMOVED)
    plan = plan_scale_out(
        ScaleOutSpec(engine_urls=("http://ext-a:30000", "http://ext-b:30000")),
        pool,
        initial_count=1,
        existing_urls=["http://EXT-B:30000"],
    )
    assert plan.urls == ("http://ext-a:30000",)


def test_external_scale_out_above_max_engines_is_rejected() -> None:
    pool = make_pool(initial=4)
    result = out_plan(pool, max_engines=5, engine_urls=["http://x:1", "http://y:1"])
    assert isinstance(result, Rejection)
    assert result.field == "engine_urls" and "above max_engines=5" in result.message
    assert "attach at most 1" in result.message


@pytest.mark.parametrize(("planner", "spec"), [(plan_scale_out, ScaleOutSpec), (plan_scale_in, ScaleInSpec)])
def test_unknown_model_is_a_404_naming_model_name(planner, spec) -> None:
    result = planner(spec(model_name="qwen", num_replicas=5), make_pool(), initial_count=4)
    assert isinstance(result, Rejection)
    assert (http_status_of(result.to_error()), result.code, result.field) == (404, "unknown_model", "model_name")
    error = result.to_error()
    assert isinstance(error, UnknownModel) and http_status_of(error) == 404 and error.field == "model_name"
    assert "'qwen'" in error.message and "'default'" in error.message


@pytest.mark.parametrize(("planner", "body"), [(plan_scale_out, ScaleOutBody), (plan_scale_in, ScaleInBody)])
def test_dict_bodies_are_validated_on_the_rest_path_and_planners_take_specs_only(planner, body) -> None:
    with pytest.raises(InvalidBody, match="num_replicas: expected an integer") as info:
        planner(parse_body(body, {"num_replicas": "5"}).to_spec(), make_pool(), initial_count=4)
    assert http_status_of(info.value) == 422
    with pytest.raises(TypeError, match="to_spec"):
        planner({"num_replicas": 5}, make_pool(), initial_count=4)


def test_planners_accept_specs_from_body_models() -> None:
    pool = make_pool(elastic=2)
    assert plan_scale_out(ScaleOutBody(num_replicas=7).to_spec(), pool, initial_count=4).to_create == 1
    assert plan_scale_in(ScaleInBody(num_replicas=5).to_spec(), pool, initial_count=4).victim_ids == ["engine_5"]


@pytest.mark.parametrize("spec", [ScaleOutSpec, ScaleInSpec])
def test_specs_need_exactly_one_target_and_a_count_that_is_not_negative(spec) -> None:
    with pytest.raises(ValueError, match="not both"):
        spec(num_replicas=5, engine_urls=("http://a:1",))
    with pytest.raises(ValueError, match="num_replicas"):
        spec()
    with pytest.raises(ValueError, match=">= 0"):
        spec(num_replicas=-1)
    assert spec(engine_urls=["http://a:1"]).engine_urls == ("http://a:1",)


# -- scale-in planning ----------------------------------------------------------------------------------


def test_scale_in_victims_are_newest_elastic_engines_never_initial() -> None:
    pool = make_pool(initial=4, elastic=8)  # engine_4 .. engine_11: LIFO must order 11 before 9
    plan = in_plan(pool, num_replicas=7)
    assert isinstance(plan, ScaleInPlan)
    assert plan.victim_ids == ["engine_11", "engine_10", "engine_9", "engine_8", "engine_7"]
    assert (plan.engines_before, plan.engines_after, plan.target) == (12, 7, 7)
    all_out = in_plan(pool, num_replicas=4)
    assert len(all_out.victims) == 8
    assert all(v.kind is EngineKind.ELASTIC for v in all_out.victims)


def test_scale_in_below_initial_count_is_400_with_a_message() -> None:
    result = in_plan(make_pool(initial=4, elastic=2), num_replicas=3)
    assert isinstance(result, Rejection)
    assert (http_status_of(result.to_error()), result.code, result.field) == (400, "below_initial", "num_replicas")
    assert "num_replicas: 3 is below the initial engine count 4" in result.message
    assert "smallest target is 4" in result.message


@pytest.mark.parametrize("target", [6, 9])
def test_scale_in_target_at_or_above_current_is_noop(target: int) -> None:
    result = in_plan(make_pool(initial=4, elastic=2), num_replicas=target)
    assert isinstance(result, Noop) and result.direction is Direction.SCALE_IN


def test_scale_in_dry_run_shows_victims_and_changes_nothing() -> None:
    pool = make_pool(initial=4, elastic=2)
    pool.set_in_flight("engine_5", 3)
    before = pool.to_dict()
    registry = ScaleRequestRegistry(FakeClock())
    plan = registry.submit_scale_in(ScaleInSpec(num_replicas=4, dry_run=True, force=True), pool, initial_count=4)
    assert isinstance(plan, ScaleInPlan) and plan.dry_run
    answer = plan.to_dict()
    assert ScaleInDryRun(**answer).engines_after == 4
    assert answer["victims"][0] == {
        "engine_id": "engine_5",
        "url": "http://10.0.0.5:30000",
        "kind": "elastic",
        "in_flight": 3,
    }
    assert pool.to_dict() == before
    assert len(registry) == 0 and registry.running() is None
    with pytest.raises(ValueError, match="dry-run"):
        registry.create(plan)


def test_scale_in_by_count_refuses_to_pick_external_engines() -> None:
    pool = make_pool(initial=4, elastic=1, external=("http://ext:1",))
    result = in_plan(pool, num_replicas=4)
    assert isinstance(result, Rejection)
    assert result.code == "not_enough_victims" and "engine_urls" in result.message


def test_scale_in_by_url_removes_elastic_and_external_engines() -> None:
    pool = make_pool(initial=2, elastic=1, external=("http://ext:1",))
    plan = in_plan(pool, initial=2, engine_urls=["http://10.0.0.2:30000", "HTTP://EXT:1/"])
    assert plan.victim_ids == ["engine_3", "engine_2"]
    assert plan.target is None and plan.engines_after == 2


def test_scale_in_by_url_names_every_bad_url() -> None:
    pool = make_pool(initial=2, elastic=1)
    pool.add(EngineKind.ELASTIC, url="http://starting:1")
    result = in_plan(
        pool,
        initial=2,
        engine_urls=["http://10.0.0.0:30000", "http://nowhere:1", "http://starting:1", "http://10.0.0.2:30000"],
    )
    assert isinstance(result, Rejection) and result.field == "engine_urls"
    assert "http://10.0.0.0:30000 is initial engine engine_0, which scale-in never removes" in result.message
    assert "http://nowhere:1 is not attached" in result.message
    assert "http://starting:1 (engine_3) is PENDING, not ACTIVE" in result.message
    assert "10.0.0.2" not in result.message


def test_scale_in_by_url_skips_engines_already_draining() -> None:
    pool = make_pool(initial=2, elastic=2)
    pool.transition("engine_2", S.DRAINING)
    assert isinstance(in_plan(pool, initial=2, engine_urls=["http://10.0.0.2:30000"]), Noop)
    plan = in_plan(pool, initial=2, engine_urls=["http://10.0.0.2:30000", "http://10.0.0.3:30000"])
    assert plan.victim_ids == ["engine_3"]


def test_rejections_change_nothing() -> None:
    pool = make_pool(initial=4, elastic=1)
    registry = ScaleRequestRegistry(FakeClock())
    before = pool.to_dict()
    for call in (
        lambda: registry.submit_scale_out(ScaleOutSpec(num_replicas=2), pool, initial_count=4),
        lambda: registry.submit_scale_out(ScaleOutSpec(num_replicas=9), pool, initial_count=4, max_engines=8),
        lambda: registry.submit_scale_out(ScaleOutSpec(model_name="x", num_replicas=6), pool, initial_count=4),
        lambda: registry.submit_scale_out(
            parse_body(ScaleOutBody, {"num_replicas": -1}).to_spec(), pool, initial_count=4
        ),
        lambda: registry.submit_scale_in(ScaleInSpec(num_replicas=3), pool, initial_count=4),
        lambda: registry.submit_scale_in(ScaleInSpec(engine_urls=("http://10.0.0.0:30000",)), pool, initial_count=4),
        lambda: registry.cancel_batch(["NOPE"]),
    ):
        with pytest.raises((RejectedRequest, UnknownModel, InvalidBody)) as info:
            call()
        assert 400 <= http_status_of(info.value) < 500
    assert pool.to_dict() == before
    assert len(registry) == 0
    assert registry.submit_scale_out(ScaleOutSpec(num_replicas=5 + 1), pool, initial_count=4).request_id == "so-1"


# -- registry: one at a time ------------------------------------------------------------------------------


def test_registry_ids_and_one_at_a_time_conflict_names_the_running_request() -> None:
    pool = make_pool(initial=4, elastic=2)
    registry = ScaleRequestRegistry(FakeClock())
    first = registry.submit_scale_out(ScaleOutSpec(num_replicas=8), pool, initial_count=4)
    assert isinstance(first, ScaleOutRequest)
    assert (first.request_id, first.status, first.target, first.to_create) == ("so-1", SO.PENDING, 8, 2)
    assert registry.running() is first

    with pytest.raises(ScaleConflict) as info:
        registry.submit_scale_out(ScaleOutSpec(num_replicas=9), pool, initial_count=4)
    conflict = info.value
    assert http_status_of(conflict) == 409 and conflict.running_request_id == "so-1"
    assert conflict.to_dict()["running_request_id"] == "so-1"
    assert "so-1" in conflict.message and "/rollout/scale_out/so-1/cancel" in conflict.message
    with pytest.raises(ScaleConflict):
        registry.submit_scale_in(ScaleInSpec(num_replicas=4), pool, initial_count=4)
    with pytest.raises(ScaleConflict):  # even a target that looks met: another operation is running
        registry.submit_scale_out(ScaleOutSpec(num_replicas=6), pool, initial_count=4)
    # bad input is still reported as bad input, not as a conflict
    with pytest.raises(RejectedRequest):
        registry.submit_scale_out(ScaleOutSpec(num_replicas=1), pool, initial_count=4)
    # a dry run is allowed: it changes nothing
    assert registry.submit_scale_in(ScaleInSpec(num_replicas=4, dry_run=True), pool, initial_count=4).dry_run
    assert len(registry) == 1

    first.fail("placement timed out")  # terminal frees the slot
    second = registry.submit_scale_in(ScaleInSpec(num_replicas=5), pool, initial_count=4)
    assert isinstance(second, ScaleInRequest) and second.request_id == "si-1"
    assert second.victim_ids == ["engine_5"]
    with pytest.raises(ScaleConflict) as info:
        registry.submit_scale_out(ScaleOutSpec(num_replicas=8), pool, initial_count=4)
    assert info.value.running_request_id == "si-1" and "cannot be cancelled" in info.value.message
    for status in (SI.DRAINING, SI.REMOVING, SI.COMPLETED):
        second.advance(status)
    assert registry.submit_scale_out(ScaleOutSpec(num_replicas=8), pool, initial_count=4).request_id == "so-2"


def test_scale_in_while_a_scale_out_starts_its_engines_is_a_conflict_not_bad_input() -> None:
    """The soak's case: 2 initial engines, a scale-out to 3 whose engine is still STARTING, then a scale-in to 2.
    Too few ACTIVE elastic engines is the pool's state of the moment: 409 naming the scale-out, not 400."""
    pool = make_pool(initial=2)
    registry = ScaleRequestRegistry(FakeClock())
    running = registry.submit_scale_out(ScaleOutSpec(num_replicas=3), pool, initial_count=2)
    starting = pool.add(EngineKind.ELASTIC)
    pool.transition(starting.engine_id, EngineState.STARTING)
    with pytest.raises(ScaleConflict) as info:
        registry.submit_scale_in(ScaleInSpec(num_replicas=2), pool, initial_count=2)
    assert http_status_of(info.value) == 409 and info.value.running_request_id == running.request_id
    with pytest.raises(RejectedRequest):  # a request that is wrong whatever runs is still 400
        registry.submit_scale_in(ScaleInSpec(num_replicas=1), pool, initial_count=2)
    with pytest.raises(RejectedRequest):  # a dry run is answered while an operation runs: what it would say now
        registry.submit_scale_in(ScaleInSpec(num_replicas=2, dry_run=True), pool, initial_count=2)
    running.fail("placement timed out")
    with pytest.raises(RejectedRequest) as rejected:  # nothing runs: the pool's state is the answer
        registry.submit_scale_in(ScaleInSpec(num_replicas=2), pool, initial_count=2)
    assert rejected.value.code == "not_enough_victims"


def test_noop_is_not_registered() -> None:
    registry = ScaleRequestRegistry(FakeClock())
    result = registry.submit_scale_out(ScaleOutSpec(num_replicas=4), make_pool(), initial_count=4)
    assert isinstance(result, Noop)
    assert len(registry) == 0 and registry.running() is None


def test_create_rejects_non_plans() -> None:
    registry = ScaleRequestRegistry(FakeClock())
    with pytest.raises(TypeError):
        registry.create(Noop(Direction.SCALE_OUT, "default", "met", 4))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        ScaleConflict("so-3", "CREATING", "scale_out"),
        UnknownModel("qwen"),
        UnknownRequest("so-9", "scale_out"),
        NotCancellable("si-1", "DRAINING", "never"),
        RejectedRequest("num_replicas: no", field="num_replicas", code="below_initial"),
    ],
)
def test_domain_errors_carry_no_http_status_and_survive_pickle(error: ScalingError) -> None:
    assert not hasattr(error, "http_status") and not hasattr(type(error), "default_status")
    assert not any("api_models" in cls.__module__ for cls in type(error).__mro__)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error) and clone.__dict__ == error.__dict__ and str(clone) == str(error)
    assert clone.to_dict() == error.to_dict() and set(error.to_dict()) >= {"detail", "field"}


def test_rejected_request_keeps_its_code_and_illegal_transitions_pickle() -> None:
    rejection = Rejection("below_initial", "num_replicas", "num_replicas: 2 is below", value=2)
    error = rejection.to_error()
    assert isinstance(error, RejectedRequest) and error.code == "below_initial" and error.field == "num_replicas"
    assert error.to_dict() == {"detail": "num_replicas: 2 is below", "field": "num_replicas"}
    bug = IllegalRequestTransition("so-1", SO.PENDING, SO.ACTIVE, "why")
    clone = pickle.loads(pickle.dumps(bug))
    assert str(clone) == str(bug) == "so-1: illegal transition PENDING -> ACTIVE (why)" and clone.dst is SO.ACTIVE


def test_conflict_error_survives_pickle() -> None:
    err = ScaleConflict("so-3", "CREATING", "scale_out")
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, ScaleConflict)
    assert (clone.running_request_id, http_status_of(clone), str(clone)) == ("so-3", 409, str(err))
    assert clone.to_dict() == err.to_dict() and (clone.running_status, clone.direction) == ("CREATING", "scale_out")


# -- registry: lookup and listing ---------------------------------------------------------------------------


def _finished_registry() -> tuple[ScaleRequestRegistry, EnginePool]:
    pool = make_pool(initial=4, elastic=2)
    registry = ScaleRequestRegistry(FakeClock())
    registry.submit_scale_out(ScaleOutSpec(num_replicas=7), pool, initial_count=4).fail("boom")
    req = registry.submit_scale_in(ScaleInSpec(num_replicas=5), pool, initial_count=4)
    req.fail("shutdown failed")
    registry.submit_scale_out(ScaleOutSpec(engine_urls=("http://ext:1",)), pool, initial_count=4)
    return registry, pool


def test_get_and_unknown_ids_are_404() -> None:
    registry, _ = _finished_registry()
    assert registry.get("so-1").status is SO.FAILED
    assert registry.get("si-1", Direction.SCALE_IN).request_id == "si-1"
    for request_id, direction in (("so-99", None), ("si-1", "scale_out"), ("so-1", "scale_in")):
        with pytest.raises(UnknownRequest) as info:
            registry.get(request_id, direction)
        assert http_status_of(info.value) == 404 and request_id in info.value.message


def test_list_is_newest_first_with_status_and_model_filters() -> None:
    registry, _ = _finished_registry()
    assert [r.request_id for r in registry.list_requests()] == ["so-2", "si-1", "so-1"]
    assert [r.request_id for r in registry.list_requests("scale_out")] == ["so-2", "so-1"]
    assert [r.request_id for r in registry.list_requests("scale_out", status="failed")] == ["so-1"]
    assert [r.request_id for r in registry.list_requests(status=["FAILED"])] == ["si-1", "so-1"]
    assert [r.request_id for r in registry.list_requests("scale_in", model_name="default")] == ["si-1"]
    with pytest.raises(RejectedRequest) as info:
        registry.list_requests("scale_in", status="CANCELLED")  # a scale-out status only
    assert info.value.field == "status" and "allowed: COMPLETED, DRAINING" in info.value.message
    with pytest.raises(UnknownModel):
        registry.list_requests(model_name="other")


# -- cancel ---------------------------------------------------------------------------------------------


def test_cancel_is_sticky_and_idempotent() -> None:
    pool = make_pool(initial=4)
    registry = ScaleRequestRegistry(FakeClock())
    req = registry.submit_scale_out(ScaleOutSpec(num_replicas=6), pool, initial_count=4)
    assert registry.cancel("so-1") is req
    assert req.cancel_requested and req.cancel_requested_at is not None
    stamp = req.cancel_requested_at
    assert req.request_cancel() is False and req.cancel_requested_at == stamp  # idempotent
    # the shell may still report progress, but the end is CANCELLED whatever it reports
    req.add_engine("engine_4")
    req.advance(SO.HEALTH_CHECKING)
    req.advance(SO.WEIGHT_SYNCING)
    assert req.advance(SO.ACTIVE) is SO.CANCELLED
    assert req.terminal and registry.running() is None
    with pytest.raises(NotCancellable) as info:
        registry.cancel("so-1")
    assert http_status_of(info.value) == 400 and "CANCELLED" in info.value.message


def test_cancel_turns_a_failure_into_cancelled_and_keeps_the_error() -> None:
    req = ScaleRequestRegistry(FakeClock()).create(ScaleOutPlan("default", ScaleKind.RAY_NATIVE, 4, 1, target=5))
    req.request_cancel()
    assert req.fail("placement group timed out") is SO.CANCELLED
    assert req.error == "placement group timed out"


def test_cancel_of_finished_scale_in_and_unknown_requests() -> None:
    registry, _ = _finished_registry()
    with pytest.raises(NotCancellable, match="FAILED"):
        registry.cancel("so-1")
    with pytest.raises(NotCancellable, match="scale-in, which cannot be cancelled"):
        registry.cancel("si-1")
    with pytest.raises(UnknownRequest):
        registry.cancel("so-42")


def test_a_cancelled_request_tears_down_its_engines_not_yet_active() -> None:
    pool = make_pool(initial=4)
    registry = ScaleRequestRegistry(FakeClock())
    req = registry.submit_scale_out(ScaleOutSpec(num_replicas=9), pool, initial_count=4)
    ids = [pool.add(EngineKind.ELASTIC).engine_id for _ in range(5)]  # engine_4 .. engine_8
    for engine_id in ids:
        req.add_engine(engine_id)
    activate(pool, "engine_4")  # serving: kept
    pool.transition("engine_5", S.STARTING)
    pool.transition("engine_5", S.HEALTH_CHECKING)
    for state in BRING_UP:
        pool.transition("engine_6", state)
    pool.transition("engine_7", S.FAILED, error="no GPU")  # already gone
    # engine_8 still PENDING
    stray = pool.add(EngineKind.ELASTIC)  # not this request's
    registry.cancel(req.request_id)
    # what the executor decides once the bring-ups ended: CANCELLED whatever the policy; every engine of the
    # request that did not come up goes (the FAILED one too: its group and processes still need cleaning)
    results = {engine_id: pool.get(engine_id).state for engine_id in req.engine_ids}
    for policy in PartialSuccessPolicy:
        assert decide_partial_outcome(results, policy, cancelled=True) == (
            SO.CANCELLED, ["engine_5", "engine_6", "engine_7", "engine_8"])
    assert stray.engine_id not in results
    for engine_id in ("engine_5", "engine_6", "engine_8"):  # the pool lets them go straight to REMOVED
        pool.transition(engine_id, S.REMOVED)
    assert req.advance(SO.FAILED) is SO.CANCELLED
    req.observe(pool)
    states = {o.engine_id: o.state for o in req.engines.values()}
    assert states == {
        "engine_4": S.ACTIVE,
        "engine_5": S.REMOVED,
        "engine_6": S.REMOVED,
        "engine_7": S.FAILED,
        "engine_8": S.REMOVED,
    }
    assert req.engines["engine_7"].error == "no GPU"


def test_cancel_batch_filters_and_dry_run_changes_nothing() -> None:
    registry, pool = _finished_registry()  # so-2 (external) is running, PENDING
    dry = registry.cancel_batch(["pending", "FAILED"], dry_run=True)
    assert dry == CancelBatchResult(
        dry_run=True,
        cancelled=["so-2"],
        skipped=[{"request_id": "so-1", "status": "FAILED", "reason": "finished"}],
    )
    assert CancelBatchResponse(**dry.to_dict()).cancelled == ["so-2"]
    assert not registry.get("so-2").cancel_requested
    assert registry.cancel_batch(["CREATING"]).cancelled == []
    assert not registry.get("so-2").cancel_requested
    with pytest.raises(RejectedRequest) as info:
        registry.cancel_batch(["PENDING", "DONE"])
    assert info.value.field == "status_filter" and "'DONE'" in info.value.message
    assert not registry.get("so-2").cancel_requested
    done = registry.cancel_batch(None)
    assert done.cancelled == ["so-2"] and done.skipped == []
    assert registry.get("so-2").cancel_requested


# -- history --------------------------------------------------------------------------------------------


def test_gc_keeps_the_newest_100_finished_requests_per_direction() -> None:
    pool = make_pool(initial=1)
    registry = ScaleRequestRegistry(FakeClock())
    for _ in range(130):
        registry.submit_scale_out(ScaleOutSpec(num_replicas=2), pool, initial_count=1).fail("x")
    registry.submit_scale_in(
        ScaleInSpec(engine_urls=("http://x:1",)), make_pool(initial=1, external=("http://x:1",)), initial_count=1
    ).fail("y")
    running = registry.submit_scale_out(ScaleOutSpec(num_replicas=2), pool, initial_count=1)
    outs = registry.list_requests("scale_out")
    assert len(outs) == 101  # 100 finished + the running one
    assert outs[0] is running and outs[1].request_id == "so-130" and outs[-1].request_id == "so-31"
    assert "so-30" not in registry
    with pytest.raises(UnknownRequest):
        registry.get("so-1")
    assert [r.request_id for r in registry.list_requests("scale_in")] == ["si-1"]


def test_gc_never_collects_running_requests_and_respects_keep() -> None:
    registry = ScaleRequestRegistry(FakeClock(), keep=2)
    pool = make_pool(initial=1)
    for _ in range(3):
        registry.submit_scale_out(ScaleOutSpec(num_replicas=2), pool, initial_count=1).fail("x")
    assert [r.request_id for r in registry.list_requests()] == ["so-3", "so-2"]
    running = registry.submit_scale_out(ScaleOutSpec(num_replicas=2), pool, initial_count=1)
    assert registry.gc() == []
    assert registry.running() is running
    with pytest.raises(ValueError):
        ScaleRequestRegistry(FakeClock(), keep=0)


# -- partial outcomes -----------------------------------------------------------------------------------


def test_decide_partial_outcome() -> None:
    rollback, keep = PartialSuccessPolicy.ROLLBACK_ALL, PartialSuccessPolicy.KEEP_PARTIAL
    all_up = {"engine_4": True, "engine_5": S.ACTIVE}
    assert decide_partial_outcome(all_up, rollback) == (SO.ACTIVE, [])
    assert decide_partial_outcome(all_up, keep) == (SO.ACTIVE, [])
    mixed = {"engine_10": True, "engine_9": S.FAILED, "engine_11": "HEALTH_CHECKING"}
    assert decide_partial_outcome(mixed, rollback) == (SO.FAILED, ["engine_9", "engine_10", "engine_11"])
    assert decide_partial_outcome(mixed, "keep_partial") == (SO.PARTIAL, ["engine_9", "engine_11"])
    none_up = {"engine_4": False, "engine_5": S.PENDING}
    assert decide_partial_outcome(none_up, keep) == (SO.FAILED, ["engine_4", "engine_5"])
    assert decide_partial_outcome(none_up, rollback) == (SO.FAILED, ["engine_4", "engine_5"])
    assert decide_partial_outcome({"engine_1": True})[0] is SO.ACTIVE  # default policy
    with pytest.raises(ValueError):
        decide_partial_outcome({}, keep)
    with pytest.raises(ValueError):
        decide_partial_outcome({"engine_1": True}, "keep_some")


# -- request records ------------------------------------------------------------------------------------


def test_scale_out_record_follows_its_engines_and_times_every_phase() -> None:
    clock = FakeClock()
    pool = make_pool(initial=4, clock=clock)
    registry = ScaleRequestRegistry(clock)
    req = registry.submit_scale_out(ScaleOutSpec(num_replicas=6, timeout_secs=120), pool, initial_count=4)
    a, b = pool.add(EngineKind.ELASTIC), pool.add(EngineKind.ELASTIC)
    req.add_engine(a.engine_id)
    req.add_engine(b.engine_id)
    assert req.status is SO.CREATING
    pool.transition(a.engine_id, S.STARTING)
    pool.transition(a.engine_id, S.HEALTH_CHECKING)
    assert req.observe(pool) is SO.HEALTH_CHECKING  # the furthest engine leads
    pool.set_url(a.engine_id, "http://10.0.0.9:30001")
    pool.transition(a.engine_id, S.WEIGHT_SYNCING)
    pool.set_weight_version(a.engine_id, 0)
    pool.transition(a.engine_id, S.ACTIVE)
    pool.transition(b.engine_id, S.STARTING)
    pool.transition(b.engine_id, S.FAILED, error="OOM")
    assert req.observe(pool) is SO.WEIGHT_SYNCING
    status, to_rollback = decide_partial_outcome(
        {e: o.state for e, o in req.engines.items()}, PartialSuccessPolicy.KEEP_PARTIAL
    )
    assert (status, to_rollback) == (SO.PARTIAL, [b.engine_id])
    assert req.advance(status) is SO.PARTIAL and registry.running() is None

    record = req.to_dict()
    view = ScaleOutRequestView(**record)  # the REST schema accepts exactly this shape
    assert view.status == "PARTIAL" and view.kind == "ray_native"
    assert [t.status for t in view.transitions] == [
        "PENDING",
        "CREATING",
        "HEALTH_CHECKING",
        "WEIGHT_SYNCING",
        "PARTIAL",
    ]
    eng_a = record["engines"][0]
    assert eng_a["url"] == "http://10.0.0.9:30001" and eng_a["state"] == "ACTIVE"
    assert eng_a["placement_wait_s"] == pytest.approx(a.entered_at(S.STARTING) - a.created_at)
    assert all(
        eng_a[k] is not None and eng_a[k] > 0
        for k in ("placement_wait_s", "start_s", "health_s", "weight_sync_s", "total_s")
    )
    assert record["engines"][1]["error"] == "OOM" and record["engines"][1]["health_s"] is None
    timings = record["timings"]
    assert timings["total_s"] == pytest.approx(req.finished_at - req.created_at)
    assert timings["weight_sync_s"] == eng_a["weight_sync_s"]
    assert timings["placement_wait_s"] == max(o["placement_wait_s"] for o in record["engines"])
    assert sum(timings["in_status_s"].values()) == pytest.approx(timings["total_s"])
    assert record["timeout_secs"] == 120.0 and record["finished_at"] is not None


def test_deadline_uses_the_request_timeout_or_the_default() -> None:
    registry = ScaleRequestRegistry(FakeClock())
    pool = make_pool()
    req = registry.submit_scale_out(ScaleOutSpec(num_replicas=5, timeout_secs=20), pool, initial_count=4)
    assert req.deadline(300.0) == req.created_at + 20.0
    req.fail("x")
    other = registry.submit_scale_in(ScaleInSpec(num_replicas=4), make_pool(elastic=1), initial_count=4)
    assert other.deadline(30.0) == other.created_at + 30.0


def test_external_record_goes_through_connecting() -> None:
    registry = ScaleRequestRegistry(FakeClock())
    req = registry.submit_scale_out(ScaleOutSpec(engine_urls=("http://ext:1",)), make_pool(), initial_count=4)
    assert req.kind is ScaleKind.EXTERNAL and req.urls == ("http://ext:1",)
    with pytest.raises(IllegalRequestTransition, match="external"):
        req.advance(SO.CREATING)
    req.add_engine("engine_4", url="http://ext:1")
    assert req.status is SO.CONNECTING
    assert ScaleOutRequestView(**req.to_dict()).finished_at is None


def test_scale_out_record_rejects_illegal_moves() -> None:
    req = ScaleRequestRegistry(FakeClock()).create(ScaleOutPlan("default", ScaleKind.RAY_NATIVE, 4, 1, target=5))
    with pytest.raises(IllegalRequestTransition, match="PENDING -> ACTIVE"):
        req.advance(SO.ACTIVE)
    with pytest.raises(IllegalRequestTransition, match="ray_native"):
        req.advance(SO.CONNECTING)
    assert req.advance(SO.PENDING) is SO.PENDING  # same status: no-op
    req.advance(SO.CREATING)
    with pytest.raises(IllegalRequestTransition):
        req.advance(SO.WEIGHT_SYNCING)  # skips health checking
    req.advance(SO.FAILED)
    assert req.error == "scale-out failed"
    for status in (SO.FAILED, SO.CANCELLED):
        with pytest.raises(IllegalRequestTransition):
            req.advance(status)
    with pytest.raises(IllegalRequestTransition):
        req.add_engine("engine_9")
    with pytest.raises(ValueError):
        req.add_engine("worker-1")


def test_scale_in_record_drain_and_removal_timings() -> None:
    clock = FakeClock()
    pool = make_pool(initial=4, elastic=2, clock=clock)
    pool.set_in_flight("engine_5", 2)
    registry = ScaleRequestRegistry(clock)
    req = registry.submit_scale_in(ScaleInSpec(num_replicas=4, force=True, timeout_secs=30), pool, initial_count=4)
    assert req.victim_ids == ["engine_5", "engine_4"] and req.force
    with pytest.raises(IllegalRequestTransition):
        req.advance(SI.REMOVING)
    req.advance(SI.DRAINING)
    for engine_id in req.victim_ids:
        pool.transition(engine_id, S.DRAINING)
    req.note_drained("engine_4")
    req.note_drained("engine_5", aborted_requests=2)
    req.advance(SI.REMOVING)
    for engine_id in req.victim_ids:
        pool.transition(engine_id, S.REMOVED)
    req.observe(pool)
    req.advance(SI.COMPLETED)
    with pytest.raises(KeyError):
        req.note_drained("engine_0")

    record = req.to_dict()
    view = ScaleInRequestView(**record)
    assert view.status == "COMPLETED" and view.force and view.timeout_secs == 30.0
    victims = {v["engine_id"]: v for v in record["victims"]}
    assert victims["engine_5"]["aborted_requests"] == 2 and victims["engine_5"]["state"] == "REMOVED"
    assert all(v["drain_s"] > 0 and v["shutdown_s"] > 0 for v in victims.values())
    assert record["timings"]["total_s"] == pytest.approx(req.finished_at - req.created_at)
    assert set(record["timings"]["in_status_s"]) == {"PENDING", "DRAINING", "REMOVING"}
    assert registry.running() is None


def test_engine_phase_timings_for_an_engine_that_never_finished() -> None:
    pool = EnginePool(FakeClock())
    record = pool.add(EngineKind.ELASTIC)
    pool.transition(record.engine_id, S.STARTING)
    assert engine_phase_timings(record) == {
        "placement_wait_s": 1.0,
        "start_s": None,
        "health_s": None,
        "weight_sync_s": None,
        "total_s": None,
    }
