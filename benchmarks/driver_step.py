"""What one training step costs the driver process: its CPU seconds per step and the step's time split.

Runs the tiny recipe (2 trainer ranks, 2 engines, fully async) and watches the driver from outside: its CPU time
(psutil) is read each time ``metrics.jsonl`` gains a row, so the per-step figure leaves start-up and shutdown
out. The driver's share of a step is what it does besides waiting for data, training and publishing: handling
the samples, the records it writes, its calls to the rollout manager.

``--tree DIR`` runs another checkout of Relax (for example the commit before a change, from ``git worktree
add``) with the same workload, so the two runs compare on one machine:

    python benchmarks/driver_step.py [--steps 12] [--tree /tmp/relax-before --label before]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
from report import save_report

from relax.demo.local import train_argv
from relax.presets.tiny import GRPO_DEFAULTS, build_tiny_preset


def rows_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written
        if row.get("kind") == "train":
            out.append(row)
    return out


def measure(preset, out: Path, steps: int, tree: str | None, samples_per_step: int, max_new_tokens: int) -> dict:
    # a high temperature makes the tiny model's answers run to the length limit (it would stop after ~4 tokens),
    # so each step moves as many tokens as a real one of that size
    grpo = {**GRPO_DEFAULTS, "rollout_batch_size": samples_per_step // 8, "n_samples_per_prompt": 8,
            "max_new_tokens": max_new_tokens, "temperature": 25.0}
    argv = train_argv(preset, out, num_rollout=steps, max_staleness=1, grpo=grpo)
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    driver = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              start_new_session=True, cwd=tree or None)  # in the tree: its relax comes first
    proc = psutil.Process(driver.pid)
    cpu_at: dict[int, float] = {}  # rows seen -> the driver's CPU seconds when it saw them
    try:
        while driver.poll() is None:
            n = len(rows_of(out / "metrics.jsonl"))
            if n and n not in cpu_at:
                try:
                    t = proc.cpu_times()
                    cpu_at[n] = t.user + t.system
                except psutil.Error:
                    break
            time.sleep(0.02)
        driver.wait(timeout=600)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, 9)
            driver.wait()
    if driver.returncode != 0:
        raise SystemExit(f"the run failed (exit {driver.returncode}); rerun it by hand: {' '.join(argv)}")
    rows = rows_of(out / "metrics.jsonl")[2:]  # skip warm-up steps
    seen = sorted(cpu_at)
    first, last = seen[min(2, len(seen) - 1)], seen[-1]
    own = [r["time/step_s"] - r["time/trainer_wait_s"] - r["time/train_s"] - r["time/publish_s"] for r in rows]
    return {
        "steps_measured": len(rows),
        "driver_cpu_s_per_step": round((cpu_at[last] - cpu_at[first]) / max(1, last - first), 4),
        "step_s_median": round(statistics.median(r["time/step_s"] for r in rows), 4),
        "train_s_median": round(statistics.median(r["time/train_s"] for r in rows), 4),
        "trainer_wait_s_median": round(statistics.median(r["time/trainer_wait_s"] for r in rows), 4),
        "driver_other_s_median": round(statistics.median(own), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", help="another checkout of Relax to run instead of this one")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", default="benchmarks/results/driver_step.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-driver-") as tmp:
        preset = build_tiny_preset(Path(tmp) / "tiny")
        result = measure(preset, Path(tmp) / "run", args.steps, args.tree, args.samples_per_step,
                         args.max_new_tokens)
    report = {
        "benchmark": "driver_step",
        "label": args.label,
        "tree": args.tree or str(Path(__file__).resolve().parents[1]),
        "workload": f"tiny preset, 2 trainer ranks + 2 engines, {args.samples_per_step} samples/step, "
                    f"{args.max_new_tokens} new tokens each (temperature 25)",
        **result,
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
