"""`python -m relax.entrypoints.train`: the recipe's flags in --dry-run, and bad input failing before start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_plan import recipe_qwen3_4b_args


def run_train(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax.entrypoints.train", *argv], capture_output=True, text=True,
                          timeout=timeout)


def tiny_args(preset, *extra: str) -> list[str]:
    return ["--fully-async", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--hf-checkpoint",
            str(preset.model_dir), "--prompt-data", str(preset.train_path), "--apply-chat-template", "--rm-type",
            "tiny", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--global-batch-size", "16", *extra]


def test_recipe_flag_set_dry_run_shows_4_trainer_gpus_and_4_engines(tmp_path: Path) -> None:
    yaml = tmp_path / "autoscaler.yaml"
    yaml.write_text("enabled: true\nmin_engines: 4\nmax_engines: 8\n")
    result = run_train("--dry-run", *recipe_qwen3_4b_args(str(yaml)))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "trainer (actor)  4 GPUs" in out
    assert "4 initial engines × 1 GPU" in out
    assert "min 4 / max 8" in out
    assert "ignored (Megatron-only)" in result.stderr and "Traceback" not in result.stderr


def _fails_cleanly(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_resource_not_json(tiny_preset) -> None:
    args = tiny_args(tiny_preset)
    args[args.index("--resource") + 1] = "{actor: [1, 1]"
    _fails_cleanly(run_train(*args), "--resource", "JSON")


def test_batch_geometry_that_does_not_divide(tiny_preset) -> None:
    args = tiny_args(tiny_preset)
    args[args.index("--global-batch-size") + 1] = "5"
    _fails_cleanly(run_train(*args), "--global-batch-size")


def test_unknown_flag(tiny_preset) -> None:
    _fails_cleanly(run_train(*tiny_args(tiny_preset, "--rollout-batch-sizes", "3")), "--rollout-batch-sizes")


def test_missing_data_file(tiny_preset, tmp_path: Path) -> None:
    args = tiny_args(tiny_preset)
    args[args.index("--prompt-data") + 1] = str(tmp_path / "nope.jsonl")
    _fails_cleanly(run_train(*args), "nope.jsonl")


def test_malformed_data_names_the_line(tiny_preset, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "label": "2"})
    bad.write_text(good + "\n" + good + "\n{\"prompt\": oops}\n")
    args = tiny_args(tiny_preset)
    args[args.index("--prompt-data") + 1] = str(bad)
    _fails_cleanly(run_train(*args), "bad.jsonl:3")


def test_model_path_without_weights(tiny_preset, tmp_path: Path) -> None:
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_preset.model_dir / "config.json").read_text())
    args = tiny_args(tiny_preset)
    args[args.index("--hf-checkpoint") + 1] = str(empty)
    _fails_cleanly(run_train(*args), "no weights")


@pytest.mark.parametrize("flag", ["--colocate"])
def test_unsupported_mode_is_explained(tiny_preset, flag: str) -> None:
    _fails_cleanly(run_train(*tiny_args(tiny_preset, flag)), "--colocate")


def _broken_copy(preset, tmp_path: Path, name: str, damage) -> Path:
    import shutil

    broken = tmp_path / name
    shutil.copytree(preset.model_dir, broken)
    damage(broken)
    return broken


@pytest.mark.parametrize(("case", "words"), [
    ("truncated", "is truncated"),
    ("garbage", "is not a safetensors file"),
    ("config", "config.json is not valid JSON"),
])
def test_a_corrupted_checkpoint_fails_in_one_line_before_anything_starts(tiny_preset, tmp_path: Path, case: str,
                                                                         words: str) -> None:
    def damage(d: Path) -> None:
        weights = d / "model.safetensors"
        if case == "truncated":
            data = weights.read_bytes()
            weights.write_bytes(data[: len(data) // 2])
        elif case == "garbage":
            weights.write_bytes(b"\x00\x01garbage" * 1000)
        else:
            (d / "config.json").write_text('{"model_type": "qwen3",')

    args = tiny_args(tiny_preset)
    args[args.index("--hf-checkpoint") + 1] = str(_broken_copy(tiny_preset, tmp_path, case, damage))
    result = run_train(*args)
    _fails_cleanly(result, words)
    assert "Started a local Ray" not in result.stderr


def test_an_api_port_in_use_fails_in_one_line_before_ray_starts(tiny_preset) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_train(*tiny_args(tiny_preset, "--api-port", str(port)))
    _fails_cleanly(result, f"--api-port {port}: 127.0.0.1:{port} is already in use")
    assert "Started a local Ray" not in result.stderr


def test_an_output_dir_another_live_run_writes_fails_in_one_line(tiny_preset, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from relax.cluster import scratch; "
         "assert scratch.claim(Path(sys.argv[1])) is None; print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # --api-port 0: the default 8000 may be held by another run on the host (the e2e worker's, beside this one)
        result = run_train(*tiny_args(tiny_preset, "--output-dir", str(out), "--api-port", "0"))
    finally:
        holder.kill()
        holder.wait(timeout=30)
    _fails_cleanly(result, f"--output-dir: {out.resolve()} is in use by another live run (pid {holder.pid})")
    assert "Started a local Ray" not in result.stderr


def test_dry_run_names_the_backend_and_runs_the_flag_checks(tmp_path: Path) -> None:
    yaml = tmp_path / "autoscaler.yaml"
    yaml.write_text("enabled: true\nmin_engines: 4\nmax_engines: 8\n")
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    result = run_train("--dry-run", *recipe_qwen3_4b_args(str(yaml)), "--sglang-python", str(python))
    assert result.returncode == 0, result.stderr
    assert f"rollout engines  4 x sglang (python {python}), 1 GPU each" in result.stdout
    assert "--dry-run: a start on this machine would stop here: --hf-checkpoint" in result.stderr  # a warning
    bad = run_train("--dry-run", *recipe_qwen3_4b_args(str(yaml)), "--sglang-python", str(tmp_path / "nope"),
                    "--sglang-port", "1", "--api-host", "0.0.0.0")
    _fails_cleanly(bad, "--sglang-port: SGLang's --port is set by Relax", f"--sglang-python {tmp_path / 'nope'}",
                   "--api-host 0.0.0.0")
