"""Does GRPO teach a real pretrained model something on CPU? SmolLM2-135M-Instruct on the smollm2 preset.

Runs the fully-async entrypoint (1 trainer rank, 1 built-in engine, embedded Ray) for ``--steps`` steps with
an evaluation before training and after the last step, bounded by ``--max-minutes`` of wall time (the run is
then stopped the way an operator stops one, with SIGTERM: it finishes its step and writes its summary). It
prints and saves (benchmarks/results/real_model_learning.json):

- the reward trend: mean reward of the first 3 vs the last 3 steps, and every step's;
- eval pass rate (greedy is not used: the eval samples at the rollout temperature) before vs after;
- step times (median and the split wait / train / publish) and the trainer's peak memory.

    python benchmarks/real_model_learning.py [--preset DIR] [--steps 24] [--max-minutes 10]

``--preset DIR`` reuses a preset built by ``relax preset smollm2 --out DIR`` (the conversion takes ~30 s).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import machine, save_report, smollm2_preset

from relax.demo.local import train_argv
from relax.presets.smollm2 import SMOLLM2_GRPO


def _run(argv: list[str], log_path: Path, max_seconds: float) -> tuple[int, bool]:
    """Run the driver in its own process group; SIGTERM it (then wait for its clean stop) past the budget."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max_seconds), False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            return proc.wait(timeout=300), True


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", help="an existing smollm2 preset directory (default: build one)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--max-minutes", type=float, default=10.0, help="wall-clock budget of the run")
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per eval prompt")
    parser.add_argument("--out", default="benchmarks/results/real_model_learning.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-real-") as tmp:
        preset = smollm2_preset(args.preset, tmp, "real_model_learning")
        out = Path(tmp) / "run"
        argv = train_argv(
            preset, out, num_rollout=args.steps, max_staleness=1, trainer_gpus=1, rollout_gpus=1,
            grpo=SMOLLM2_GRPO, rm_type="last-number",
            extra=("--eval-prompt-data", "smollm2", str(preset.eval_path), "--eval-interval", str(args.steps),
                   "--n-samples-per-eval-prompt", str(args.eval_samples)),
        )
        began = time.monotonic()
        rc, stopped = _run(argv, Path(tmp) / "driver.log", args.max_minutes * 60)
        wall = time.monotonic() - began
        if rc != 0:
            print((Path(tmp) / "driver.log").read_text()[-4000:], file=sys.stderr)
            print(f"real_model_learning: the run failed (exit {rc})", file=sys.stderr)
            return 1
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    rewards = [r["rollout/reward_mean"] for r in train]
    eval_key = next((k for k in (evals[0] if evals else {}) if k.endswith("/mean_reward")), None)
    report = {
        "benchmark": "real_model_learning", "model": "SmolLM2-135M-Instruct (smollm2 preset)",
        "machine": machine(), "grpo": SMOLLM2_GRPO, "steps_requested": args.steps, "steps_done": len(train),
        "stopped_by_budget": stopped, "wall_seconds": round(wall, 1),
        "reward_first3_mean": _mean(rewards[:3]), "reward_last3_mean": _mean(rewards[-3:]),
        "reward_per_step": [round(x, 4) for x in rewards],
        "eval": {"metric": eval_key, "before": evals[0].get(eval_key) if evals and eval_key else None,
                 "after": evals[-1].get(eval_key) if len(evals) > 1 and eval_key else None,
                 "rows": evals},
        "step_seconds_median": round(statistics.median(r["time/step_s"] for r in train), 2) if train else None,
        "train_seconds_median": round(statistics.median(r["time/train_s"] for r in train), 2) if train else None,
        "publish_seconds_median": round(statistics.median(r["time/publish_s"] for r in train), 2) if train else None,
        "trainer_wait_fraction_mean": _mean([r["time/trainer_wait_fraction"] for r in train]),
        "response_len_first3_last3": [_mean([r["rollout/response_len_mean"] for r in train[:3]]),
                                      _mean([r["rollout/response_len_mean"] for r in train[-3:]])],
        "trainer_peak_memory_mb": max((r.get("train/peak_memory_mb", 0.0) for r in train), default=None),
    }
    save_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
