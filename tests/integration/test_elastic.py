"""Elastic scaling on a real local Ray cluster: scale-out, real drain, NOOP/409, rollback, cancel, eviction,
external engines. Placement groups are checked in Ray's own table."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from relax.rollout.control.api import status_of
from relax.rollout.control.api_models import InvalidBody, ScaleInBody, ScaleOutBody, parse_body
from relax.rollout.manager import spawn_rollout_manager
from relax.rollout.settings import (
    DataSettings,
    FleetSettings,
    RolloutSettings,
    SamplingSettings,
    ScalingSettings,
)


def wait_until(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout}s"
        time.sleep(0.1)


def groups_by_name() -> dict[str, str]:
    return {g["name"]: g["state"] for g in placement_group_table().values() if g.get("name")}


@pytest.fixture(scope="module")
def elastic(ray_cluster, tiny_preset):
    initial = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK", name="test-initial")
    ray.get(initial.ready(), timeout=60)
    manager = spawn_rollout_manager(RolloutSettings(
        data=DataSettings(prompt_data=str(tiny_preset.train_path), num_rollout=1, rollout_batch_size=4,
                          sampling=SamplingSettings(n_samples=2, max_new_tokens=8), max_staleness=0,
                          apply_chat_template=True, rm_type="tiny"),
        fleet=FleetSettings(model_path=str(tiny_preset.model_dir), drain_timeout_s=20, shutdown_timeout_s=5),
        scaling=ScalingSettings(max_engines=3, scale_out_timeout_s=60),
    ))
    try:
        ray.get(manager.start_initial_engines.remote([(initial, 0)]), timeout=180)
        yield manager
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.kill(manager)
        remove_placement_group(initial)


_BODIES = {"scale_out": ScaleOutBody, "scale_in": ScaleInBody}


def call(manager, method: str, *args):
    """One control-API call as the REST layer answers it: (status, body); a dict body is validated first."""
    try:
        if method in _BODIES:
            args = (parse_body(_BODIES[method], args[0]).to_spec(), *args[1:])
        return 200, ray.get(getattr(manager, method).remote(*args), timeout=120)
    except InvalidBody as exc:  # refused by the REST layer before it reaches the manager
        return status_of(exc), exc.to_dict()
    except ray.exceptions.RayTaskError as exc:
        status = status_of(exc.cause)
        if status is None:
            raise
        return status, exc.cause.to_dict()


def engines(manager) -> list[dict]:
    return call(manager, "engines_view")[1]["models"]["default"]["engines"]


def finished(manager, direction: str, request_id: str, timeout: float = 120) -> dict:
    def done():
        record = call(manager, "get_scale_request", direction, request_id)[1]
        return record if record["status"] in ("ACTIVE", "PARTIAL", "FAILED", "CANCELLED", "COMPLETED") else None

    return wait_until(done, timeout, f"{request_id} to finish")


def test_scale_out_to_an_absolute_target_with_conflict_and_noop(elastic) -> None:
    status, body = call(elastic, "scale_out", {"num_replicas": 3})
    assert status == 200 and body["status"] == "PENDING"
    request_id = body["request_id"]
    status, conflict = call(elastic, "scale_out", {"num_replicas": 3})
    assert status == 409 and conflict["running_request_id"] == request_id
    record = finished(elastic, "scale_out", request_id)
    assert record["status"] == "ACTIVE", record
    timings = record["timings"]
    assert timings["placement_wait_s"] is not None and timings["weight_sync_s"] is not None
    active = [e for e in engines(elastic) if e["status"] == "ACTIVE"]
    assert len(active) == 3 and sorted(e["kind"] for e in active) == ["elastic", "elastic", "initial"]
    names = groups_by_name()
    for engine in active:
        if engine["kind"] == "elastic":
            assert names[f"relax-{engine['engine_id']}"] == "CREATED"
            # the join measure: decision -> ACTIVE now; -> first answer once it served (the next test)
            assert engine["join_active_s"] > 0 and engine["join_first_answer_s"] is None
    status, body = call(elastic, "scale_out", {"num_replicas": 3})
    assert status == 200 and body["status"] == "NOOP"
    status, body = call(elastic, "scale_out", {"num_replicas": 4})
    assert status == 400 and "max" in body["detail"]
    status, body = call(elastic, "get_scale_request", "scale_out", "so-999")
    assert status == 404 and "so-999" in body["detail"]
    status, body = call(elastic, "cancel_scale_out", "so-999")
    assert status == 404


def test_scale_in_drains_for_real_and_loses_nothing(elastic) -> None:
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    urls = [e["url"] for e in engines(elastic)]
    # Freeze every engine first so all 24 requests are still in flight when the scale-in starts, however
    # fast or slow this machine is; the drain then has real work to wait for once generation continues.
    for url in urls:
        assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
    try:
        in_flight = [elastic.generate.remote(f"load-{i}", [1, 2, 3, 4], params) for i in range(24)]
        wait_until(lambda: sum(e["in_flight"] for e in engines(elastic)) == 24, 60, "24 requests on the engines")
        victims = [e["engine_id"] for e in engines(elastic) if e["kind"] == "elastic"]
        assert all(e["in_flight"] > 0 for e in engines(elastic))  # the router spread the load
        status, body = call(elastic, "scale_in", {"num_replicas": 1, "dry_run": True})
        assert status == 200 and sorted(v["engine_id"] for v in body["victims"]) == sorted(victims)
        assert len([e for e in engines(elastic) if e["status"] == "ACTIVE"]) == 3  # dry run changed nothing
        status, body = call(elastic, "scale_in", {"num_replicas": 1})
        assert status == 200, body
        wait_until(lambda: all(e["status"] != "ACTIVE" for e in engines(elastic) if e["kind"] == "elastic"), 60,
                   "the victims to leave the router")
    finally:
        for url in urls:
            httpx.post(f"{url}/continue_generation", timeout=30)
    record = finished(elastic, "scale_in", body["request_id"])
    assert record["status"] == "COMPLETED", record
    outs = ray.get(in_flight, timeout=180)
    assert len(outs) == 24 and all(o.output["meta_info"]["completion_tokens"] == 200 for o in outs)
    joins = ray.get(elastic.status.remote())["joins"]
    for victim in victims:  # each served before it left: its join measure closed on its first answer
        assert joins[victim]["decision_to_first_answer_s"] >= joins[victim]["decision_to_active_s"] > 0
    joined = [e for e in ray.get(elastic.recent_events.remote(200)) if e["message"].startswith("joined:")]
    assert {v for e in joined for v in e["engine_ids"]} >= set(victims)
    remaining = engines(elastic)
    assert [e["kind"] for e in remaining] == ["initial"]
    names = groups_by_name()
    assert all(names[f"relax-{v}"] == "REMOVED" for v in victims)
    status, body = call(elastic, "scale_in", {"num_replicas": 0})
    assert status in (400, 422) and "num_replicas" in str(body)


def test_scale_in_past_its_drain_budget_migrates_unfinished_requests(elastic) -> None:
    """Requests still running when the drain budget is spent continue on another engine from their tokens."""
    status, body = call(elastic, "scale_out", {"num_replicas": 2})
    assert status == 200 and finished(elastic, "scale_out", body["request_id"])["status"] == "ACTIVE"
    victim = next(e for e in engines(elastic) if e["kind"] == "elastic" and e["status"] == "ACTIVE")
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}

    def victim_generated() -> int:
        return httpx.get(f"{victim['url']}/server_info", timeout=10).json()["stats"]["generated_tokens"]

    def victim_running() -> int:
        text = httpx.get(f"{victim['url']}/metrics", timeout=10).text
        return int(next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                        if s.name == "sglang:num_running_reqs"))

    def frozen_mid_way(attempt: int) -> list | None:
        """8 requests; once the victim has generated part of its share, freeze it in place. The tiny model can
        finish a share between two polls on a loaded machine: then the victim is resumed and it is tried again."""
        refs = [elastic.generate.remote(f"migrate-{attempt}-{i}", [1, 2, 3, 4], params) for i in range(8)]
        started = victim_generated()
        wait_until(lambda: victim_generated() - started >= 40, 60, "the victim to generate")
        assert httpx.post(f"{victim['url']}/pause_generation", json={"mode": "in_place"},
                          timeout=30).status_code == 200
        if victim_running() >= 1:
            return refs
        httpx.post(f"{victim['url']}/continue_generation", json={}, timeout=30)
        ray.get(refs, timeout=180)
        return None

    before = ray.get(elastic.status.remote())["migration"]
    for attempt in range(5):
        if (in_flight := frozen_mid_way(attempt)) is not None:
            break
    else:
        pytest.fail("the victim finished its requests before it could be frozen, 5 times")
    status, body = call(elastic, "scale_in", {"num_replicas": 1, "timeout_secs": 1})
    assert status == 200, body
    outs = ray.get(in_flight, timeout=180)
    assert finished(elastic, "scale_in", body["request_id"])["status"] == "COMPLETED"
    assert len(outs) == 8 and all(o.output["meta_info"]["completion_tokens"] == 200 for o in outs)
    migrated = [o for o in outs if len(o.output["meta_info"].get("segments", ())) > 1]
    assert migrated, [o.engine_id for o in outs]
    for o in migrated:
        meta = o.output["meta_info"]
        first, *rest = meta["segments"]
        assert first["engine_id"] == victim["engine_id"] and 0 < first["tokens"] < 200
        assert sum(s["tokens"] for s in meta["segments"]) == 200 == len(o.output["output_ids"])
        assert len(meta["output_token_logprobs"]) == 200  # every token keeps its rollout log-prob (TIS)
        assert meta["weight_versions"][0]["start"] == 0 and meta["weight_versions"][-1]["end"] == 200
    after = ray.get(elastic.status.remote())["migration"]
    kept = after["tokens_kept"] - before["tokens_kept"]
    assert kept == sum(o.output["meta_info"]["segments"][0]["tokens"] for o in migrated)
    assert after["tokens_regenerated"] == before["tokens_regenerated"]
    assert after["migrated_requests"] - before["migrated_requests"] == len(migrated)
    print(f"scale-in past the drain budget: {len(migrated)} request(s) migrated, {kept} tokens kept, 0 regenerated")


@pytest.mark.parametrize("body,field", [
    ({"num_replicas": -1}, "num_replicas"),
    ({"num_replicas": "2"}, "num_replicas"),
    ({"num_replicas": 2, "surprise": 1}, "surprise"),
    ({"engine_urls": ["ftp://x:1"]}, "engine_urls"),
    ({"num_replicas": 2, "model_name": "other"}, "model"),
])
def test_bad_scale_bodies_change_nothing(elastic, body, field) -> None:
    before = engines(elastic)
    status, answer = call(elastic, "scale_out", body)
    assert 400 <= status < 500 and field in str(answer)
    assert engines(elastic) == before


def test_unplaceable_scale_out_rolls_back_and_cancel_is_sticky(elastic) -> None:
    blockers = []

    def free_gpus() -> int:
        return int(ray.available_resources().get("GPU", 0))

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # take every free GPU, including ones released late by earlier tests
        if free := free_gpus():
            group = placement_group([{"GPU": 1, "CPU": 0.01}] * free, name=f"test-blocker-{len(blockers)}")
            blockers.append(group)  # removed below whatever happens: a pending group would take GPUs freed later
            try:
                ray.get(group.ready(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                # the resource view lags behind a group just placed: it offered GPUs a blocker already holds
                remove_placement_group(blockers.pop())
            else:  # wait for the view to count this group before reading it again
                wait_until(lambda f=free: free_gpus() < f, 10, "the resource view to count the blocker")
        if not free_gpus():
            time.sleep(1.0)  # released resources show up in the next resource report
            if not free_gpus():
                break
    assert free_gpus() == 0
    try:
        status, body = call(elastic, "scale_out", {"num_replicas": 2, "timeout_secs": 3})
        assert status == 200
        record = finished(elastic, "scale_out", body["request_id"], 60)
        assert record["status"] == "FAILED" and "placement group not ready" in record["error"], record
        status, body = call(elastic, "scale_out", {"num_replicas": 3, "timeout_secs": 60})
        request_id = body["request_id"]
        wait_until(lambda: any(e["status"] == "PENDING" for e in engines(elastic)), 10, "a pending engine")
        status, cancelled = call(elastic, "cancel_scale_out", request_id)
        assert status == 200
        record = finished(elastic, "scale_out", request_id, 30)
        assert record["status"] == "CANCELLED"
        status, _ = call(elastic, "cancel_scale_out", request_id)
        assert status == 400
    finally:
        for group in blockers:
            remove_placement_group(group)
    assert [e["kind"] for e in engines(elastic)] == ["initial"]
    pending = [n for n, state in groups_by_name().items() if n.startswith("relax-engine") and state != "REMOVED"]
    assert pending == []


def test_sigterm_evicts_an_elastic_engine_with_drain_and_cleanup(elastic) -> None:
    status, body = call(elastic, "scale_out", {"num_replicas": 3})
    assert finished(elastic, "scale_out", body["request_id"])["status"] == "ACTIVE"
    victim = next(e["engine_id"] for e in engines(elastic) if e["kind"] == "elastic")
    info = ray.get(elastic.engine_process.remote(victim))
    params = {"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True}
    in_flight = [elastic.generate.remote(f"evict-{i}", [5, 6, 7], params) for i in range(8)]
    os.kill(info["actor_pid"], signal.SIGTERM)
    wait_until(lambda: victim not in {e["engine_id"] for e in engines(elastic)}, 60, "the evicted engine to go")
    outs = ray.get(in_flight, timeout=120)
    assert all(o.output["meta_info"]["completion_tokens"] == 150 for o in outs)
    assert groups_by_name()[f"relax-{victim}"] == "REMOVED"
    kinds = [e["kind"] for e in call(elastic, "events", 50)[1]["events"] if victim in e["engine_ids"]]
    assert "engine_evicted" in kinds
    status, body = call(elastic, "scale_in", {"num_replicas": 1})
    assert status == 200 and "request_id" in body, body
    assert finished(elastic, "scale_in", body["request_id"])["status"] == "COMPLETED"


def test_external_engines_attach_idempotently_and_leave_by_url(elastic, start_engine, tiny_preset) -> None:
    server = start_engine(tiny_preset.model_dir)
    # as SGLang 0.5.23: no /get_weight_version; attach must read the version from /model_info
    assert httpx.get(f"{server.url}/get_weight_version", timeout=10, trust_env=False).status_code == 404
    status, body = call(elastic, "scale_out", {"engine_urls": [server.url]})
    assert status == 200, body
    assert finished(elastic, "scale_out", body["request_id"])["status"] == "ACTIVE"
    external = [e for e in engines(elastic) if e["kind"] == "external"]
    assert len(external) == 1 and external[0]["status"] == "ACTIVE" and external[0]["url"] == server.url
    status, body = call(elastic, "scale_out", {"engine_urls": [server.url]})
    assert status == 200 and body["status"] == "NOOP"
    status, body = call(elastic, "scale_in", {"engine_urls": [server.url]})
    assert status == 200, body
    assert finished(elastic, "scale_in", body["request_id"])["status"] == "COMPLETED"
    assert [e["kind"] for e in engines(elastic)] == ["initial"]
    assert server.alive  # Relax detaches external engines; it does not own their processes


def test_an_engine_is_verified_on_its_first_load_and_on_demand_through_the_manager(elastic, tiny_preset) -> None:
    from safetensors.torch import load_file

    from relax.training.publisher import publish_state
    from relax.weights.digest import layout_checksums, version_digest

    state = {name: t + 0.01 for name, t in load_file(str(tiny_preset.model_dir / "model.safetensors")).items()}
    published = ray.get(elastic.status.remote())["latest_published"] + 1
    ray.get(publish_state(elastic, published, state).registered, timeout=60)  # object store: checksums in its manifest
    assert ray.get(elastic.wait_weights.remote(published, 120), timeout=130)
    digest = version_digest(layout_checksums(state, "hf"))
    (engine,) = [e for e in engines(elastic) if e["kind"] == "initial"]
    assert (engine["weight_version"], engine["weight_digest"]) == (published, digest)
    status, check = call(elastic, "verify_engine", engine["engine_id"])
    assert status == 200 and check["result"] == "verified" and check["expected_digest"] == digest
    assert check["served_digest"] == digest and check["attempt"] == 0
    assert call(elastic, "verify_engine", "engine_99")[0] == 404
    counts = ray.get(elastic.status.remote())["weight_verifications"]
    assert counts["verified"] >= 1 and counts["mismatch"] == 0
