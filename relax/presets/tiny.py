"""The tiny preset: a ~100 k-parameter Qwen3 model, its tokenizer and a synthetic task, built offline.

``build_tiny_preset(out)`` writes everything the CPU demo and the learning test need, deterministically
(same seed, same bytes) and without any download:

- ``out/model/``: a Qwen3-architecture causal LM (``Qwen3ForCausalLM``, float32, tied embeddings) plus a
  byte-level BPE tokenizer with a Qwen-style chat template, loadable with ``AutoModelForCausalLM`` and
  ``AutoTokenizer``;
- ``out/data/train.jsonl`` and ``out/data/eval.jsonl`` in the dapo-math schema;
- ``out/preset.json``: what was built and how well the warm-started model does (read by ``describe``).

Why a warm start, and why an *uncertain* one: GRPO only learns from groups whose rewards differ, so a
random-init policy (reward ~0) teaches nothing in a CPU-minute budget, and a perfect policy (reward ~1)
has nothing left to learn. The warm start first teaches the addition table on clean labels, then
smooths the answer distribution (the noise-free equivalent of training on labels that are right only
``WarmStart.p_correct`` of the time). The result ranks the right answer first on ~90 % of held-out
prompts yet samples it only ~25 % of the time at temperature 1: the reward has room to climb and GRPO
climbs it from ~0.3 to ~0.95 in 40 steps (``benchmarks/tiny_learnability.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from relax.presets.task import (
    ANSWER_PREFIX,
    ANSWER_RANGE,
    TEMPLATES,
    Problem,
    all_problems,
    format_answer,
    sample_train_lines,
    split_problems,
    write_jsonl,
)

__all__ = [
    "CHAT_TEMPLATE",
    "GRPO_DEFAULTS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "TinyPreset",
    "WarmStart",
    "build_tiny_preset",
    "describe",
    "render_chat",
]

IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)

#: Qwen2.5/Qwen3 chat format without the tool and thinking branches the task never uses.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: GRPO settings validated by ``benchmarks/tiny_learnability.py`` (three seeds, last5 - first5 >= 0.4
#: within 40 steps); the training demo uses them as its defaults.
GRPO_DEFAULTS: dict[str, float | int] = {
    "lr": 1e-3,
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 8,
    "temperature": 1.0,
    "max_new_tokens": 16,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
}

N_TRAIN_LINES = 4096
N_EVAL_LINES = 200
# An upper bound: 256 byte symbols + 3 specials + merges; the task's text runs out of merges at 346.
BPE_VOCAB_SIZE = 384


@dataclass(frozen=True)
class ModelShape:
    """Size of the tiny Qwen3: small enough that sampling and a training step take milliseconds."""

    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 256


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm-start recipe; the defaults are what ``benchmarks/tiny_learnability.py`` validated."""

    p_correct: float = 0.35
    clean_steps: int = 150
    smooth_steps: int = 80
    batch_size: int = 64
    lr: float = 5e-3
    smooth_lr: float = 1e-3
    warmup_steps: int = 20


@dataclass(frozen=True)
class TinyPreset:
    """Where a built preset lives."""

    root: Path
    model_dir: Path
    train_path: Path
    eval_path: Path


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Python twin of ``CHAT_TEMPLATE`` (used before the tokenizer exists; a test keeps them equal)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{EOS_TOKEN}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _prompt_text(problem: Problem) -> str:
    return render_chat([{"role": "user", "content": problem.text}], add_generation_prompt=True)


def _corpus() -> list[str]:
    """Every prompt once and the correct response to each: the text the BPE merges are learned from."""
    problems = all_problems()
    return [_prompt_text(p) for p in problems] + [format_answer(p.answer) + EOS_TOKEN for p in problems]


def build_tokenizer(vocab_size: int = BPE_VOCAB_SIZE):
    """A byte-level BPE tokenizer in Qwen's style, wrapped for ``transformers``.

    Unlike Qwen, numbers are *not* split into digits: the corpus makes every answer `` 0``..`` 18`` one
    token, so the answer is a single sampling decision. That gives GRPO the easiest possible credit
    assignment and lets the warm start smooth the answer distribution exactly (``warm_start``).
    Byte-level pre-tokenisation keeps any input encodable, junk included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=ModelShape().max_position_embeddings,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(tokenizer, seed: int, shape: ModelShape = ModelShape()):
    """A randomly initialised Qwen3ForCausalLM sized for ``tokenizer``; init is seeded."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        # 10x Qwen's 0.02: at width 64 the default init leaves attention near-uniform for ~100 steps
        # before it finds the operands; 0.2 halves the warm start (measured).
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **asdict(shape),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    return model


@dataclass
class _Encoded:
    """Token ids of every prompt and every answer, computed once (tokenising per step is slow)."""

    prompt_ids: dict[str, list[int]]
    response_ids: dict[int, list[int]]  # answer value -> ids of "Answer: N<|im_end|>"
    answer_token: dict[int, int]  # answer value -> the single token that carries N
    pad_id: int


def _encode(tokenizer, problems: Sequence[Problem]) -> _Encoded:
    prompt_ids = {p.text: tokenizer(_prompt_text(p), add_special_tokens=False)["input_ids"] for p in problems}
    response_ids, answer_token = {}, {}
    prefix = tokenizer(format_answer(0)[:-1], add_special_tokens=False)["input_ids"]  # "Answer: " minus digit
    for v in ANSWER_RANGE:
        ids = tokenizer(format_answer(v) + EOS_TOKEN, add_special_tokens=False)["input_ids"]
        if len(ids) != len(prefix) + 1 or ids[: len(prefix) - 1] != prefix[:-1]:
            raise RuntimeError(f"answer {v} is not a single token: {tokenizer.convert_ids_to_tokens(ids)}")
        response_ids[v], answer_token[v] = ids, ids[-2]
    return _Encoded(prompt_ids, response_ids, answer_token, tokenizer.convert_tokens_to_ids(PAD_TOKEN))


def _batch(enc: _Encoded, problems: Sequence[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + correct response, labels only on the response, and the answer's position.

    ``answer_at`` is the index (in the shifted, next-token view) where the answer token is predicted.
    """
    seqs = [(enc.prompt_ids[p.text], enc.response_ids[p.answer]) for p in problems]
    width = max(len(a) + len(b) for a, b in seqs)
    input_ids = torch.full((len(seqs), width), enc.pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    answer_at = torch.empty(len(seqs), dtype=torch.long)
    for i, (prompt, response) in enumerate(seqs):
        n = len(prompt) + len(response)
        input_ids[i, :n] = torch.tensor(prompt + response)
        labels[i, len(prompt) : n] = torch.tensor(response)
        mask[i, :n] = 1
        answer_at[i] = n - 3  # logits at n-3 predict the token at n-2 (the answer; n-1 is eos)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "answer_at": answer_at}


def _answer_targets(enc: _Encoded, problems: Sequence[Problem], vocab: int, p_correct: float) -> torch.Tensor:
    """Smoothed target distribution of the answer token: ``p_correct`` on the right answer, the rest
    spread evenly over the wrong answers. This is the *expectation* of training on noisy labels, so
    it teaches the same uncertain-but-right policy without the label noise that erases a small
    model's knowledge of the facts.
    """
    ids = torch.tensor([enc.answer_token[v] for v in ANSWER_RANGE])
    q = torch.zeros(len(problems), vocab)
    q[:, ids] = (1.0 - p_correct) / (len(ANSWER_RANGE) - 1)
    q[torch.arange(len(problems)), torch.tensor([enc.answer_token[p.answer] for p in problems])] = p_correct
    return q


def _loss(model, batch: dict[str, torch.Tensor], q: torch.Tensor | None) -> torch.Tensor:
    """Token-mean cross-entropy over the response; the answer token uses target ``q`` when given."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = batch["labels"][:, 1:]
    on = target != -100
    nll = -logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1) * on
    if q is not None:
        rows = torch.arange(len(q))
        nll[rows, batch["answer_at"]] = -(q * logp[rows, batch["answer_at"]]).sum(-1)
    return nll.sum() / on.sum()


def warm_start(model, enc: _Encoded, train: Sequence[Problem], seed: int, recipe: WarmStart) -> None:
    """Two phases: learn the facts on clean labels, then smooth the answer distribution.

    Clean labels first because a ~100 k-parameter model learns the addition table several times
    faster from them; the smoothing phase then lowers the probability of the right answer to about
    ``p_correct`` while keeping it the most likely one (see ``_answer_targets``).
    """
    rng = random.Random(f"warm-start-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    vocab = model.config.vocab_size
    total = recipe.clean_steps + recipe.smooth_steps
    model.train()
    for step in range(total):
        smoothing = step >= recipe.clean_steps
        lr = recipe.smooth_lr if smoothing else recipe.lr * min(1.0, (step + 1) / recipe.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        problems = [train[rng.randrange(len(train))] for _ in range(recipe.batch_size)]
        q = _answer_targets(enc, problems, vocab, recipe.p_correct) if smoothing else None
        loss = _loss(model, _batch(enc, problems), q)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()


@torch.no_grad()
def answer_accuracy(model, enc: _Encoded, problems: Sequence[Problem]) -> dict[str, float]:
    """Exact accuracies of the correct response ``Answer: N<eos>``, from one teacher-forced pass.

    ``sampled`` is the expected reward at temperature 1 (product of the response tokens'
    probabilities, no sampling noise); ``greedy`` is the share of prompts whose greedy decode is the
    correct response. Responses that score through another spelling are ignored (negligible here).
    """
    batch = _batch(enc, problems)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = batch["labels"][:, 1:]
    on = target != -100
    tok_logp = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    seq_logp = (tok_logp * on).sum(-1)
    hit = ((logp.argmax(-1) == target) | ~on).all(-1)
    return {"sampled": seq_logp.exp().mean().item(), "greedy": hit.float().mean().item()}


def build_tiny_preset(out: Path, *, seed: int = 0, recipe: WarmStart = WarmStart()) -> TinyPreset:
    """Build the tiny preset under ``out`` (created if missing) and return its paths.

    Deterministic: the build runs on one torch thread with seeded RNGs and leaves the caller's RNG
    state and thread count as they were, so two builds with the same seed write identical bytes
    (thread count matters: float reductions split differently across threads).
    """
    from transformers.utils import logging as hf_logging

    out = Path(out)
    threads = torch.get_num_threads()
    progress_bars = hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # save_pretrained's one-shard bar is noise in `relax preset tiny`
    try:
        with torch.random.fork_rng(devices=[]):
            return _build(out, seed, recipe)
    finally:
        torch.set_num_threads(threads)
        if progress_bars:
            hf_logging.enable_progress_bar()


def _build(out: Path, seed: int, recipe: WarmStart) -> TinyPreset:
    model_dir, data_dir = out / "model", out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    train, eval_ = split_problems(seed, n_eval=N_EVAL_LINES)
    train_path, eval_path = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    n_train = write_jsonl(train_path, sample_train_lines(train, N_TRAIN_LINES, seed))
    n_eval = write_jsonl(eval_path, eval_)

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    enc = _encode(tokenizer, all_problems())
    before = answer_accuracy(model, enc, eval_)
    warm_start(model, enc, train, seed, recipe)
    after_train = answer_accuracy(model, enc, train)
    after_eval = answer_accuracy(model, enc, eval_)

    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    stats = {
        "task": f"single-digit addition, {len(TEMPLATES)} phrasings, answered as '{ANSWER_PREFIX} N'",
        "seed": seed,
        "model": "Qwen3ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "train_lines": n_train,
        "train_distinct_prompts": len(train),
        "eval_lines": n_eval,
        "warm_start": asdict(recipe),
        "accuracy_before_warm_start": _rounded(before),
        "accuracy_train": _rounded(after_train),
        "accuracy_eval": _rounded(after_eval),
        "reward": "relax.data.rewards.tiny_task.compute_score",
        "grpo_defaults": GRPO_DEFAULTS,
    }
    (out / "preset.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return TinyPreset(root=out, model_dir=model_dir, train_path=train_path, eval_path=eval_path)


def _rounded(acc: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in acc.items()}


def describe(preset: TinyPreset) -> str:
    """A few human-readable lines about a built preset (what the ``relax preset tiny`` command prints)."""
    stats = json.loads((preset.root / "preset.json").read_text())
    acc = stats["accuracy_eval"]
    grpo = stats["grpo_defaults"]
    return "\n".join(
        [
            f"Tiny preset under {preset.root} (seed {stats['seed']})",
            f"  model:  {preset.model_dir}  ({stats['model']}, {stats['parameters']:,} parameters, "
            f"vocab {stats['vocab_size']})",
            f"  train:  {preset.train_path}  ({stats['train_lines']} lines, "
            f"{stats['train_distinct_prompts']} distinct prompts)",
            f"  eval:   {preset.eval_path}  ({stats['eval_lines']} lines, disjoint from train)",
            f"  task:   {stats['task']}; reward {stats['reward']}",
            f"  warm start: eval accuracy {acc['sampled']:.0%} sampled at temperature 1, "
            f"{acc['greedy']:.0%} greedy; GRPO lifts it to ~0.9 in ~40 steps",
            "  GRPO defaults: " + ", ".join(f"{k}={v}" for k, v in grpo.items()),
        ]
    )
