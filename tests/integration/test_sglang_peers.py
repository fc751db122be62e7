"""Relax's weight path against peers written from SGLang's side of the contract (``tests/peers``).

Both ends of a broadcast update used to be Relax's own, so a group built differently from SGLang's passed every
test and could never have formed with a real SGLang engine. Here each end meets a peer built the way the other
side really builds it: a trainer as slime/verl build theirs drives ``relax engine serve``; Relax's real sender
and broadcast driver update an engine that joins and receives as SGLang's weight updater does. Each checks the
served version and that the model computes the new weights' log-probs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.engines.client import EngineClient
from relax.rollout.refit.broadcast import ThreadWeightSource, close_group, open_group, send_version
from relax.rollout.settings import BroadcastSettings
from relax.training.sender import WeightSender
from tests.peers.sglang_trainer import SGLangStyleTrainer

REPO = Path(__file__).resolve().parents[2]
SETTINGS = BroadcastSettings(backend="gloo", timeout_s=20.0)


def _perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The preset's weights moved by a seeded step: what a training step would publish (every checkpoint name)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _teacher_forced(model_dir: Path, state: dict[str, torch.Tensor], ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i ≥ 1 under ``state``, by transformers' own forward."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, tok].item() for i, tok in enumerate(ids) if i > 0]


@pytest.fixture(scope="module")
def prompt_ids(tiny_preset) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                              add_generation_prompt=True))


def _served_logprobs_match(url: str, model_dir: Path, state: dict[str, torch.Tensor], prompt: list[int]) -> None:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_k": 1, "ignore_eos": True}}
    out = httpx.post(f"{url}/generate", json=body, timeout=60, trust_env=False).json()
    served = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
    expected = _teacher_forced(model_dir, state, prompt + out["output_ids"])[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4


def test_a_trainer_built_the_sglang_way_updates_relax_engine_serve(tiny_preset, start_engine, prompt_ids) -> None:
    engine = start_engine(tiny_preset.model_dir, weight_version="0")
    trainer = SGLangStyleTrainer(engine.url, group_name="slime-style-group", timeout_s=20.0)
    try:
        trainer.init_group()
        info = httpx.get(f"{engine.url}/server_info", timeout=10, trust_env=False).json()
        assert info["weight_update_groups"] == ["slime-style-group"]

        v1 = _perturbed(tiny_preset.model_dir, seed=1)
        trainer.update_per_tensor(v1, "1")
        assert httpx.get(f"{engine.url}/model_info", trust_env=False).json()["weight_version"] == "1"
        _served_logprobs_match(engine.url, tiny_preset.model_dir, v1, prompt_ids)

        v2 = _perturbed(tiny_preset.model_dir, seed=2)
        assert trainer.update_flattened(v2, "2", bucket_bytes=64 * 1024) > 2  # several buckets, version on the last
        assert httpx.get(f"{engine.url}/model_info", trust_env=False).json()["weight_version"] == "2"
        _served_logprobs_match(engine.url, tiny_preset.model_dir, v2, prompt_ids)

        trainer.destroy()
        info = httpx.get(f"{engine.url}/server_info", timeout=10, trust_env=False).json()
        assert info["weight_update_groups"] == []
    finally:
        trainer.close()


# ---------------------------------------------------------------------- Relax's sender → an SGLang-style engine


@dataclass
class Peer:
    proc: subprocess.Popen
    url: str
    stalled: threading.Event = field(default_factory=threading.Event)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole process group, as Ray kills a worker's tree
        self.proc.wait(timeout=30)


@pytest.fixture
def start_peers(tiny_preset):
    """Factory: start engine peers (one per argument list) side by side; each killed at the end."""
    started: list[Peer] = []

    def start(*arg_lists: tuple[str, ...]) -> list[Peer]:
        procs = [subprocess.Popen([sys.executable, "-m", "tests.peers.sglang_engine", "--model-dir",
                                   str(tiny_preset.model_dir), *args], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                  start_new_session=True) for args in arg_lists]
        peers = []
        for proc in procs:
            line = proc.stdout.readline()
            peer = Peer(proc, f"http://127.0.0.1:{int(line.split()[1])}" if line.startswith("READY ") else "")
            started.append(peer)
            assert peer.url, f"the engine peer did not start: {line!r}"
            peers.append(peer)

            def watch(peer: Peer = peer) -> None:
                for out in peer.proc.stdout:
                    if out.strip() == "STALLED":
                        peer.stalled.set()

            threading.Thread(target=watch, daemon=True).start()
        return peers

    yield start
    for peer in started:
        peer.kill()


async def test_relax_sender_updates_an_engine_built_the_sglang_way(tiny_preset, start_peers, prompt_ids) -> None:
    (peer,) = start_peers(())
    sender = WeightSender("127.0.0.1")
    source = ThreadWeightSource(sender)
    try:
        async with EngineClient(peer.url, timeout=60) as client:
            group = await open_group("peer-0", client, source, SETTINGS)
            for version, seed in ((1, 11), (2, 12)):
                state = _perturbed(tiny_preset.model_dir, seed)
                manifest = sender.hold(version, state, bucket_bytes=64 * 1024)
                assert len(manifest.bucket_sizes) > 2
                await send_version("peer-0", client, group, version, manifest, "retract", SETTINGS.timeout_s)
                assert await client.get_weight_version() == str(version)
                ids = prompt_ids + [5, 17, 42]
                served = httpx.post(f"{peer.url}/peer/logprobs", json={"input_ids": ids}, timeout=60,
                                    trust_env=False).json()
                expected = _teacher_forced(tiny_preset.model_dir, state, ids)
                assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4
            await close_group(group, client)
            assert sender.groups() == []
    finally:
        sender.shutdown()


async def test_peers_lost_mid_broadcast_fail_only_their_own_sync(tiny_preset, start_peers) -> None:
    """One peer killed (SIGKILL on its process group), one hung (alive, never reading), both in the middle of a
    broadcast: each sync fails within the group timeout, while the trainer's sender and the other engine's sync
    go on, and the sender serves a newer version afterwards."""
    timeout_s = 4.0
    killed, hung, survivor = start_peers(("--stall-after-buckets", "1"), ("--stall-after-buckets", "1"), ())
    sender = WeightSender("127.0.0.1")
    source = ThreadWeightSource(sender)
    settings = BroadcastSettings(backend="gloo", timeout_s=timeout_s)
    manifest = sender.hold(1, _perturbed(tiny_preset.model_dir, seed=3), bucket_bytes=64 * 1024)
    try:
        async with EngineClient(killed.url, timeout=60) as a, EngineClient(hung.url, timeout=60) as h, \
                EngineClient(survivor.url, timeout=60) as b:
            groups = {name: await open_group(name, client, source, settings)
                      for name, client in (("killed", a), ("hung", h), ("survivor", b))}
            began = time.monotonic()
            doomed = [asyncio.ensure_future(send_version(name, client, groups[name], 1, manifest, "retract",
                                                         timeout_s)) for name, client in (("killed", a), ("hung", h))]
            assert await asyncio.to_thread(killed.stalled.wait, 30) and await asyncio.to_thread(hung.stalled.wait, 30)
            killed.kill()
            await send_version("survivor", b, groups["survivor"], 1, manifest, "retract", timeout_s)  # goes on
            assert await b.get_weight_version() == "1"
            for sync in doomed:
                with pytest.raises(Exception):  # noqa: B017,PT011 - an HTTP, a collective or a timeout error
                    await sync
            assert time.monotonic() - began < timeout_s * 2 + 5  # bounded by the group's timeout
            for name in ("killed", "hung"):
                await close_group(groups[name], None)
            assert sender.groups() == [groups["survivor"].name]
            # the trainer's sender still works: a newer version reaches the survivor over its group
            manifest2 = sender.hold(2, _perturbed(tiny_preset.model_dir, seed=4), bucket_bytes=64 * 1024)
            await send_version("survivor", b, groups["survivor"], 2, manifest2, "retract", timeout_s)
            assert await b.get_weight_version() == "2"
    finally:
        sender.shutdown()
