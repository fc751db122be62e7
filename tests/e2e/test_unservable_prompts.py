"""Prompts the engines cannot serve never end a run: a data file with a 300-token prompt and a 1 MB one (the
tiny model's context is 256 tokens) trains to the end, and the run's summary counts the two it dropped."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax.demo.local import train_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class Data:
    model_dir: Path
    train_path: Path


def test_a_prompt_too_long_and_a_1mb_prompt_are_dropped_and_the_run_trains_to_the_end(tiny_preset,
                                                                                      tmp_path: Path) -> None:
    lines = tiny_preset.train_path.read_text().splitlines()
    label = json.loads(lines[0])["label"]
    bad = [json.dumps({"prompt": " ".join(["7 + 8"] * 150), "label": label}),  # ~300 tokens and more
           json.dumps({"prompt": "9" * 1_000_000, "label": label})]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([lines[0], bad[0], *lines[1:40], bad[1], *lines[40:80]]) + "\n")
    out = tmp_path / "run"
    argv = train_argv(Data(tiny_preset.model_dir, data), out, num_rollout=3, trainer_gpus=1, rollout_gpus=1)
    run = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["training_steps"] == 3
    assert summary["data/dropped_prompts"] == 2 and summary["data/refused_groups"] == 0
