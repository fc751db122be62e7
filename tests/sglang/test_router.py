"""The real ``sglang-router`` in front of the real SGLang: Relax registers an engine with its generation key only,
generation flows through the router, and the router cannot pause the engine or touch its weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from relax.engines.keys import EngineKeys
from relax.rollout.routing.router_mirror import SGLangRouterMirror, canonical_url
from tests.integration.test_sglang_router_mirror import RouterProcess


def test_the_router_follows_the_real_engine_and_holds_only_its_generation_key(sglang_engine, sglang_keys: EngineKeys,
                                                                              tmp_path: Path) -> None:
    router = RouterProcess(tmp_path / "router.log")

    async def scenario() -> None:
        mirror = SGLangRouterMirror(router.url)
        try:
            mirror.add("engine_0", sglang_engine.url, sglang_keys.generation)  # what EngineFleet hands the router
            assert await mirror.synced(30), mirror.status()
            assert router.urls() == {canonical_url(sglang_engine.url)}
            async with httpx.AsyncClient(base_url=router.url, timeout=60, trust_env=False) as http:
                out = await http.post("/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 4}})
                assert out.status_code == 200, out.text
                assert out.json()["meta_info"]["completion_tokens"] >= 1  # the real engine answered via the router
            # what the router holds opens generation only: SGLang refuses it on its control routes
            async with httpx.AsyncClient(base_url=sglang_engine.url, timeout=30, trust_env=False) as http:
                paused = await http.post("/pause_generation", json={"mode": "abort"},
                                         headers={"Authorization": f"Bearer {sglang_keys.generation}"})
                assert paused.status_code == 401
            mirror.remove("engine_0")
            assert await mirror.synced(30), mirror.status()
            assert router.urls() == set()
        finally:
            await mirror.aclose(deregister=True)

    try:
        asyncio.run(scenario())
    finally:
        router.stop()
