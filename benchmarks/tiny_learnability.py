"""Is the tiny preset learnable by GRPO in CPU minutes? A self-contained pure-torch GRPO loop.

No Ray, no engine, no server: build (or reuse) the tiny preset, then per step sample
``--prompts`` prompts x ``--group`` responses at ``--temperature``, score them with the preset's
reward, normalise rewards within each group, and take one AdamW step on the clipped
policy-gradient loss (token-mean). It prints the mean reward of every step and ends with

    {"first5": .., "last5": .., "steps": .., "seconds": .., "hyperparams": {..}, ...}

also written to ``benchmarks/results/tiny_learnability.json``. The learning test of the real
training loop (Ray, engines, weight sync) expects the same rise, so this script is the reference
for what "the RL loop works" looks like on this preset, and its defaults are the recommended
hyperparameters of the training demo.

    python benchmarks/tiny_learnability.py                  # one run, seed 0
    python benchmarks/tiny_learnability.py --seeds 0 1 2    # robustness over GRPO seeds
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from relax.data.rewards.tiny_task import compute_score
from relax.presets.tiny import GRPO_DEFAULTS, build_tiny_preset

RESULTS = Path(__file__).resolve().parent / "results" / "tiny_learnability.json"


@dataclass(frozen=True)
class Hyper:
    """GRPO settings; the defaults are the ones this benchmark validated on three seeds."""

    steps: int = 40
    prompts: int = int(GRPO_DEFAULTS["rollout_batch_size"])  # prompts per step
    group: int = int(GRPO_DEFAULTS["n_samples_per_prompt"])  # responses per prompt
    temperature: float = float(GRPO_DEFAULTS["temperature"])
    max_new_tokens: int = int(GRPO_DEFAULTS["max_new_tokens"])
    lr: float = float(GRPO_DEFAULTS["lr"])
    eps_clip: float = float(GRPO_DEFAULTS["eps_clip"])
    eps_clip_high: float = float(GRPO_DEFAULTS["eps_clip_high"])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: tuple[float, float] = field(default=(0.9, 0.98))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(preset_root: Path):
    """Model and tokenizer of a built preset, loaded the way any user would load them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(preset_root / "model")
    model = AutoModelForCausalLM.from_pretrained(preset_root / "model", dtype=torch.float32)
    return model, tokenizer


def encode_prompts(tokenizer, records: list[dict]) -> list[list[int]]:
    """Chat-formatted prompt ids, exactly as an engine would receive them."""
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in records]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def sample(model, prompts: list[list[int]], pad_id: int, eos_id: int, h: Hyper) -> list[list[int]]:
    """Plain ancestral sampling with a KV cache (no top-k/top-p), so temperature means what it says.

    Prompts are left-padded; Qwen3's rotary attention depends only on relative positions, so the
    padding offset does not change what the model computes.
    """
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1]
    responses: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(h.max_new_tokens):
        probs = torch.softmax(logits.float() / h.temperature, dim=-1)
        nxt = torch.multinomial(probs, 1).squeeze(-1)
        for i in range(len(prompts)):
            if not done[i]:
                responses[i].append(int(nxt[i]))
        done |= nxt == eos_id
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=nxt.unsqueeze(-1), attention_mask=mask, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
    return responses


def score(model, tokenizer, records: list[dict], h: Hyper, samples: int = 1) -> float:
    """Mean reward of ``samples`` sampled responses per record (the eval metric of the trainer)."""
    model.eval()
    prompts = [p for p in encode_prompts(tokenizer, records) for _ in range(samples)]
    labels = [r["label"] for r in records for _ in range(samples)]
    responses = sample(model, prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, h)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=False)
    return sum(compute_score(t, y) for t, y in zip(texts, labels, strict=True)) / len(texts)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: reward minus its group's mean, over the group's std (0 where the group agrees)."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    return adv.view(-1)


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Per-token log-probs of the responses (right-padded) and their mask."""
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width - 1))
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp, loss_mask


def policy_loss(logp, old_logp, adv, mask, h: Hyper) -> torch.Tensor:
    """PPO/GRPO clipped surrogate, aggregated as a token mean over all response tokens."""
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(-1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - h.eps_clip, 1 + h.eps_clip_high) * a)
    return -(surrogate * mask).sum() / mask.sum()


def run(preset_root: Path, seed: int, h: Hyper, log=print) -> dict:
    """One GRPO run from the preset's warm start; returns the summary dict."""
    torch.manual_seed(seed)
    model, tokenizer = load(preset_root)
    records = read_jsonl(preset_root / "data" / "train.jsonl")
    eval_records = read_jsonl(preset_root / "data" / "eval.jsonl")
    eval_before = score(model, tokenizer, eval_records, h, samples=4)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    opt = torch.optim.AdamW(model.parameters(), lr=h.lr, weight_decay=h.weight_decay, betas=h.betas)
    rewards_per_step: list[float] = []
    started = time.perf_counter()
    for step in range(h.steps):
        batch = [records[order[(step * h.prompts + j) % len(order)]] for j in range(h.prompts)]
        prompts = [p for p in encode_prompts(tokenizer, batch) for _ in range(h.group)]
        labels = [r["label"] for r in batch for _ in range(h.group)]
        model.eval()
        responses = sample(model, prompts, pad_id, eos_id, h)
        texts = tokenizer.batch_decode(responses, skip_special_tokens=False)
        rewards = torch.tensor([compute_score(t, y) for t, y in zip(texts, labels, strict=True)])
        adv = group_advantages(rewards, h.group)
        model.train()
        logp, mask = response_logprobs(model, prompts, responses, pad_id)
        loss = policy_loss(logp, logp.detach(), adv, mask, h)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        opt.step()
        rewards_per_step.append(rewards.mean().item())
        mean_len = sum(len(r) for r in responses) / len(responses)
        log(
            f"seed {seed} step {step + 1:3d}/{h.steps}  reward {rewards_per_step[-1]:.3f}  "
            f"resp_len {mean_len:.1f}  {time.perf_counter() - started:5.1f}s"
        )
    seconds = time.perf_counter() - started
    first5 = sum(rewards_per_step[:5]) / 5
    last5 = sum(rewards_per_step[-5:]) / 5
    eval_after = score(model, tokenizer, eval_records, h, samples=4)
    log(f"seed {seed} eval reward {eval_before:.3f} -> {eval_after:.3f} (held-out prompts, 4 samples each)")
    return {
        "seed": seed,
        "first5": round(first5, 4),
        "last5": round(last5, 4),
        "gain": round(last5 - first5, 4),
        "steps": h.steps,
        "seconds": round(seconds, 1),
        "eval_before": round(eval_before, 4),
        "eval_after": round(eval_after, 4),
        "rewards": [round(r, 4) for r in rewards_per_step],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", type=Path, help="a built preset root (default: build one in a temp dir)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="GRPO seeds to run")
    parser.add_argument("--preset-seed", type=int, default=0, help="seed of the preset build")
    for name, value in asdict(Hyper()).items():
        if not isinstance(value, tuple):
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per run drowns the per-step lines
    h = Hyper(**{k: getattr(args, k) for k in asdict(Hyper()) if k != "betas"})

    with tempfile.TemporaryDirectory() as tmp:
        root = args.preset
        build_seconds = None
        if root is None:
            t0 = time.perf_counter()
            root = build_tiny_preset(Path(tmp) / "tiny", seed=args.preset_seed).root
            build_seconds = round(time.perf_counter() - t0, 1)
        runs = [run(root, seed, h) for seed in args.seeds]
        warm = json.loads((root / "preset.json").read_text())["accuracy_eval"]

    summary = {
        "first5": round(sum(r["first5"] for r in runs) / len(runs), 4),
        "last5": round(sum(r["last5"] for r in runs) / len(runs), 4),
        "steps": h.steps,
        "seconds": round(sum(r["seconds"] for r in runs) / len(runs), 1),
        "hyperparams": {**asdict(h), "betas": list(h.betas)},
        "min_gain": min(r["gain"] for r in runs),
        "warm_start_eval_accuracy": warm,
        "eval_before": round(sum(r["eval_before"] for r in runs) / len(runs), 4),
        "eval_after": round(sum(r["eval_after"] for r in runs) / len(runs), 4),
        "preset_build_seconds": build_seconds,
        "torch_threads": torch.get_num_threads(),
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    return summary


if __name__ == "__main__":
    main()
