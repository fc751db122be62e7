"""Verified refits against the real SGLang 0.5.23: its own ``/weights_checker`` is what Relax compares.

The session's shared real server (``sglang_engine``) joins a fleet, receives version 1 by broadcast (bf16, in
SGLang's fused layout) and is verified against the trainer's checksums computed without a copy
(``relax.weights.digest``). Then its weights are changed behind Relax's back (``/update_weights_from_disk``
of the base checkpoint, keeping the version label it reports): the next check catches it, reloads version 1
while the engine is paused, and verifies it again. At the end the server gets the base checkpoint back as
version 0, as the other tests of the session expect it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from relax.config.verify_weights import VerifyPolicy
from relax.engines.keys import EngineKeys
from relax.rollout.assembly import build_fleet
from relax.rollout.pool.engines import EnginePool, EngineState
from relax.rollout.pool.events import EventLog
from relax.rollout.refit.broadcast import ThreadWeightSource
from relax.rollout.refit.rules import VerifyResult
from relax.rollout.routing.router import Router
from relax.rollout.settings import BroadcastSettings, FleetSettings
from relax.training.sender import WeightSender
from relax.weights.digest import sglang_checksums, version_digest
from relax.weights.publication import WeightRegistry
from tests.sglang.conftest import SHARED_ENGINE_SECRET
from tests.sglang.test_partial_refit import RealEngineLauncher

PROMPT = [1, 2, 3, 4, 5]

pytestmark = pytest.mark.timeout(900)


async def greedy(client) -> list[int]:
    out = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0.0},
                                timeout=120)
    return list(out["output_ids"])


async def test_the_real_engine_is_verified_and_weights_changed_behind_relax_are_caught_and_reloaded(
        tiny_preset, sglang_engine, sglang_keys: EngineKeys) -> None:
    server, keys = sglang_engine, sglang_keys
    base = load_file(str(tiny_preset.model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    new = {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in base.items()}
    expected = sglang_checksums(new, torch.bfloat16)  # the copying reference, as the engine lays the model out
    sender = WeightSender("127.0.0.1")
    pool = EnginePool(time.time)
    events = EventLog()
    fleet = build_fleet(pool, Router(), events, WeightRegistry(), RealEngineLauncher(server.url),
                        FleetSettings(engine_api_key=SHARED_ENGINE_SECRET, verify_weights=VerifyPolicy.FIRST,
                                      broadcast=BroadcastSettings(backend="gloo", timeout_s=60.0)))
    try:
        await fleet.start_initial([("group", 0)])
        manifest = sender.hold(1, new, dtype=torch.bfloat16, layout="sglang")
        assert sender.checksums(1) == expected  # the trainer's in-place hashing is SGLang's layout, to the tensor
        fleet.weight_sync.publish(1, [], manifest, source=ThreadWeightSource(sender))
        await asyncio.wait_for(fleet.settle_weights(), 300)
        record = pool.get("engine_0")
        assert (record.state, record.weight_version, record.weights_verified) == (EngineState.ACTIVE, 1, True)
        assert record.weight_digest == version_digest(expected)  # SGLang's per_gpu_checksum, as it answered
        client = fleet.client("engine_0")
        reference = await greedy(client)

        await client.update_weights_from_disk(str(tiny_preset.model_dir), "1")  # behind Relax's back
        assert await client.get_weight_version() == "1" and await greedy(client) != reference

        outcome = await fleet.verify_engine("engine_0")
        assert outcome.result is VerifyResult.VERIFIED and outcome.attempt == 1
        (mismatch,) = events.newest(kind="weights_mismatch")
        assert mismatch.engine_ids == ("engine_0",) and mismatch.details["attempt"] == 0
        assert len(mismatch.details["mismatched"]) > 1  # every layer of the base checkpoint differs
        async with httpx.AsyncClient(base_url=server.url, timeout=120, trust_env=False) as http:
            answer = await http.post("/weights_checker", json={"action": "checksum"},
                                     headers={"Authorization": f"Bearer {keys.admin}"})
        assert answer.json()["ranks"][0]["checksums"] == expected
        assert answer.json()["ranks"][0]["per_gpu_checksum"] == version_digest(expected)
        assert await greedy(client) == reference and pool.get("engine_0").state is EngineState.ACTIVE
        assert fleet.weight_sync.verifications == {"verified": 2, "mismatch": 1, "uncheckable": 0}
    finally:
        await fleet.shutdown()  # leaves its weight group on the server
        sender.shutdown()
        async with httpx.AsyncClient(base_url=server.url, timeout=300, trust_env=False) as http:
            restored = await http.post("/update_weights_from_disk", json={
                "model_path": str(tiny_preset.model_dir), "weight_version": "0"},
                headers={"Authorization": f"Bearer {keys.admin}"})
        assert restored.status_code == 200, restored.text  # the shared server as the session found it
