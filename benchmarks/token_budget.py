"""A trainer step's peak memory and time with and without a token budget per micro-batch.

One FSDP2 rank (a Ray actor on CPU) trains SmolLM2-135M-Instruct (the smollm2 preset) on one batch of long
samples, once as a single micro-batch and once with ``--use-dynamic-batch-size --max-tokens-per-gpu N``. Each
configuration runs in a fresh rank, so its peak RSS (``train/peak_memory_mb`` on CPU) is its own; the floor is
the same rank's peak after start-up (model, optimizer, nothing trained yet). Prints and saves JSON.

    python benchmarks/token_budget.py [--samples 8] [--tokens 256] [--budget 512] [--preset DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import machine, save_report, smollm2_preset


def batch(n: int, tokens: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prompt = tokens // 8
    out = []
    for i in range(n):
        response = [rng.randrange(3, vocab) for _ in range(tokens - prompt)]
        out.append({"prompt_index": i, "group_id": f"g{i // 4}", "sample_index": i % 4,
                    "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt)],
                    "response_token_ids": response, "response_text": "", "label": "", "weight_version": 0,
                    "rollout_step": 0, "reward": 1.0, "advantage": rng.uniform(-1, 1)})
    return out


def measure(model_dir: Path, samples: list[dict], budget: int | None, steps: int) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from relax.training.actor import TrainerConfig
    from relax.training.group import TrainerGroup

    pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    config = TrainerConfig(hf_checkpoint=str(model_dir), lr=1e-6, use_dynamic_batch_size=budget is not None,
                           max_tokens_per_gpu=budget)
    group = TrainerGroup(config, pg, bundle_indices=[0], init_timeout_s=300, call_timeout_s=1800)
    try:
        floor = group.train_sharded([[]], 1.0, 1, "sample_mean")["peak_memory_mb"]  # a dummy pass: no sample
        times, peak = [], 0.0
        for _ in range(steps):
            began = time.perf_counter()
            metrics = group.train_step(samples)
            times.append(time.perf_counter() - began)
            peak = max(peak, metrics["peak_memory_mb"])
        plan = group.batch_plan()
    finally:
        group.shutdown()
        remove_placement_group(pg)
    from relax.training.sharding import micro_batches

    return {"max_tokens_per_gpu": budget, "micro_batches": len(micro_batches(samples, plan)),
            "peak_rss_mb": round(peak, 1), "floor_rss_mb": round(floor, 1),
            "above_floor_mb": round(peak - floor, 1), "step_s_median": round(statistics.median(times), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample (prompt + response)")
    parser.add_argument("--budget", type=int, default=512, help="--max-tokens-per-gpu of the budgeted run")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--preset", help="an existing smollm2 preset directory (default: build one)")
    parser.add_argument("--out", default="benchmarks/results/token_budget.json")
    args = parser.parse_args()
    import ray

    from relax.cluster.connect import start_local

    with tempfile.TemporaryDirectory(prefix="relax-budget-") as tmp:
        preset = smollm2_preset(args.preset, tmp, "token_budget")
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(preset.model_dir).vocab_size
        samples = batch(args.samples, args.tokens, vocab)
        start_local(num_gpus=1, num_cpus=2, log_to_driver=False)
        try:
            whole = measure(preset.model_dir, samples, None, args.steps)
            budgeted = measure(preset.model_dir, samples, args.budget, args.steps)
        finally:
            ray.shutdown()
    report = {
        "benchmark": "token_budget", "machine": machine(),
        "workload": f"SmolLM2-135M, one CPU rank, {args.samples} samples x {args.tokens} tokens (fp32)",
        "single_micro_batch": whole, "budgeted": budgeted,
        "memory_above_floor_ratio": round(budgeted["above_floor_mb"] / whole["above_floor_mb"], 3)
        if whole["above_floor_mb"] > 0 else None,
        "step_time_ratio": round(budgeted["step_s_median"] / whole["step_s_median"], 3),
    }
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
