"""Fully-async GRPO through the real entrypoint on the tiny preset: it learns, staleness holds, resume works.

Each run starts its own embedded Ray cluster, 2 trainer ranks (FSDP2 on gloo) and 2 built-in engines.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from relax.demo import tiny_train_argv

pytestmark = pytest.mark.e2e


def train(preset, out: Path, *extra: str, num_rollout: int, staleness: int, timeout: float = 480):
    argv = tiny_train_argv(preset, out, num_rollout=num_rollout, max_staleness=staleness, extra=extra)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_it_learns_with_bounded_staleness(tiny_preset, tmp_path: Path) -> None:
    out = tmp_path / "learn"
    result = train(tiny_preset, out, "--eval-prompt-data", "tiny", str(tiny_preset.eval_path), "--eval-interval",
                   "30", "--n-samples-per-eval-prompt", "2", num_rollout=30, staleness=2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["training_steps"] == 30
    assert summary["reward_last5_mean"] - summary["reward_first5_mean"] >= 0.3, summary
    for row in read_jsonl(out / "sample_versions.jsonl"):
        assert max(row["trainer_version"] - v for v in row["sample_versions"]) <= 2
    assert "training step 30/30" in result.stderr
    assert (out / "training.png").stat().st_size > 0
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(evals) == 2  # before training and at step 30
    assert any(Path(out).glob("events.out.tfevents.*")) or any(Path(out).rglob("events.out.tfevents.*"))


def test_on_policy_and_resume_continue_at_the_same_data_position(tiny_preset, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    train(tiny_preset, reference, num_rollout=5, staleness=0)
    ref_rows = read_jsonl(reference / "sample_versions.jsonl")
    assert [r["step"] for r in ref_rows] == [0, 1, 2, 3, 4]
    for row in ref_rows:  # --max-staleness 0: strictly on-policy
        assert set(row["sample_versions"]) == {row["trainer_version"]}

    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first"
    train(tiny_preset, first, "--save", str(ckpt), "--save-interval", "3", num_rollout=3, staleness=0)
    assert (ckpt / "latest").read_text().strip() == "step_000003"

    resumed = tmp_path / "resumed"
    result = train(tiny_preset, resumed, "--load", str(ckpt / "step_000003"), num_rollout=5, staleness=0)
    rows = read_jsonl(resumed / "sample_versions.jsonl")
    assert [r["step"] for r in rows] == [3, 4]
    assert "training step 4/5" in result.stderr and "training step 3/5" not in result.stderr
    assert [r["prompt_indices"] for r in rows] == [r["prompt_indices"] for r in ref_rows[3:]]
    for row in rows:
        assert set(row["sample_versions"]) == {row["trainer_version"]}


def test_sigterm_stops_cleanly_with_a_checkpoint_and_no_leftovers(tiny_preset, tmp_path: Path) -> None:
    import signal
    import time

    import psutil

    out, ckpt = tmp_path / "stopped", tmp_path / "ckpt"
    argv = tiny_train_argv(tiny_preset, out, num_rollout=500, max_staleness=1, extra=("--save", str(ckpt)))
    log_path = tmp_path / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not reach step 3"
            time.sleep(0.2)
        started = {p.pid for p in psutil.Process(driver.pid).children(recursive=True)}
        assert started, "the driver should have started Ray and engine processes"
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            import os

            os.killpg(driver.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert "SIGTERM: stopping after step" in text
    saved = (ckpt / "latest").read_text().strip()
    steps_logged = len([r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"])
    assert saved == f"step_{steps_logged:06d}"
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in started):
        assert time.monotonic() < deadline, "processes the run started are still alive"
        time.sleep(0.2)
