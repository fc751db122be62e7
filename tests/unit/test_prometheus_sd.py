"""``GET /rollout/prometheus_sd``: Prometheus HTTP service discovery of the ACTIVE engines.

The mapping (engines view -> http_sd groups) is pure and tested on hand-made views; the route runs over
``httpx.ASGITransport`` against :class:`LocalRollout` (the real pool and scale executor, simulated engines),
where the answer must follow a scale-out and a scale-in.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from relax.rollout.control.api import create_app
from relax.rollout.control.prometheus_sd import sd_groups, sd_target

TOKEN = "sd-token"


def _engine(engine_id: str, url: str | None, status: str = "ACTIVE", kind: str = "initial",
            node_id: str | None = "node-a") -> dict[str, Any]:
    return {"engine_id": engine_id, "url": url, "status": status, "kind": kind, "node_id": node_id,
            "weight_version": 0, "in_flight": 0}


def _view(*engines: dict[str, Any], model: str = "default") -> dict[str, Any]:
    return {"models": {model: {"engines": list(engines)}}, "total_engines": len(engines), "active_engines": 0}


# -- the pure mapping -------------------------------------------------------------------------------------


def test_one_group_per_active_engine_with_its_labels():
    view = _view(_engine("engine_0", "http://10.0.0.5:30000"),
                 _engine("engine_3", "https://gpu-7.example:31000", kind="elastic", node_id="n7"),
                 model="qwen")
    assert sd_groups(view) == [
        {"targets": ["10.0.0.5:30000"],
         "labels": {"engine_id": "engine_0", "kind": "initial", "node": "node-a", "model": "qwen",
                    "__metrics_path__": "/metrics", "__scheme__": "http"}},
        {"targets": ["gpu-7.example:31000"],
         "labels": {"engine_id": "engine_3", "kind": "elastic", "node": "n7", "model": "qwen",
                    "__metrics_path__": "/metrics", "__scheme__": "https"}},
    ]


@pytest.mark.parametrize("status", ["PENDING", "STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "DRAINING",
                                    "REMOVED", "FAILED"])
def test_engines_not_active_are_not_targets(status):
    assert sd_groups(_view(_engine("engine_1", "http://10.0.0.5:30001", status=status))) == []


def test_engines_without_a_scrapable_address_are_left_out():
    view = _view(_engine("a", None), _engine("b", ""), _engine("c", "http://host-without-port"),
                 _engine("d", "not a url"), _engine("e", "http://[::1]:30000", node_id=None))
    assert sd_groups(view) == [
        {"targets": ["[::1]:30000"],
         "labels": {"engine_id": "e", "kind": "initial", "node": "", "model": "default",
                    "__metrics_path__": "/metrics", "__scheme__": "http"}},
    ]


def test_empty_or_odd_views_give_an_empty_list():
    assert sd_groups({}) == []
    assert sd_groups({"models": {}}) == []
    assert sd_groups({"models": {"default": {}}}) == []
    assert sd_groups({"models": {"default": None}}) == []


def test_sd_target():
    assert sd_target("http://127.0.0.1:30000") == ("http", "127.0.0.1:30000")
    assert sd_target("http://127.0.0.1:99999") is None  # invalid port
    assert sd_target("ftp://h:21") is None


def test_labels_are_strings_as_http_sd_requires():
    groups = sd_groups(_view(_engine("engine_0", "http://h:1", node_id=None)))
    assert all(isinstance(v, str) for g in groups for v in g["labels"].values())
    assert all(isinstance(t, str) for g in groups for t in g["targets"])


# -- the route ----------------------------------------------------------------------------------------------


def _client(app: Any, token: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://relax", headers=headers)


def _targets(answer: list[dict[str, Any]]) -> dict[str, str]:
    return {g["labels"]["engine_id"]: g["targets"][0] for g in answer}


async def test_sd_follows_scale_out_and_scale_in(backend):
    async with _client(create_app(backend, token=TOKEN), TOKEN) as client:
        r = await client.get("/rollout/prometheus_sd")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert _targets(r.json()) == {"engine_0": "127.0.0.1:30000", "engine_1": "127.0.0.1:30001"}
        assert {g["labels"]["kind"] for g in r.json()} == {"initial"}

        r = await client.post("/rollout/scale_out", json={"num_replicas": 4})
        assert r.status_code == 200, r.text
        await backend.wait_idle()
        answer = (await client.get("/rollout/prometheus_sd")).json()
        assert _targets(answer) == {f"engine_{i}": f"127.0.0.1:{30000 + i}" for i in range(4)}
        elastic = [g["labels"] for g in answer if g["labels"]["kind"] == "elastic"]
        assert [(lab["engine_id"], lab["node"]) for lab in elastic] == [("engine_2", "node-elastic-2"),
                                                                         ("engine_3", "node-elastic-3")]

        r = await client.post("/rollout/scale_in", json={"num_replicas": 3})
        assert r.status_code == 200, r.text
        await backend.wait_idle()
        answer = (await client.get("/rollout/prometheus_sd")).json()
        assert _targets(answer) == {f"engine_{i}": f"127.0.0.1:{30000 + i}" for i in range(3)}


async def test_engines_being_added_are_not_listed_until_active(backend):
    async with _client(create_app(backend, token=None)) as client:
        backend.paused = True
        r = await client.post("/rollout/scale_out", json={"num_replicas": 3})
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.05)
        answer = (await client.get("/rollout/prometheus_sd")).json()
        assert set(_targets(answer)) == {"engine_0", "engine_1"}
        backend.paused = False
        await backend.wait_idle()
        assert set(_targets((await client.get("/rollout/prometheus_sd")).json())) == {
            "engine_0", "engine_1", "engine_2"}


async def test_sd_needs_the_token_metrics_does_not(backend):
    async with _client(create_app(backend, token=TOKEN)) as anonymous:
        r = await anonymous.get("/rollout/prometheus_sd")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert (await anonymous.get("/metrics")).status_code == 200


async def test_sd_answers_503_when_the_manager_is_unreachable(backend):
    from relax.rollout.control.manager_client import ManagerUnavailable

    async def unreachable(model_name: str | None = None) -> dict[str, Any]:
        raise ManagerUnavailable("rollout manager is gone")

    backend.engines_view = unreachable  # type: ignore[method-assign]
    async with _client(create_app(backend, token=None)) as client:
        r = await client.get("/rollout/prometheus_sd")
        assert r.status_code == 503 and "gone" in r.json()["detail"]


async def test_sd_is_in_the_openapi_schema(backend):
    async with _client(create_app(backend, token=TOKEN), TOKEN) as client:
        schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/rollout/prometheus_sd"]["get"]
    assert operation.get("security") != []  # behind the token, unlike /metrics
    assert "200" in operation["responses"]
