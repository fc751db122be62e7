"""Two fully-async GRPO steps of a real pretrained model through the entrypoint: SmolLM2-135M-Instruct.

What the tiny preset cannot show: a real tokenizer and chat template, a real EOS (``<|im_end|>``), tied
embeddings, and a 538 MB weight publication to an engine that keeps serving. 1 trainer rank, 1 built-in
engine, 2 prompts x 2 samples per step, on-policy (``--max-staleness 0``: the second step's samples can only
come from the engine after it loaded the first publication), then a checkpoint that transformers loads as a
plain HF model.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.data.rewards import get_reward_fn
from relax.demo.local import train_argv
from relax.presets.smollm2 import SMOLLM2_GRPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_NEW_TOKENS = 16


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_steps_on_smollm2_publish_and_checkpoint(smollm2_preset, tmp_path: Path) -> None:
    assert (smollm2_preset.model_dir / "model.safetensors").stat().st_size > 500e6  # what each publication moves
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    grpo = {**SMOLLM2_GRPO, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": MAX_NEW_TOKENS}
    argv = train_argv(smollm2_preset, out, num_rollout=2, max_staleness=0, trainer_gpus=1, rollout_gpus=1,
                      grpo=grpo, rm_type="last-number",
                      extra=("--record-samples", "--save", str(ckpt), "--save-interval", "2"))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=480)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    # the samples: real EOS or the length limit, text decoded from the tokens, rewards as the reward computes
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_preset.model_dir))
    reward = get_reward_fn("last-number")
    samples = read_jsonl(out / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [0, 1] and len(samples) == 2 * 2 * 2
    for s in samples:
        ids = s["response_token_ids"]
        assert 0 < len(ids) <= MAX_NEW_TOKENS
        if s["finish_reason"] == "length":
            assert len(ids) == MAX_NEW_TOKENS
        else:
            assert s["finish_reason"] == "stop" and ids[-1] == tokenizer.eos_token_id  # <|im_end|>, id 2
        assert s["response_text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert s["reward"] == reward(s["response_text"], s["label"])
        assert s["weight_version"] == s["step"]  # on-policy: step 1 was generated on the published version 1
    versions = read_jsonl(out / "sample_versions.jsonl")
    assert [(r["step"], sorted(set(r["sample_versions"]))) for r in versions] == [(0, [0]), (1, [1])]

    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["time/publish_s"] > 0 and r["train/peak_memory_mb"] > 500 for r in rows)

    # the checkpoint is a plain HF model holding the trained weights (not the base ones)
    assert (ckpt / "latest").read_text().strip() == "step_000002"
    saved = ckpt / "step_000002"
    model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    base = load_file(str(smollm2_preset.model_dir / "model.safetensors"))
    trained = model.state_dict()
    assert set(base) <= set(trained)
    # GRPO moves the weights only when some group's rewards differ (else every advantage is 0, and there is no
    # weight decay): with 2 samples a prompt both outcomes happen, and each is checked
    groups: dict[tuple, set] = {}
    for s in samples:
        groups.setdefault((s["step"], s["prompt_index"]), set()).add(s["reward"])
    learned = any(len(rewards) > 1 for rewards in groups.values())
    assert any(not torch.equal(base[k], trained[k]) for k in base) == learned
    assert json.loads((saved / "trainer_state.json").read_text())["step"] == 2
