"""The tiny preset: deterministic build, loadable model/tokenizer, dapo-math data, its reward.

Uses the session fixture ``tiny_preset`` (one build, ~10 s); the determinism test builds once more.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from relax.data.rewards.tiny_task import compute_score, extract_answer
from relax.presets.task import TEMPLATES, all_problems, split_problems
from relax.presets.tiny import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    N_EVAL_LINES,
    N_TRAIN_LINES,
    WarmStart,
    build_tiny_preset,
    describe,
    render_chat,
)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer(tiny_preset):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_preset.model_dir)


@pytest.fixture(scope="module")
def model(tiny_preset):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_preset.model_dir).eval()


# --- build -----------------------------------------------------------------------------------------


def test_same_seed_builds_identical_bytes(tmp_path):
    """Two builds, every step of the real one (data, tokenizer, model, both warm-start phases, save), with a warm
    start a few steps long: a full rebuild costs ~25 CPU-seconds and checks nothing more. The caller's thread
    count is not 1, so the build's own single thread is what makes the reductions repeat."""
    short = WarmStart(clean_steps=6, smooth_steps=4, warmup_steps=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = build_tiny_preset(tmp_path / "first", recipe=short)
        second = build_tiny_preset(tmp_path / "second", recipe=short)
        assert torch.get_num_threads() == 2  # the build restores the caller's thread count
    finally:
        torch.set_num_threads(threads)
    hashes = _hashes(first.root)
    assert hashes == _hashes(second.root)
    assert {"model/model.safetensors", "model/tokenizer.json", "data/train.jsonl", "preset.json"} <= set(hashes)
    other = build_tiny_preset(tmp_path / "other", seed=1, recipe=short)  # the seed is what the bytes follow
    assert _hashes(other.root)["model/model.safetensors"] != hashes["model/model.safetensors"]


def test_preset_paths_and_describe(tiny_preset):
    assert tiny_preset.model_dir == tiny_preset.root / "model"
    assert tiny_preset.train_path.is_file() and tiny_preset.eval_path.is_file()
    with pytest.raises(AttributeError):
        tiny_preset.root = Path("/elsewhere")  # frozen
    text = describe(tiny_preset)
    assert str(tiny_preset.model_dir) in text and "parameters" in text and "accuracy" in text


def test_warm_start_leaves_room_for_grpo(tiny_preset):
    """The learning tests rely on this: right answer known (greedy) but sampled only sometimes."""
    stats = json.loads((tiny_preset.root / "preset.json").read_text())
    assert 0.15 <= stats["accuracy_eval"]["sampled"] <= 0.45
    assert stats["accuracy_eval"]["greedy"] >= 0.7
    assert stats["accuracy_before_warm_start"]["sampled"] < 0.05


# --- tokenizer and model ---------------------------------------------------------------------------


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == render_chat(messages, add_generation_prompt=True)
    full = messages + [{"role": "assistant", "content": "Answer: 7"}]
    assert tokenizer.apply_chat_template(full, tokenize=False) == render_chat(full)
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_special_tokens_agree_with_model_config(tiny_preset, tokenizer, model):
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.vocab_size == len(tokenizer)
    # Round trip of arbitrary junk: byte-level BPE can encode anything.
    junk = "∑ 🤖 \t\x00 Answer:: 12?"
    assert tokenizer.decode(tokenizer(junk, add_special_tokens=False)["input_ids"]) == junk


def test_model_is_a_small_float32_qwen3(model):
    assert model.config.model_type == "qwen3"
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.tie_word_embeddings
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 300_000


def test_model_generates_answers(tiny_preset, tokenizer, model):
    records = _read_jsonl(tiny_preset.eval_path)[:16]
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in records]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=16)
    responses = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=False)
    assert all(re.match(r"Answer: \d+<\|im_end\|>", r) for r in responses), responses
    greedy = sum(compute_score(r, rec["label"]) for r, rec in zip(responses, records, strict=True))
    assert greedy / len(records) >= 0.6


def test_answer_is_one_token_at_the_smoothed_position(tokenizer):
    """The warm start smooths exactly one position; it must be the answer token, for every answer."""
    from relax.presets.tiny import _batch, _encode

    problems = all_problems()[:: len(TEMPLATES) + 1]
    enc = _encode(tokenizer, problems)
    batch = _batch(enc, problems)
    target = batch["labels"][:, 1:]
    for i, problem in enumerate(problems):
        token = int(target[i, batch["answer_at"][i]])
        assert token == enc.answer_token[problem.answer]
        assert tokenizer.decode([token]) == f" {problem.answer}"


# --- data ------------------------------------------------------------------------------------------


def test_jsonl_schema_and_sizes(tiny_preset):
    train, eval_ = _read_jsonl(tiny_preset.train_path), _read_jsonl(tiny_preset.eval_path)
    assert len(train) == N_TRAIN_LINES and len(eval_) == N_EVAL_LINES
    for record in train + eval_:
        assert set(record) == {"prompt", "label"}
        assert isinstance(record["label"], str)
        [message] = record["prompt"]
        assert message["role"] == "user" and isinstance(message["content"], str)
        a, b = (int(d) for d in re.findall(r"\d", message["content"]))
        assert int(record["label"]) == a + b


def test_eval_is_disjoint_from_train_but_covers_known_facts(tiny_preset):
    train, eval_ = _read_jsonl(tiny_preset.train_path), _read_jsonl(tiny_preset.eval_path)
    train_prompts = {r["prompt"][0]["content"] for r in train}
    eval_prompts = {r["prompt"][0]["content"] for r in eval_}
    assert len(eval_prompts) == len(eval_)
    assert not train_prompts & eval_prompts
    facts = {tuple(re.findall(r"\d", text)) for text in train_prompts}
    assert all(tuple(re.findall(r"\d", text)) in facts for text in eval_prompts)


def test_split_keeps_a_train_phrasing_for_every_fact():
    train, eval_ = split_problems(seed=3, n_eval=200)
    assert len(train) + len(eval_) == len(all_problems()) == 100 * len(TEMPLATES)
    facts = {tuple(re.findall(r"\d", p.text)) for p in train}
    assert len(facts) == 100
    assert split_problems(seed=3) == split_problems(seed=3)
    assert split_problems(seed=3) != split_problems(seed=4)


# --- reward ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "label", "score"),
    [
        ("Answer: 7", "7", 1.0),
        ("Answer: 7<|im_end|>", "7", 1.0),
        ("  Answer:   7 \n", " 7 ", 1.0),
        ("answer:7", "7", 1.0),
        ("Let me think. 3 + 4 = 7.\nAnswer: 7.", "7", 1.0),
        ("Answer: 8", "7", 0.0),
        ("Answer: 17", "7", 0.0),
        ("Answer: 7abc", "7", 0.0),
        ("Answer: 6\nAnswer: 7", "7", 1.0),  # the last answer counts (DAPO's rule)
        ("Answer: 7\nAnswer: 6", "7", 0.0),  # so listing candidates does not pay
        ("7", "7", 0.0),
        ("", "7", 0.0),
        ("<|im_end|><|endoftext|>\x00∑🤖", "7", 0.0),
        ("Answer: 7", "seven", 0.0),
        ("Answer: 7.0", "7", 1.0),
        ("Answer: -3", "-3", 1.0),
    ],
)
def test_compute_score(response, label, score):
    assert compute_score(response, label) == score


def test_reward_never_raises_on_junk():
    for junk in [None, 7, b"Answer: 7", "Answer:", "Answer: ", "Answer: -", "A" * 10_000]:
        assert compute_score(junk, "7") == 0.0  # type: ignore[arg-type]
    assert extract_answer("Answer: 12 and then Answer: 3") == 3.0
