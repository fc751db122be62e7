"""Engines need a secret: a built-in engine started with a key refuses every call without it (401) and changes
nothing; ``/health`` and ``/metrics`` stay open, as on SGLang with ``--api-key``. Callers without the key are
answered at a bounded pace (relax.pace)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from relax.pace import BURST, RATE_PER_S

KEY = "engine-secret-for-the-test"
OPEN = {("GET", "/health"), ("GET", "/health_generate"), ("GET", "/metrics")}
# A body each control route would act on if it let the caller in: pausing, loading, aborting, flushing.
BODIES = {
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
    "/pause_generation": {"mode": "abort"},
    "/update_weights_from_disk": {"model_path": "/tmp", "weight_version": "666"},
    "/abort_request": {"abort_all": True},
    "/update_weight_version": {"new_version": "666"},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "group_name": "intruder", "backend": "gloo"},
    "/begin_weight_update": {"weight_version": "666"},
}
BAD_HEADERS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
               {"Authorization": KEY}, {"Authorization": "Bearer"}, {"authorization": f"bearer{KEY}"}]


@pytest.fixture(scope="module")
def engine(tiny_preset, start_engine):
    return start_engine(tiny_preset.model_dir, env={"RELAX_ENGINE_API_KEY": KEY})


def _routes(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=10,
                     trust_env=False).json()
    return sorted((method.upper(), path) for path, item in spec["paths"].items() for method in item)


def test_every_route_but_health_and_metrics_refuses_a_missing_or_wrong_key_and_changes_nothing(engine) -> None:
    url, good = engine.url, {"Authorization": f"Bearer {KEY}"}
    routes = _routes(url)
    assert ("POST", "/update_weights_from_disk") in routes and ("POST", "/pause_generation") in routes
    before = httpx.get(f"{url}/model_info", headers=good, timeout=10, trust_env=False).json()
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        for method, path in routes:
            for headers in BAD_HEADERS:
                answer = http.request(method, path, json=BODIES.get(path, {}), headers=headers)
                if (method, path) in OPEN:
                    assert answer.status_code == 200, (method, path, answer.text)
                else:
                    assert answer.status_code == 401, (method, path, headers, answer.status_code, answer.text)
                    assert "API key" in answer.json()["error"]["message"]
        for path in ("/openapi.json", "/docs"):  # the route list itself is not handed out either
            assert http.get(path).status_code == 401
        # nothing changed: same weights and version, not paused, no weight group joined, still serving
        after = http.get("/model_info", headers=good).json()
        assert after["weight_version"] == before["weight_version"]
        info = http.get("/server_info", headers=good).json()
        assert info["weight_update_groups"] == [] and not info.get("paused")
        out = http.post("/generate", headers=good, json=BODIES["/generate"])
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4


ADMIN = "engine-admin-key-for-the-test"
CONTROL = ["/pause_generation", "/update_weights_from_disk", "/abort_request", "/update_weight_version",
           "/init_weights_update_group", "/begin_weight_update"]


@pytest.fixture(scope="module")
def two_key_engine(tiny_preset, start_engine):
    return start_engine(tiny_preset.model_dir, env={"RELAX_ENGINE_API_KEY": KEY, "RELAX_ENGINE_ADMIN_API_KEY": ADMIN})


def test_with_an_admin_key_the_generation_key_cannot_control_and_the_admin_key_cannot_generate(
        two_key_engine) -> None:
    """SGLang's --admin-api-key split, on the built-in engine (tests/sglang: the same on the real SGLang)."""
    gen, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=two_key_engine.url, timeout=30, trust_env=False) as http:
        for path in CONTROL:
            answer = http.post(path, json=BODIES[path], headers=gen)
            assert answer.status_code == 401 and "admin key" in answer.json()["error"]["message"], (path, answer.text)
        assert http.post("/generate", json=BODIES["/generate"], headers=admin).status_code == 401
        assert http.post("/pause_generation", json={"mode": "abort"}, headers=admin).status_code == 200
        assert http.post("/continue_generation", json={}, headers=admin).status_code == 200
        info = http.get("/server_info", headers=gen).json()
        assert info["weight_update_groups"] == [] and not info.get("paused")
        out = http.post("/generate", json=BODIES["/generate"], headers=gen)
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4


async def test_a_flood_without_the_key_is_answered_at_the_pace_and_keyed_callers_skip_it(engine) -> None:
    """60 requests without the key at once, probes and a guarded route (its 401s cost as much as an answer):
    BURST answered at once, the rest at RATE_PER_S (so the flood takes at least (60 - BURST) / RATE_PER_S
    seconds, whatever the machine); callers with the engine's key take no turn."""
    flood = 60
    good = {"Authorization": f"Bearer {KEY}"}
    paths = ["/health", "/metrics", "/health_generate", "/model_info"] * (flood // 4)
    async with httpx.AsyncClient(base_url=engine.url, timeout=30, trust_env=False,
                                 limits=httpx.Limits(max_connections=flood + 20)) as http:
        before = (await http.get("/server_info", headers=good)).json()
        start = time.monotonic()
        anonymous = [asyncio.ensure_future(http.get(path)) for path in paths]
        keyed = [asyncio.ensure_future(http.get(path, headers=good)) for path in ["/health", "/model_info"] * 5]
        answers = await asyncio.gather(*anonymous)
        expected = [401 if path == "/model_info" else 200 for path in paths]  # a guarded route: paced 401s
        assert [a.status_code for a in answers] == expected
        assert {a.status_code for a in await asyncio.gather(*keyed)} == {200}
        elapsed = time.monotonic() - start
        after = (await http.get("/server_info", headers=good)).json()
    assert after["anonymous_answered"] - before["anonymous_answered"] == flood  # the keyed calls took no turn
    assert after["anonymous_refused"] == before["anonymous_refused"]  # nobody waited past the longest wait
    assert elapsed >= (flood - BURST) / RATE_PER_S
