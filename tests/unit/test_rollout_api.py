"""The control plane's HTTP layer: routes, validation messages, auth, /metrics, /openapi.json.

Routes run over ``httpx.ASGITransport`` against :class:`LocalRollout`, the backend contract implemented
in-process over the real scaling modules (registry, pool, event log), so every answer here is the one a
run would give, minus Ray. :class:`ControlPlane` is started once on a real socket, and :class:`RayBackend`
is checked against a fake actor handle for what can go wrong between processes.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
from fastapi import APIRouter
from prometheus_client.parser import text_string_to_metric_families

from relax.rollout.control.api import create_app, status_of
from relax.rollout.control.api_models import (
    CancelBatchResponse,
    EngineDetailView,
    EnginesResponse,
    ScaleAccepted,
    ScaleInDryRun,
    ScaleInRequestView,
    ScaleNoop,
    ScaleOutRequestView,
)
from relax.rollout.control.manager_client import ManagerClient, ManagerInternalError, ManagerTimeout, ManagerUnavailable
from relax.rollout.control.metrics import render_metrics
from relax.rollout.control.server import ControlPlane
from relax.rollout.pool.engines import EngineState
from relax.rollout.scaling import NotCancellable, RejectedRequest, ScaleConflict, UnknownModel, UnknownRequest
from relax.testing.local_rollout import LocalRollout

TOKEN = "s3cret-token"


def _client(app: Any, token: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://relax", headers=headers)


@pytest.fixture
async def client(backend):
    async with _client(create_app(backend, token=None)) as c:
        yield c


async def _scale_out_to(client: httpx.AsyncClient, backend: LocalRollout, n: int) -> str:
    r = await client.post("/rollout/scale_out", json={"num_replicas": n})
    assert r.status_code == 200, r.text
    await backend.wait_idle()
    return r.json()["request_id"]


def _nothing_changed(backend: LocalRollout, events_before: int) -> None:
    assert len(backend.registry) == 0
    assert backend.event_log.total == events_before
    assert len(backend.pool.live()) == 2


# -- engines ----------------------------------------------------------------------------------------


async def test_engines_lists_the_pool_in_design_shape(client):
    r = await client.get("/rollout/engines")
    assert r.status_code == 200
    view = EnginesResponse.model_validate(r.json())
    engines = view.models["default"].engines
    assert [e.engine_id for e in engines] == ["engine_0", "engine_1"]
    assert {e.status for e in engines} == {"ACTIVE"} and {e.kind for e in engines} == {"initial"}
    assert (view.total_engines, view.active_engines) == (2, 2)
    assert engines[0].url == "http://127.0.0.1:30000" and engines[0].weight_version == 0


async def test_one_engine_live_or_gone_with_its_states(client, backend):
    await _scale_out_to(client, backend, 3)
    r = await client.get("/rollout/engines/engine_2")
    assert r.status_code == 200, r.text
    view = EngineDetailView.model_validate(r.json())
    assert view.status == "ACTIVE" and view.kind == "elastic" and view.last_error is None
    assert [t.status for t in view.transitions][-1] == "ACTIVE"
    r = await client.post("/rollout/scale_in", json={"num_replicas": 2})
    await backend.wait_idle()
    gone = EngineDetailView.model_validate((await client.get("/rollout/engines/engine_2")).json())
    assert gone.status == "REMOVED"  # hidden from GET /rollout/engines, still found by id
    missing = await client.get("/rollout/engines/engine_99")
    assert missing.status_code == 404 and "unknown engine id 'engine_99'" in missing.json()["detail"]


@pytest.mark.parametrize(
    ("query", "status", "field"),
    [("model_name=default", 200, None), ("model_name=llama", 404, "model_name"), ("model_name=", 422, "model_name")],
)
async def test_engines_model_filter(client, query, status, field):
    r = await client.get(f"/rollout/engines?{query}")
    assert r.status_code == status, r.text
    if field:
        assert r.json()["field"] == field and r.json()["detail"].startswith("model_name")


# -- scale out --------------------------------------------------------------------------------------


async def test_scale_out_accepts_then_reaches_active_with_timings(client, backend):
    r = await client.post("/rollout/scale_out", json={"num_replicas": 4})
    assert r.status_code == 200
    assert ScaleAccepted.model_validate(r.json()) == ScaleAccepted(request_id="so-1", status="PENDING")
    await backend.wait_idle()

    record = ScaleOutRequestView.model_validate((await client.get("/rollout/scale_out/so-1")).json())
    assert record.status == "ACTIVE" and record.kind == "ray_native" and record.target == 4
    assert record.engine_ids == ["engine_2", "engine_3"]
    assert all(e.total_s is not None and e.state == "ACTIVE" for e in record.engines)
    assert (await client.get("/rollout/engines")).json()["total_engines"] == 4

    listing = (await client.get("/rollout/scale_out")).json()
    assert [x["request_id"] for x in listing] == ["so-1"]
    assert (await client.get("/rollout/scale_out?status=active&model_name=default")).json() == listing
    assert (await client.get("/rollout/scale_out?status=FAILED")).json() == []


async def test_scale_out_to_a_met_target_is_noop(client, backend):
    r = await client.post("/rollout/scale_out", json={"num_replicas": 2})
    assert r.status_code == 200
    noop = ScaleNoop.model_validate(r.json())
    assert noop.status == "NOOP" and noop.current_engines == 2
    assert len(backend.registry) == 0


async def test_scale_out_attaches_external_urls_idempotently(client, backend):
    body = {"engine_urls": ["HTTP://10.0.0.9:30000/", "http://10.0.0.9:30000"]}
    r = await client.post("/rollout/scale_out", json=body)
    assert r.status_code == 200 and r.json()["status"] == "PENDING"
    await backend.wait_idle()
    record = (await client.get(f"/rollout/scale_out/{r.json()['request_id']}")).json()
    assert record["kind"] == "external" and record["urls"] == ["http://10.0.0.9:30000"]
    again = await client.post("/rollout/scale_out", json=body)
    assert again.status_code == 200 and again.json()["status"] == "NOOP"


@pytest.mark.parametrize(
    ("policy", "status", "engines_after"), [("rollback_all", "FAILED", 2), ("keep_partial", "PARTIAL", 3)]
)
async def test_partial_success_policy(policy, status, engines_after):
    backend = LocalRollout(2, partial_success_policy=policy, unreachable_urls={"http://10.0.0.8:30000"})
    async with _client(create_app(backend, token=None)) as c:
        body = {"engine_urls": ["http://10.0.0.7:30000", "http://10.0.0.8:30000"]}
        request_id = (await c.post("/rollout/scale_out", json=body)).json()["request_id"]
        await backend.wait_idle()
        record = (await c.get(f"/rollout/scale_out/{request_id}")).json()
        assert record["status"] == status and "connection refused" in record["error"]
        assert (await c.get("/rollout/engines")).json()["total_engines"] == engines_after
    await backend.aclose()


async def test_scale_out_below_initial_is_400_naming_num_replicas(client, backend):
    before = backend.event_log.total
    r = await client.post("/rollout/scale_out", json={"num_replicas": 1})
    assert r.status_code == 400
    assert r.json()["field"] == "num_replicas" and "absolute total" in r.json()["detail"]
    _nothing_changed(backend, before)


async def test_unknown_model_is_404(client):
    r = await client.post("/rollout/scale_out", json={"model_name": "llama", "num_replicas": 4})
    assert r.status_code == 404 and r.json()["field"] == "model_name"


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"num_replicas": "6"}, "num_replicas", "expected an integer, got str '6'"),
        ({"num_replicas": True}, "num_replicas", "expected an integer"),
        ({"num_replicas": 6.0}, "num_replicas", "expected an integer"),
        ({"num_replicas": -1}, "num_replicas", "greater than or equal to 0"),
        ({"num_replicas": 4, "replicas": 2}, "replicas", "unknown field (allowed: model_name, num_replicas"),
        ({"num_replicas": 4, "timeout_secs": -5}, "timeout_secs", "greater than 0"),
        ({"num_replicas": 4, "timeout_secs": "30"}, "timeout_secs", "expected a number"),
        ({"engine_urls": ["http://10.0.0.1:30000/generate"]}, "engine_urls.0", "without path"),
        ({"engine_urls": ["10.0.0.1:30000"]}, "engine_urls.0", "http or https"),
        ({"engine_urls": ["http://10.0.0.1"]}, "engine_urls.0", "explicit port"),
        ({"engine_urls": "http://10.0.0.1:30000"}, "engine_urls", "expected a list"),
        ({"num_replicas": 4, "engine_urls": ["http://10.0.0.1:30000"]}, "engine_urls", "not both"),
        ({}, "engine_urls", "nothing to scale out"),
        ({"model_name": 3, "num_replicas": 4}, "model_name", "expected a string"),
    ],
)
async def test_scale_out_bad_bodies_are_422_naming_the_field_and_change_nothing(client, backend, body, field, words):
    before = backend.event_log.total
    r = await client.post("/rollout/scale_out", json=body)
    assert r.status_code == 422, r.text
    answer = r.json()
    assert answer["field"] == field
    assert answer["detail"].startswith(f"{field}: ") and words in answer["detail"], answer["detail"]
    assert answer["errors"][0]["field"] == field
    _nothing_changed(backend, before)


@pytest.mark.parametrize(
    ("content", "headers", "status", "words"),
    [
        (b'{"num_replicas": 4', {"content-type": "application/json"}, 400, "body: invalid JSON"),
        (b"[4]", {"content-type": "application/json"}, 422, "body: expected a JSON object"),
        (b"", {"content-type": "application/json"}, 422, "body: a JSON object body is required"),
        (b"num_replicas=4", {"content-type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        (b'{"num_replicas": 4}', {}, 200, ""),  # no Content-Type at all: still read as JSON
    ],
)
async def test_scale_out_malformed_payloads(client, backend, content, headers, status, words):
    r = await client.post("/rollout/scale_out", content=content, headers=headers)
    assert r.status_code == status, r.text
    if status != 200:
        assert words in r.json()["detail"] and r.json()["field"] == "body"
        assert len(backend.registry) == 0


async def test_one_scale_operation_at_a_time_409_then_sticky_cancel(client, backend):
    await _scale_out_to(client, backend, 3)
    backend.paused = True
    first = (await client.post("/rollout/scale_out", json={"num_replicas": 5})).json()["request_id"]
    # scale-in to 4: the 2 engines being created count, so removing the one ACTIVE elastic engine is valid
    for path, body in (("/rollout/scale_out", {"num_replicas": 6}), ("/rollout/scale_in", {"num_replicas": 4})):
        r = await client.post(path, json=body)
        assert r.status_code == 409, r.text
        assert r.json()["running_request_id"] == first and "one scale operation" in r.json()["detail"]

    dry = await client.post("/rollout/scale_in", json={"num_replicas": 4, "dry_run": True})
    assert dry.status_code == 200  # a dry run changes nothing, so it may run meanwhile

    r = await client.post(f"/rollout/scale_out/{first}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    backend.paused = False
    await backend.wait_idle()
    record = (await client.get(f"/rollout/scale_out/{first}")).json()
    assert record["status"] == "CANCELLED"
    assert {e["state"] for e in record["engines"]} == {"REMOVED"}
    assert (await client.get("/rollout/engines")).json()["total_engines"] == 3

    again = await client.post(f"/rollout/scale_out/{first}/cancel")
    assert again.status_code == 400 and "no longer cancellable" in again.json()["detail"]
    kinds = [e["kind"] for e in (await client.get("/rollout/events?kind=scale_cancelled")).json()["events"]]
    assert kinds == ["scale_cancelled"]


async def test_cancel_unknown_and_scale_in_ids(client, backend):
    assert (await client.post("/rollout/scale_out/so-42/cancel")).status_code == 404
    await _scale_out_to(client, backend, 3)
    r = await client.post("/rollout/scale_in", json={"num_replicas": 2})
    await backend.wait_idle()
    cancel = await client.post(f"/rollout/scale_out/{r.json()['request_id']}/cancel")
    assert cancel.status_code == 400 and "scale-in" in cancel.json()["detail"]


async def test_cancel_batch(client, backend):
    backend.paused = True
    running = (await client.post("/rollout/scale_out", json={"num_replicas": 4})).json()["request_id"]

    dry = await client.post("/rollout/scale_out_cancel", json={"dry_run": True})
    assert CancelBatchResponse.model_validate(dry.json()) == CancelBatchResponse(
        dry_run=True, cancelled=[running], skipped=[]
    )
    assert (await client.get(f"/rollout/scale_out/{running}")).json()["cancel_requested"] is False

    bad = await client.post("/rollout/scale_out_cancel", json={"status_filter": ["BOGUS"]})
    assert bad.status_code == 400 and bad.json()["field"] == "status_filter"
    unknown = await client.post("/rollout/scale_out_cancel", json={"status": ["PENDING"]})
    assert unknown.status_code == 422 and unknown.json()["field"] == "status"
    wrong = await client.post("/rollout/scale_out_cancel", json={"dry_run": "yes"})
    assert wrong.status_code == 422 and wrong.json()["field"] == "dry_run"

    done = await client.post("/rollout/scale_out_cancel")  # no body: every running scale-out
    assert done.status_code == 200 and done.json()["cancelled"] == [running]
    backend.paused = False
    await backend.wait_idle()
    assert (await client.get(f"/rollout/scale_out/{running}")).json()["status"] == "CANCELLED"


# -- scale in ---------------------------------------------------------------------------------------


async def test_scale_in_dry_run_then_real_lifo(client, backend):
    await _scale_out_to(client, backend, 5)
    dry = await client.post("/rollout/scale_in", json={"num_replicas": 3, "dry_run": True})
    assert dry.status_code == 200
    plan = ScaleInDryRun.model_validate(dry.json())
    assert [v.engine_id for v in plan.victims] == ["engine_4", "engine_3"] and plan.engines_after == 3
    assert (await client.get("/rollout/scale_in")).json() == []

    r = await client.post("/rollout/scale_in", json={"num_replicas": 3})
    assert r.status_code == 200 and r.json() == {"request_id": "si-1", "status": "PENDING"}
    await backend.wait_idle()
    record = ScaleInRequestView.model_validate((await client.get("/rollout/scale_in/si-1")).json())
    assert record.status == "COMPLETED"
    assert [(v.engine_id, v.state) for v in record.victims] == [("engine_4", "REMOVED"), ("engine_3", "REMOVED")]
    assert [x["request_id"] for x in (await client.get("/rollout/scale_in?status=completed")).json()] == ["si-1"]
    assert (await client.get("/rollout/engines")).json()["total_engines"] == 3


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"num_replicas": 1}, 400, "num_replicas"),  # below the initial engines
        ({"num_replicas": 2, "force": "true"}, 422, "force"),
        ({"num_replicas": 2, "dry_run": 1}, 422, "dry_run"),
        ({"num_replicas": 2, "drain": True}, 422, "drain"),
        ({"engine_urls": ["http://127.0.0.1:30000"]}, 400, "engine_urls"),  # an initial engine
        ({"engine_urls": ["http://10.9.9.9:30000"]}, 400, "engine_urls"),  # not attached
        ({"model_name": "llama", "num_replicas": 2}, 404, "model_name"),
    ],
)
async def test_scale_in_errors(client, backend, body, status, field):
    r = await client.post("/rollout/scale_in", json=body)
    assert r.status_code == status, r.text
    assert r.json()["field"] == field and field in r.json()["detail"]
    assert len(backend.registry) == 0


async def test_scale_in_to_current_count_is_noop(client):
    r = await client.post("/rollout/scale_in", json={"num_replicas": 2})
    assert r.status_code == 200 and r.json()["status"] == "NOOP"


# -- lookups ----------------------------------------------------------------------------------------


async def test_request_lookups_and_filters(client, backend):
    await _scale_out_to(client, backend, 3)
    assert (await client.get("/rollout/scale_out/so-999")).status_code == 404
    wrong_direction = await client.get("/rollout/scale_in/so-1")
    assert wrong_direction.status_code == 404 and "scale_in" in wrong_direction.json()["detail"]
    bad_status = await client.get("/rollout/scale_out?status=DONE")
    assert bad_status.status_code == 400 and bad_status.json()["field"] == "status"
    assert (await client.get("/rollout/scale_in?status=DRAINING")).json() == []
    assert (await client.get("/rollout/scale_in?model_name=llama")).status_code == 404


# -- events -----------------------------------------------------------------------------------------


async def test_events_newest_first_with_limit_and_kind(client, backend):
    await _scale_out_to(client, backend, 3)
    body = (await client.get("/rollout/events")).json()
    seqs = [e["seq"] for e in body["events"]]
    assert seqs == sorted(seqs, reverse=True) and body["total"] == len(seqs) and body["dropped"] == 0
    assert body["events"][0]["kind"] == "scale_completed" and body["events"][0]["request_id"] == "so-1"

    two = (await client.get("/rollout/events?limit=2")).json()["events"]
    assert [e["seq"] for e in two] == seqs[:2]
    asked = (await client.get("/rollout/events?kind=scale_out_requested")).json()["events"]
    assert [e["request_id"] for e in asked] == ["so-1"]


@pytest.mark.parametrize(
    ("query", "field", "words"),
    [("limit=0", "limit", "greater than or equal to 1"), ("limit=-5", "limit", "greater than or equal to 1"),
     ("limit=ten", "limit", "integer"), ("limit=100000", "limit", "less than or equal"),
     ("kind=nonsense", "kind", "scale_out_requested")],
)
async def test_events_bad_queries_are_422(client, query, field, words):
    r = await client.get(f"/rollout/events?{query}")
    assert r.status_code == 422
    assert r.json()["field"] == field and words in r.json()["detail"]


# -- metrics ----------------------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_parse_with_prometheus_parser(client, backend):
    await _scale_out_to(client, backend, 3)
    backend.training.update(training_step=7, num_rollout=60, rollout_tokens_per_s=123.5, staleness_mean=0.4,
                            trainer_wait_fraction=0.25, staleness_blocked_fraction=0.1)
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    assert samples[("relax_engines", (("state", "ACTIVE"),))] == 3
    assert samples[("relax_engines", (("state", "FAILED"),))] == 0  # every state present, zero included
    assert samples[("relax_training_step", ())] == 7
    assert samples[("relax_num_rollout", ())] == 60
    assert samples[("relax_rollout_tokens_per_second", ())] == 123.5
    assert samples[("relax_staleness_mean", ())] == 0.4
    assert samples[("relax_engine_weight_version", ())] == 0
    assert samples[("relax_trainer_wait_fraction", ())] == 0.25
    assert samples[("relax_staleness_blocked_fraction", ())] == 0.1
    assert samples[("relax_scale_events_total", (("kind", "scale_out_requested"),))] == 1
    assert samples[("relax_scale_events_total", (("kind", "scale_completed"),))] == 1
    families = {f.name: f.type for f in text_string_to_metric_families(r.text)}
    assert families["relax_scale_events"] == "counter" and families["relax_engines"] == "gauge"


def test_render_metrics_skips_missing_and_non_numeric_values():
    text = render_metrics(
        {"engines_by_state": {"ACTIVE": 1, "ZOMBIE": 2}, "training_step": None, "staleness_mean": "n/a",
         "tokens_generated": 5000, "scale_events_total": {}, "buffer_waiting_partitions": 2, "initial_engines": 4}
    ).decode()
    samples = _samples(text)
    assert samples[("relax_buffer_waiting_partitions", ())] == 2 and samples[("relax_initial_engines", ())] == 4
    assert samples[("relax_engines", (("state", "ZOMBIE"),))] == 2  # an unknown state is shown, not dropped
    assert samples[("relax_rollout_tokens_total", ())] == 5000
    assert not any(name in ("relax_training_step", "relax_staleness_mean") for name, _ in samples)
    checks = _samples(render_metrics({"weight_verifications": {"verified": 7, "mismatch": 1}}).decode())
    assert checks[("relax_weight_verifications_total", (("result", "mismatch"),))] == 1
    assert checks[("relax_weight_verifications_total", (("result", "verified"),))] == 7


async def test_metrics_is_503_when_the_backend_cannot_answer():
    class Down(LocalRollout):
        async def relax_status(self):
            raise ManagerUnavailable("the rollout manager is unavailable")

    async with _client(create_app(Down(), token=None)) as c:
        r = await c.get("/metrics")
    assert r.status_code == 503 and "unavailable" in r.text


async def test_a_scrape_flood_costs_the_manager_one_call_per_snapshot():
    class Counting(LocalRollout):
        calls = 0

        async def relax_status(self):
            Counting.calls += 1
            await asyncio.sleep(0.05)  # the Ray round trip: every scraper arrives while it runs
            return await super().relax_status()

    backend = Counting(initial_engines=2)
    try:
        async with _client(create_app(backend, token=None)) as c:
            answers = await asyncio.gather(*(c.get("/metrics") for _ in range(32)))
            assert {r.status_code for r in answers} == {200} and len({r.text for r in answers}) == 1
            assert Counting.calls == 1
            await c.get("/metrics")  # within the snapshot's second: served from it
            assert Counting.calls == 1
    finally:
        await backend.aclose()


# -- auth -------------------------------------------------------------------------------------------


async def test_token_guards_every_route_but_health_and_metrics(backend):
    app = create_app(backend, token=TOKEN)
    async with _client(app) as anonymous:
        assert (await anonymous.get("/health")).json() == {"status": "ok"}
        assert (await anonymous.get("/metrics")).status_code == 200  # Prometheus scrapes without the secret
        for method, path in (("GET", "/rollout/engines"), ("POST", "/rollout/scale_out"), ("GET", "/autoscaler/x"),
                             ("GET", "/rollout/events"), ("GET", "/openapi.json"), ("GET", "/docs")):
            r = await anonymous.request(method, path)
            assert r.status_code == 401, (method, path)
            assert "RELAX_API_TOKEN" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    async with _client(app, token="wrong") as wrong:
        r = await wrong.get("/rollout/engines")
        assert r.status_code == 401 and "invalid token" in r.json()["detail"]
    async with _client(app) as basic:
        r = await basic.get("/rollout/engines", headers={"Authorization": f"Basic {TOKEN}"})
        assert r.status_code == 401 and "Bearer" in r.json()["detail"]
    async with _client(app, token=TOKEN) as good:
        assert (await good.get("/rollout/engines")).status_code == 200
        assert (await good.get("/health")).status_code == 200
        assert (await good.post("/rollout/scale_out", json={"num_replicas": "x"})).status_code == 422
    assert len(backend.registry) == 0


async def test_no_token_means_no_auth(client):
    assert (await client.get("/rollout/engines")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


# -- openapi ----------------------------------------------------------------------------------------


async def test_openapi_describes_every_route_and_body(backend):
    async with _client(create_app(backend, token=TOKEN), token=TOKEN) as c:
        schema = (await c.get("/openapi.json")).json()
    paths = schema["paths"]
    expected = {
        "/rollout/engines": {"get"},
        "/rollout/scale_out": {"get", "post"},
        "/rollout/scale_out/{request_id}": {"get"},
        "/rollout/scale_out/{request_id}/cancel": {"post"},
        "/rollout/scale_out_cancel": {"post"},
        "/rollout/scale_in": {"get", "post"},
        "/rollout/scale_in/{request_id}": {"get"},
        "/rollout/events": {"get"},
        "/health": {"get"},
        "/metrics": {"get"},
    }
    for path, methods in expected.items():
        assert methods <= set(paths[path]), path
    components = schema["components"]["schemas"]
    for model in ("ScaleOutBody", "ScaleInBody", "CancelBatchBody", "EnginesResponse", "ErrorResponse",
                  "ScaleOutRequestView", "ScaleInDryRun"):
        assert model in components, model
    body_ref = paths["/rollout/scale_out"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/ScaleOutBody")
    assert components["ScaleOutBody"]["additionalProperties"] is False
    assert "409" in paths["/rollout/scale_out"]["post"]["responses"]
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert paths["/health"]["get"]["security"] == []


# -- backend answers and the autoscaler mount -------------------------------------------------------------


async def test_backend_failures_become_json_answers(backend):
    class Broken(LocalRollout):
        async def engines_view(self, model_name):
            return {"engines": object()}  # not JSON-able: a bug behind the backend

        async def get_scale_request(self, direction, request_id):
            raise UnknownRequest(request_id, direction)  # a domain error is answered with its status

        async def events(self, limit, kind):
            raise RuntimeError("boom")

    async with _client(create_app(Broken(), token=None)) as c:
        malformed = await c.get("/rollout/engines")
        assert malformed.status_code == 500 and "TypeError" in malformed.json()["detail"]
        raised = await c.get("/rollout/scale_out/so-3")
        assert raised.status_code == 404 and "so-3" in raised.json()["detail"]
        crashed = await c.get("/rollout/events")
        assert crashed.status_code == 500 and "RuntimeError: boom" in crashed.json()["detail"]


def test_status_of_maps_every_error_type_in_one_place():
    assert status_of(UnknownModel("x")) == 404
    assert status_of(UnknownRequest("so-1", "scale_out")) == 404
    assert status_of(ScaleConflict("so-1", "CREATING", "scale_out")) == 409
    assert status_of(NotCancellable("so-1", "ACTIVE")) == 400
    assert status_of(RejectedRequest("no", field="num_replicas")) == 400
    assert status_of(ManagerUnavailable("down")) == 503
    assert status_of(ManagerTimeout("slow")) == 504
    assert status_of(ManagerInternalError("bug")) == 500
    assert status_of(RuntimeError("unexpected")) is None


def test_create_app_rejects_a_backend_missing_methods_and_a_bad_autoscaler(backend):
    with pytest.raises(TypeError, match="relax_status"):
        create_app(object(), token=None)
    with pytest.raises(TypeError, match="APIRouter"):
        create_app(backend, token=None, autoscaler=object())


async def test_autoscaler_router_is_mounted_and_guarded(backend):
    router = APIRouter()

    @router.get("/status")
    async def status() -> dict[str, bool]:
        return {"enabled": True}

    class Autoscaler:
        def __init__(self) -> None:
            self.router = router

    for autoscaler in (router, Autoscaler()):
        app = create_app(backend, token=TOKEN, autoscaler=autoscaler)
        async with _client(app) as anonymous:
            assert (await anonymous.get("/autoscaler/status")).status_code == 401
        async with _client(app, token=TOKEN) as c:
            assert (await c.get("/autoscaler/status")).json() == {"enabled": True}
    without = create_app(backend, token=None)
    async with _client(without) as c:
        assert (await c.get("/autoscaler/status")).status_code == 404


# -- the server and the Ray adapter -------------------------------------------------------------------


async def test_control_plane_serves_on_a_real_socket_and_stops(backend):
    plane = ControlPlane(backend, "127.0.0.1", 0, TOKEN)
    url = await plane.start()
    try:
        assert url.startswith("http://127.0.0.1:") and await plane.start() == url and await plane.url() == url
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert (await c.get("/health")).json() == {"status": "ok"}
            assert (await c.get("/rollout/engines")).json()["active_engines"] == 2

        port = int(url.rsplit(":", 1)[1])
        busy = ControlPlane(backend, "127.0.0.1", port, None)
        with pytest.raises(RuntimeError, match="--api-port"):
            await busy.start()
    finally:
        await plane.stop()
    assert await plane.url() is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self._fn(*args))


class _FakeHandle:
    """Enough of a Ray actor handle for RayBackend: ``handle.<method>.remote(...)`` returns an awaitable."""

    def __init__(self, **methods):
        for name, fn in methods.items():
            setattr(self, name, _Method(fn))


async def test_manager_client_maps_what_can_go_wrong_between_processes():
    from ray.exceptions import RayActorError, RayTaskError

    async def ok(model_name):
        return {"model": model_name}

    async def dead(*_):
        raise RayActorError(error_msg="The actor died unexpectedly")

    async def rule(direction, request_id):
        raise RayTaskError("get_scale_request", "Traceback...", UnknownRequest(request_id, direction))

    async def bug(*_):
        raise RayTaskError("events", "Traceback...", KeyError("x"))

    async def slow():
        await asyncio.sleep(5)

    handle = _FakeHandle(engines_view=ok, scale_in=dead, get_scale_request=rule, events=bug, relax_status=slow)
    client = ManagerClient(handle, call_timeout_s=0.2)
    assert await client.engines_view("default") == {"model": "default"}
    with pytest.raises(ManagerUnavailable, match="died unexpectedly"):
        await client.scale_in(None)
    with pytest.raises(UnknownRequest, match="so-7"):  # the domain error itself, not a wrapper
        await client.get_scale_request("scale_out", "so-7")
    with pytest.raises(ManagerInternalError, match="internal error in events: KeyError"):
        await client.events(10, None)
    with pytest.raises(ManagerTimeout, match="relax_status within 0.2s"):
        await client.relax_status()

    # ... and the routes answer each with its status code
    async with _client(create_app(client, token=None)) as c:
        assert (await c.get("/rollout/engines")).json() == {"model": None}
        assert (await c.post("/rollout/scale_in", json={"num_replicas": 2})).status_code == 503
        not_found = await c.get("/rollout/scale_out/so-7")
        assert not_found.status_code == 404 and "so-7" in not_found.json()["detail"]
        assert (await c.get("/rollout/events")).status_code == 500
        assert (await c.get("/metrics")).status_code == 503


# -- weight verification --------------------------------------------------------------------------------


async def test_verify_checks_an_active_engine_and_refuses_unknown_or_inactive_ones_clearly() -> None:
    asked: list[str] = []

    async def verify(engine_id: str) -> dict[str, Any]:
        asked.append(engine_id)
        return {"engine_id": engine_id, "version": 3, "result": "verified", "expected_digest": "ab" * 32,
                "served_digest": "ab" * 32, "mismatched": [], "seconds": 0.2, "attempt": 0}

    backend = LocalRollout(initial_engines=2, verify=verify)
    try:
        async with _client(create_app(backend, token=TOKEN), TOKEN) as c:
            r = await c.post("/rollout/engines/engine_1/verify")
            assert r.status_code == 200 and r.json()["result"] == "verified" and asked == ["engine_1"]
            r = await c.post("/rollout/engines/engine_9/verify")
            assert r.status_code == 404 and "unknown engine id 'engine_9'" in r.json()["detail"]
            backend.pool.transition("engine_1", EngineState.DRAINING)
            r = await c.post("/rollout/engines/engine_1/verify")
            assert r.status_code == 400 and "engine_1 is DRAINING" in r.json()["detail"]
            async with _client(create_app(backend, token=TOKEN)) as anonymous:
                assert (await anonymous.post("/rollout/engines/engine_0/verify")).status_code == 401
            assert asked == ["engine_1"]  # refusals reach no engine
    finally:
        await backend.aclose()
    async with _client(create_app(LocalRollout(initial_engines=1), token=None)) as c:  # no weights to check
        r = await c.post("/rollout/engines/engine_0/verify")
        assert r.status_code == 400 and "no weight publications" in r.json()["detail"]
