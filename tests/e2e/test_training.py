"""Fully-async GRPO through the real entrypoint on the tiny preset: it learns, staleness holds, resume works;
prompts the engines cannot serve never end a run.

Each run starts its own embedded Ray cluster; the learning run has 2 trainer ranks (FSDP2 on gloo) and 2 built-in
engines, the resumed run and its neighbour 1 of each. The neighbour trains on a data file with a 300-token prompt
and a 1 MB one (the tiny model's context is 256 tokens): it must train to the end, and its summary count the two
it dropped (a run of its own for that cost ~50 s more; the neighbour runs anyway).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax.demo.local import train_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a run may take up to 480 s (train())


def train(preset, out: Path, *extra: str, num_rollout: int, staleness: int, timeout: float = 480):
    argv = train_argv(preset, out, num_rollout=num_rollout, max_staleness=staleness, extra=extra)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


RUN_ID = re.compile(r"run (\S+): scratch space")
ENGINE_FAILED = re.compile(r"\bengine_\d+ failed.*")
SCRATCH = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def run_together(argvs: list[list[str]], outs: list[Path], envs: list[dict[str, str] | None],
                 timeout: float = 480) -> list[subprocess.CompletedProcess]:
    """Start every run at once, wait for all; each must succeed."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for argv, env in zip(argvs, envs, strict=True)]
    results = []
    try:
        for argv, proc, out in zip(argvs, procs, outs, strict=True):
            stdout, stderr = proc.communicate(timeout=timeout)
            out.mkdir(parents=True, exist_ok=True)
            (out / "driver.log").write_text(stdout + stderr)
            results.append(subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for r in results:
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return results


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Data:
    model_dir: Path
    train_path: Path


def with_unservable_prompts(preset, path: Path) -> Data:
    """The preset's training data with a prompt too long for the model and a 1 MB one among them."""
    lines = preset.train_path.read_text().splitlines()
    label = json.loads(lines[0])["label"]
    bad = [json.dumps({"prompt": " ".join(["7 + 8"] * 150), "label": label}),  # ~300 tokens and more
           json.dumps({"prompt": "9" * 1_000_000, "label": label})]
    path.write_text("\n".join([lines[0], bad[0], *lines[1:40], bad[1], *lines[40:80]]) + "\n")
    return Data(preset.model_dir, path)


def expected_prompt_indices(preset, steps: int) -> list[list[int]]:
    """The data order the run must follow: --rollout-shuffle with the default seed, 8 prompts a step."""
    from transformers import AutoTokenizer

    from relax.data.dataset import PromptStream, load_prompt_data

    tokenizer = AutoTokenizer.from_pretrained(str(preset.model_dir))
    stream = PromptStream(load_prompt_data(preset.train_path, tokenizer=tokenizer, apply_chat_template=True),
                          shuffle=True, seed=42)
    return [sorted({r.index for r in stream.next_batch(8).records}) for _ in range(steps)]



def test_it_learns_with_bounded_staleness_then_resumes_on_policy_at_the_same_data_position(
        tiny_preset, tmp_path: Path) -> None:
    """30 steps with --max-staleness 2 that must learn, checkpointed at the end; then a resumed run of 2 more
    steps, strictly on-policy, on one trainer rank instead of two, that continues at the data position where the
    first stopped (one run each). Beside the resumed run, a neighbour of 2 steps on data with two prompts the
    engines cannot serve: it trains to the end and counts the two it dropped."""
    expected = expected_prompt_indices(tiny_preset, 32)
    out, ckpt = tmp_path / "learn", tmp_path / "ckpt"
    result = train(tiny_preset, out, "--eval-prompt-data", "tiny", str(tiny_preset.eval_path), "--eval-interval",
                   "30", "--n-samples-per-eval-prompt", "2", "--save", str(ckpt), "--save-interval", "30",
                   num_rollout=30, staleness=2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["training_steps"] == 30
    assert summary["reward_last5_mean"] - summary["reward_first5_mean"] >= 0.3, summary
    rows = read_jsonl(out / "sample_versions.jsonl")
    assert [r["prompt_indices"] for r in rows] == expected[:30]  # one batch a step, in the seeded order
    for row in rows:
        assert max(row["trainer_version"] - v for v in row["sample_versions"]) <= 2
    assert "training step 30/30" in result.stderr
    assert (out / "training.png").stat().st_size > 0
    metrics = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in metrics if r["kind"] == "eval"]
    assert len(evals) == 2  # before training and at step 30
    assert any(Path(out).glob("events.out.tfevents.*")) or any(Path(out).rglob("events.out.tfevents.*"))
    assert (ckpt / "latest").read_text().strip() == "step_000030"

    # The resumed run shares the machine with a second, independent run started at the same moment: two runs
    # on one node must not touch each other's files (weight copies in shared memory), and neither may leave
    # any behind. The neighbour starts as from a fresh shell, with no Ray auth variables at all: the run turns
    # token auth on by itself (after Ray is imported) and must still reach its own cluster. Its data holds two
    # prompts the engines cannot serve: they are dropped (and counted), and the run still trains to the end.
    resumed, neighbour = tmp_path / "resumed", tmp_path / "neighbour"
    unservable = with_unservable_prompts(tiny_preset, tmp_path / "unservable.jsonl")
    fresh_shell = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    results = run_together(
        # resumed on one trainer rank and one engine: a checkpoint of two ranks does not depend on the world size
        [train_argv(tiny_preset, resumed, num_rollout=32, max_staleness=0, trainer_gpus=1, rollout_gpus=1,
                    extra=("--load", str(ckpt / "step_000030"))),
         train_argv(unservable, neighbour, num_rollout=2, max_staleness=1, trainer_gpus=1, rollout_gpus=1,
                    extra=("--api-port", "0"))],  # the smallest run that leases its own scratch space
        [resumed, neighbour], [None, fresh_shell])
    run_ids = [RUN_ID.search(r.stderr).group(1) for r in results]
    assert run_ids[0] != run_ids[1]
    for r in results:
        assert not ENGINE_FAILED.search(r.stderr), ENGINE_FAILED.search(r.stderr).group(0)
    summary = json.loads((neighbour / "summary.json").read_text())
    assert summary["training_steps"] == 2
    assert summary["data/dropped_prompts"] == 2 and summary["data/refused_groups"] == 0
    assert [p.name for p in SCRATCH.glob("relax-run-*") if any(i in p.name for i in run_ids)] == []
    result = results[0]
    rows = read_jsonl(resumed / "sample_versions.jsonl")
    assert [r["step"] for r in rows] == [30, 31]
    assert "training step 31/32" in result.stderr and "training step 30/32" not in result.stderr
    assert [r["prompt_indices"] for r in rows] == expected[30:]  # the same data position
    for row in rows:  # --max-staleness 0: strictly on-policy
        assert set(row["sample_versions"]) == {row["trainer_version"]}
