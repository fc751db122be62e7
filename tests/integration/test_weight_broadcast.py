"""Broadcast weight updates against a real built-in engine: SGLang's distributed protocol over gloo.

A trainer-side ``WeightSender`` (the code rank 0 runs) and the rollout side's ``rollout.refit.broadcast`` drive a
real engine subprocess over loopback HTTP; the engine joins a real gloo group and receives the buckets.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from relax.engines.client import EngineClient, EngineError
from relax.rollout.refit.broadcast import (
    BroadcastSettings,
    ThreadWeightSource,
    close_group,
    open_group,
    send_version,
)
from relax.rollout.refit.transport import VersionSuperseded
from relax.training.sender import WeightSender
from relax.weights.group import host_rendezvous
from tests.integration.test_builtin_engine import teacher_forced_logprobs
from tests.weight_sender import held_versions

SETTINGS = BroadcastSettings(backend="gloo", timeout_s=30.0)


@pytest.fixture(scope="module")
def prompt_ids(tiny_preset):
    tok = AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                              add_generation_prompt=True))


def greedy(ids: list[int], n: int = 10) -> dict:
    return {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "top_k": 1, "ignore_eos": True}}


async def test_a_broadcast_version_is_served_with_the_trainers_logprobs(
    tiny_preset, start_engine, perturbed, prompt_ids
) -> None:
    engine = start_engine(tiny_preset.model_dir, weight_version="0")
    weights_dir, state = perturbed
    sender = WeightSender("127.0.0.1")
    # small buckets: the version travels as several collectives, the last one carrying the version
    manifest = sender.hold(1, state, bucket_bytes=64 * 1024)
    assert len(manifest.bucket_sizes) > 2
    async with EngineClient(engine.url, timeout=60) as client:
        group = await open_group("engine-0", client, ThreadWeightSource(sender), SETTINGS)
        assert sender.groups() == [group.name]
        timings = await send_version("engine-0", client, group, 1, manifest, "retract", SETTINGS.timeout_s)
        assert timings["bytes"] == manifest.total_bytes and timings["buckets"] == len(manifest.bucket_sizes)
        assert await client.get_weight_version() == "1"
        info = await client.get_server_info()
        assert info["weight_update_groups"] == [group.name] and info["paused"] is False
        out = await client.generate(**greedy(prompt_ids))
        logprobs = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
        expected = teacher_forced_logprobs(weights_dir, prompt_ids, out["output_ids"], 1.0)
        assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) <= 1e-4
        assert out["meta_info"]["weight_version"] == "1"

        # a second version through the same group
        manifest2 = sender.hold(2, {k: v * 0.5 for k, v in state.items()}, bucket_bytes=64 * 1024)
        await send_version("engine-0", client, group, 2, manifest2, "retract", 30.0)
        assert await client.get_weight_version() == "2"

        # a version the trainer dropped before its send began (it stepped on): refused before the engine is
        # paused or sent anything, and the group carries the newest one next
        manifest3 = sender.hold(3, state, bucket_bytes=64 * 1024)
        for v in (4, 5):
            newest = sender.hold(v, state, bucket_bytes=64 * 1024)
        with pytest.raises(VersionSuperseded):
            await send_version("engine-0", client, group, 3, manifest3, "retract", 30.0)
        info = await client.get_server_info()
        assert info["paused"] is False and await client.get_weight_version() == "2"
        await send_version("engine-0", client, group, 5, newest, "retract", 30.0)
        assert await client.get_weight_version() == "5" and held_versions(sender) == [4, 5]
        await close_group(group, client)
        assert sender.groups() == [] and (await client.get_server_info())["weight_update_groups"] == []


async def test_the_protocol_rules_of_sglang_hold(tiny_preset, start_engine) -> None:
    engine = start_engine(tiny_preset.model_dir, weight_version="0")
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "g"}
    async with httpx.AsyncClient(base_url=engine.url, timeout=30, trust_env=False) as http:
        r = await http.post("/update_weights_from_distributed", json=body)  # outside a session
        assert r.status_code == 400
        assert "must run between begin_weight_update() and end_weight_update()" in r.json()["message"]
        await http.post("/begin_weight_update", json={})
        r = await http.post("/update_weights_from_distributed", json=body)  # no such group
        assert r.status_code == 400 and "/init_weights_update_group" in r.json()["message"]
        r = await http.post("/update_weights_from_distributed", json={**body, "dtypes": []})
        assert r.status_code == 400 and "same length" in r.text
        r = await http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"})
        assert r.status_code == 400 and "needs a CUDA engine" in r.json()["message"]
        r = await http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2})
        assert r.status_code == 400 and "outside a group" in r.text
        r = await http.post("/destroy_weights_update_group", json={"group_name": "nope"})
        assert r.status_code == 400 and "no weight update group 'nope'" in r.json()["message"]
        await http.post("/end_weight_update", json={})
        assert (await http.get("/model_info")).json()["weight_version"] == "0"  # nothing changed


async def test_an_engine_killed_mid_broadcast_fails_its_update_fast_and_spares_the_others(
    tiny_preset, start_engine, perturbed
) -> None:
    _, state = perturbed
    doomed = start_engine(tiny_preset.model_dir, weight_version="0")
    survivor = start_engine(tiny_preset.model_dir, weight_version="0")
    sender = WeightSender("127.0.0.1")
    manifest = sender.hold(1, state, bucket_bytes=64 * 1024)
    source = ThreadWeightSource(sender)
    async with EngineClient(doomed.url, timeout=30) as a, EngineClient(survivor.url, timeout=30) as b:
        group_a = await open_group("doomed", a, source, SETTINGS)
        group_b = await open_group("survivor", b, source, SETTINGS)
        await a.begin_weight_update()
        os.killpg(doomed.pid, signal.SIGKILL)  # the whole process group, as Ray kills a worker's tree
        began = time.monotonic()
        with pytest.raises((RuntimeError, EngineError, OSError)):
            for index in range(len(manifest.bucket_sizes)):
                await source.broadcast(group_a.name, 1, index)
        assert time.monotonic() - began < 15  # bounded: a dead peer is noticed, not waited for
        await close_group(group_a, None)
        await send_version("survivor", b, group_b, 1, manifest, "retract", SETTINGS.timeout_s)  # unaffected
        assert await b.get_weight_version() == "1"
        assert sender.groups() == [group_b.name]


def test_superseded_versions_and_unknown_groups_are_refused_clearly() -> None:
    sender = WeightSender("127.0.0.1", keep=2)
    for v in (1, 2, 3):
        sender.hold(v, {"w": torch.ones(4)})
    assert held_versions(sender) == [2, 3]
    with pytest.raises(ValueError, match="strictly increase"):
        sender.hold(1, {"w": torch.ones(4)})  # dropped: older than the newest
    with pytest.raises(KeyError, match="not open"):
        sender.broadcast("nope", 3, 0)
    store, port = host_rendezvous("127.0.0.1", 2, 5.0)
    assert port > 0
    del store


def test_a_pinned_version_outlives_newer_holds_until_its_send_releases_it() -> None:
    sender = WeightSender("127.0.0.1", keep=2)
    sender.hold(1, {"w": torch.ones(4)})
    assert sender.acquire(1, lease_s=60)
    for v in (2, 3):
        sender.hold(v, {"w": torch.full((4,), float(v))})
    assert held_versions(sender) == [1, 2, 3]  # the send of v1 may still need its next bucket
    sender.wait_copied()
    assert torch.equal(sender._held(1).buffers[0].view(torch.float32), torch.ones(4))  # its memory not reused
    sender.release(1)
    assert held_versions(sender) == [2, 3]
    assert not sender.acquire(1, lease_s=60)  # gone: the manager moves on, its engine untouched
    assert sender.acquire(2, lease_s=0.0)  # a lease that lapsed (its manager stopped mid-send) pins nothing
    sender.hold(4, {"w": torch.ones(4)})
    assert held_versions(sender) == [3, 4]


def test_held_buffers_are_copies_a_training_step_cannot_change() -> None:
    weight = torch.ones(8)
    sender = WeightSender("127.0.0.1")
    sender.hold(1, {"w": weight})
    sender.wait_copied()  # what the trainer's optimizer step waits for (TrainerActor.train_step)
    weight.mul_(3)  # the optimizer updates the parameter in place after publication
    held = sender._held(1)
    assert torch.equal(held.buffers[0].view(torch.float32), torch.ones(8))


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_in_flight_requests_survive_a_broadcast_and_record_both_versions(
    tiny_preset, start_engine, perturbed, prompt_ids, mode
) -> None:
    engine = start_engine(tiny_preset.model_dir, weight_version="0")
    _, state = perturbed
    sender = WeightSender("127.0.0.1")
    manifest = sender.hold(1, state)
    async with EngineClient(engine.url, timeout=120) as client:
        group = await open_group("e", client, ThreadWeightSource(sender), SETTINGS)
        long = asyncio.ensure_future(client.generate(
            input_ids=prompt_ids, sampling_params={"max_new_tokens": 200, "ignore_eos": True}, return_logprob=True))
        deadline = time.monotonic() + 60
        while (await client.get_server_info())["stats"]["generated_tokens"] < 5:
            assert time.monotonic() < deadline, "the long request never started"
            await asyncio.sleep(0.05)
        await send_version("e", client, group, 1, manifest, mode, SETTINGS.timeout_s)
        out = await long
        spans = out["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["0", "1"] and spans[-1]["end"] == 200


def test_a_hold_reuses_the_dropped_versions_memory_unless_a_broadcast_reads_it() -> None:
    sender = WeightSender("127.0.0.1", keep=2)
    state = {"w": torch.ones(1024)}
    sender.hold(1, state)
    sender.hold(2, {"w": torch.full((1024,), 2.0)})
    v1_ptr = sender._held(1).buffers[0].data_ptr()
    sender.hold(3, {"w": torch.full((1024,), 3.0)})
    assert held_versions(sender) == [2, 3]
    assert sender._held(3).buffers[0].data_ptr() == v1_ptr  # v1's mapped memory, refilled
    sender.wait_copied()
    assert torch.equal(sender._held(3).buffers[0].view(torch.float32), torch.full((1024,), 3.0))
    v2_ptr = sender._held(2).buffers[0].data_ptr()
    sender._sending[2] = 1  # a broadcast of v2 is in progress: its bytes must not change under it
    sender.hold(4, {"w": torch.full((1024,), 4.0)})
    assert sender._held(4).buffers[0].data_ptr() != v2_ptr
    assert held_versions(sender) == [3, 4]


async def test_the_version_bump_trap_is_sglangs_and_abort_all_false_steps_around_it(
    tiny_preset, start_engine, prompt_ids
) -> None:
    """/update_weight_version with SGLang's default aborts what is in flight; with ``abort_all_requests: false`` it
    keeps it (Relax never calls the route: versions travel with the weight updates)."""
    engine = start_engine(tiny_preset.model_dir, weight_version="0")
    async with EngineClient(engine.url, timeout=120) as client, \
            httpx.AsyncClient(base_url=engine.url, timeout=60, trust_env=False) as http:

        async def long_request() -> asyncio.Future:
            began = (await client.get_server_info())["stats"]["generated_tokens"]
            request = asyncio.ensure_future(client.generate(
                input_ids=prompt_ids, sampling_params={"max_new_tokens": 200, "ignore_eos": True}))
            deadline = time.monotonic() + 60
            while (await client.get_server_info())["stats"]["generated_tokens"] < began + 5:
                assert time.monotonic() < deadline, "the long request never started"
                await asyncio.sleep(0.05)
            return request

        kept = await long_request()
        r = await http.post("/update_weight_version", json={"new_version": "7", "abort_all_requests": False})
        assert r.status_code == 200 and r.json()["success"]
        out = await kept
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 200
        assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["0", "7"]

        lost = await long_request()
        r = await http.post("/update_weight_version", json={"new_version": "8"})  # SGLang's default
        assert r.status_code == 200 and (await client.get_weight_version()) == "8"
        out = await lost
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 200
