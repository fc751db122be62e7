"""The whole rollout built without Ray (``rollout.assembly.build_rollout``): fake launcher, clients and transport.

What the Ray actor does in a run, in milliseconds: initial engines come up, the generation loop fills a step's
partition through the dispatcher, a publication reaches every engine, and an engine whose process dies
mid-generation is failed while its requests finish on the other one.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax.rollout.assembly import Rollout, build_rollout
from relax.rollout.control.metrics import render_metrics
from relax.rollout.pool.engines import EngineState
from relax.rollout.refit.transport import TransportKind
from relax.rollout.settings import DataSettings, DispatchSettings, FleetSettings, RolloutSettings, SamplingSettings
from relax.weights.publication import WeightManifest
from tests.unit.fake_engines import Client, Launcher, Tokenizer, Transport


def build(tmp_path: Path, **data: Any) -> tuple[Rollout, Launcher, dict[str, Client], Transport]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "label": "abc"}) + "\n" for i in range(4)))
    settings = RolloutSettings(
        data=DataSettings(prompt_data=str(prompts), num_rollout=3, rollout_batch_size=2,
                          sampling=SamplingSettings(n_samples=2, max_new_tokens=3),
                          **{"max_staleness": 0, **data}),
        fleet=FleetSettings(model_path=str(tmp_path)),
        dispatch=DispatchSettings(stream=False),
    )
    launcher, clients, transport = Launcher(), {}, Transport()

    def client_factory(url: str, timeout_s: float, keys: Any) -> Client:
        engine_id = url.removeprefix("http://")
        clients[engine_id] = Client(engine_id, launcher)
        return clients[engine_id]

    rollout = build_rollout(settings, launcher, Tokenizer(), client_factory=client_factory,
                            transports={kind: transport for kind in TransportKind})
    return rollout, launcher, clients, transport


async def publish(rollout: Rollout, version: int) -> None:
    rollout.weight_sync.publish(version, ["bucket"], WeightManifest(version, ("w",), ((4,),), ("float32",), 16, (1,)))
    await rollout.weight_sync.settle()
    assert {r.weight_version for r in rollout.pool.active()} == {version}


@pytest.mark.timeout(20)
async def test_the_rollout_generates_publishes_and_survives_a_dead_engine_without_ray(tmp_path: Path) -> None:
    rollout, launcher, clients, transport = build(tmp_path)
    try:
        engines = await rollout.fleet.start_initial([(None, 0), (None, 1)])
        assert [e["status"] for e in engines] == ["ACTIVE", "ACTIVE"]

        rollout.loop.start()
        first = await rollout.loop.take(0, timeout=5)
        assert len(first.samples) == 4 and first.metrics["rollout/samples"] == 4.0
        assert {(s.prompt_index, s.sample_index) for s in first.samples} == {(p, i) for p in (0, 1) for i in (0, 1)}

        victim = clients["engine_0"]  # step 1's requests on it are held mid-generation, then its process dies
        victim.hold = asyncio.Event()
        await publish(rollout, 1)  # on-policy (--max-staleness 0): step 1 starts once every engine holds v1
        assert sorted(transport.sent) == [("engine_0", 1), ("engine_1", 1)]
        await asyncio.wait_for(victim.holding.wait(), 5)
        launcher.dead.add("engine_0")
        victim.hold.set()
        later = [await rollout.loop.take(1, timeout=5)]
        await publish(rollout, 2)
        later.append(await rollout.loop.take(2, timeout=5))
        assert rollout.pool.get("engine_0").state is EngineState.FAILED
        assert [len(p.samples) for p in later] == [4, 4]  # nothing lost: the held requests ran elsewhere
        assert all(s.engine_id != "engine_0" for p in later for s in p.samples)
        assert all(rollout.router.in_flight(r.engine_id) == 0 for r in rollout.pool.records())

        status = rollout.run_status({"step": 2, "staleness_mean": 0.5}).to_dict()  # one shape for every reader
        assert (status["training_step"], status["num_rollout"], status["latest_published"]) == (2, 3, 2)
        assert status["buffer_waiting_partitions"] == 0 and status["tokens_generated"] == 36
        assert status["migration"]["migrated_requests"] == 0  # a request that died before any token starts anew
        families = {f.name: f for f in text_string_to_metric_families(render_metrics(status).decode())}
        assert families["relax_training_step"].samples[0].value == 2
        assert families["relax_migrated_requests"].samples[0].value == 0
    finally:
        await rollout.aclose()


@pytest.mark.timeout(20)
async def test_a_group_an_engine_refuses_is_dropped_and_counted_and_the_step_trains_on_the_rest(
        tmp_path: Path) -> None:
    rollout, launcher, clients, transport = build(tmp_path, max_staleness=3)
    try:
        await rollout.fleet.start_initial([(None, 0), (None, 1)])
        bad = tuple(ord(c) for c in "q1")  # the second prompt: every engine answers it 400
        for client in clients.values():
            client.refuse.add(bad)
        rollout.loop.start()
        first = await rollout.loop.take(0, timeout=5)
        assert sorted({s.prompt_index for s in first.samples}) == [0]  # its group dropped, the other trained
        assert rollout.loop.refused_groups == 1 and rollout.run_status({}).refused_groups == 1
        second = await rollout.loop.take(1, timeout=5)  # the loop goes on
        assert sorted({s.prompt_index for s in second.samples}) == [2, 3]
        assert [r.state for r in rollout.pool.records()] == [EngineState.ACTIVE] * 2  # a refusal is no failure
    finally:
        await rollout.aclose()
