"""A refit cut short never leaves the real SGLang serving: the sender dies part-way through a session.

Against SGLang a session that does not carry the whole model leaves it with weights that are neither version
(on AMX machines every linear layer is re-packed at the end of any session, loaded or not, and the engine still
answers ``success: true``). So a session that fails part-way must not end in an ACTIVE engine: the fleet fails
it (and replaces it). Here the real fleet and weight path drive a real SGLang server; the trainer's side of the
broadcast dies after the first bucket.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

from relax.engines.keys import engine_keys
from relax.rollout.assembly import build_fleet
from relax.rollout.pool.engines import EnginePool, EngineState
from relax.rollout.pool.events import EventLog
from relax.rollout.pool.launcher import EngineSlot
from relax.rollout.refit.broadcast import ThreadWeightSource
from relax.rollout.routing.router import Router
from relax.rollout.settings import BroadcastSettings, FleetSettings
from relax.training.sender import WeightSender
from relax.weights.digest import checksum_mismatches, sglang_checksums
from relax.weights.publication import WeightRegistry
from tests.sglang.conftest import start_sglang

SECRET = "partial-refit-secret"


class DyingSource(ThreadWeightSource):
    """The trainer's side of the group, dying (its group gone) once the first bucket of a version is sent."""

    async def broadcast(self, name: str, version: int, index: int) -> int:
        if index >= 1:
            self.sender.close(name)
            raise ConnectionError("trainer rank 0 died mid-session")
        return await super().broadcast(name, version, index)


class RealEngineLauncher:
    """The fleet's launcher port around one real SGLang server the test owns; a replacement cannot start."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ids: list[str] = []
        self.stopped: list[str] = []

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None) -> dict[str, Any]:
        if self.ids or self.stopped:
            raise RuntimeError("no replacement in this test")
        self.ids.append(engine_id)
        return {"url": self.url, "node_id": "n", "weight_version": 0}

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool | None:
        return engine_id in self.ids

    async def stop(self, engine_id: str, grace_s: float) -> None:
        if engine_id in self.ids:
            self.ids.remove(engine_id)
            self.stopped.append(engine_id)

    def release(self, slot: EngineSlot) -> None:
        return None

    def engine_ids(self) -> list[str]:
        return list(self.ids)


async def test_a_session_cut_short_fails_the_engine_instead_of_serving_it(tiny_preset, tmp_path: Path) -> None:
    keys = engine_keys(SECRET, "engine_0")
    server, prepared = start_sglang(tiny_preset.model_dir, tmp_path, name="engine_0", keys=keys)
    base = load_file(str(tiny_preset.model_dir / "model.safetensors"))
    new = {name: t + 0.01 for name, t in base.items()}
    sender = WeightSender("127.0.0.1")
    pool = EnginePool(time.time)
    states: list[EngineState] = []
    fleet = build_fleet(pool, Router(), EventLog(), WeightRegistry(), RealEngineLauncher(server.url),
                        FleetSettings(engine_api_key=SECRET, broadcast=BroadcastSettings(backend="gloo",
                                                                                          timeout_s=10.0)),
                        on_change=lambda: states.append(pool.get("engine_0").state))
    try:
        await fleet.start_initial([("group", 0)])
        assert pool.get("engine_0").state is EngineState.ACTIVE
        manifest = sender.hold(1, new, dtype=torch.bfloat16, bucket_bytes=16 * 1024)
        assert len(manifest.bucket_sizes) > 2
        fleet.weight_sync.publish(1, [], manifest, source=DyingSource(sender))
        began = time.monotonic()
        await asyncio.wait_for(fleet.settle_weights(), 60)
        for _ in range(200):  # the failure is handed to the fleet; wait for its verdict
            if pool.get("engine_0").state is EngineState.FAILED:
                break
            await asyncio.sleep(0.05)
        assert pool.get("engine_0").state is EngineState.FAILED, pool.get("engine_0")
        assert time.monotonic() - began < 60
        assert "engine_0" not in fleet.router.routable()  # never routed again
        after_failure = states[states.index(EngineState.FAILED):] if EngineState.FAILED in states else []
        assert EngineState.ACTIVE not in after_failure
        # why it must not serve: what the engine holds now is neither version (read through SGLang's checker)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
            answer = await http.post("/weights_checker", json={"action": "checksum"},
                                     headers={"Authorization": f"Bearer {keys.admin}"})
            if answer.status_code == 200:
                served = answer.json()["ranks"][0]["checksums"]
                assert checksum_mismatches(sglang_checksums(new, torch.bfloat16), served)
    finally:
        await fleet.shutdown()
        sender.shutdown()
        server.stop()
        prepared.release()  # type: ignore[attr-defined]
