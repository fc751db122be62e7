"""Fully-async vs on-policy: the same tiny workload with --max-staleness 0 and 2.

Reports (prints and saves JSON to benchmarks/results/async_speedup.json) training steps per minute,
the trainer's idle fraction (time waiting for data) and engine utilisation (time the rollout loop was
generating / step wall time) for both, and their ratios. Both runs happen one after the other on the
same machine, so the ratio is meaningful; absolute numbers are not.

    python benchmarks/async_speedup.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from report import save_report

from relax.demo.local import train_argv
from relax.presets.tiny import build_tiny_preset


def measure(preset, out: Path, staleness: int, steps: int) -> dict:
    argv = train_argv(preset, out, num_rollout=steps, max_staleness=staleness)
    subprocess.run(argv, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"][2:]  # skip warm-up steps
    wall = sum(r["time/step_s"] for r in rows)
    return {
        "max_staleness": staleness,
        "steps_measured": len(rows),
        "training_steps_per_minute": round(60 * len(rows) / wall, 2),
        "trainer_idle_fraction": round(sum(r["time/trainer_wait_s"] for r in rows) / wall, 3),
        "engine_utilisation": round(min(1.0, sum(r["rollout/seconds"] for r in rows) / wall), 3),
        "mean_staleness": round(sum(r["staleness/mean"] for r in rows) / len(rows), 3),
        "reward_last5": round(sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/async_speedup.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-async-") as tmp:
        preset = build_tiny_preset(Path(tmp) / "tiny")
        sync = measure(preset, Path(tmp) / "s0", 0, args.steps)
        fully_async = measure(preset, Path(tmp) / "s2", 2, args.steps)
    report = {
        "benchmark": "async_speedup",
        "workload": "tiny preset, 2 trainer ranks + 2 engines, 8x8 samples/step",
        "on_policy": sync,
        "fully_async": fully_async,
        "steps_per_minute_ratio": round(
            fully_async["training_steps_per_minute"] / sync["training_steps_per_minute"], 2
        ),
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
