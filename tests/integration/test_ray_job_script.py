"""scripts/entrypoint/ray-job.sh checks what it can before submitting, with clear messages."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI

from tests.loopback import LoopbackServer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/entrypoint/ray-job.sh"
RECIPE = "examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
                **env}
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def dashboard():
    """A loopback stand-in answering the dashboard's /api/version, so the path checks can be reached."""
    app = FastAPI()

    @app.get("/api/version")
    def version() -> dict[str, str]:
        return {"ray_version": "2.60.0"}

    with LoopbackServer(app, name="dashboard-stand-in") as server:
        yield server.url


def test_missing_run_script() -> None:
    result = run("examples/elastic_rollout/nope.sh")
    assert result.returncode == 2 and "run script 'examples/elastic_rollout/nope.sh' not found" in result.stderr


def test_dashboard_that_does_not_answer() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    result = run(RECIPE, RAY_DASHBOARD_ADDRESS=f"http://127.0.0.1:{port}")
    assert result.returncode == 2
    assert f"dashboard at http://127.0.0.1:{port} does not answer" in result.stderr


def test_missing_model_dir_is_named_before_submitting(dashboard, tmp_path: Path) -> None:
    result = run(RECIPE, RAY_DASHBOARD_ADDRESS=dashboard, MODEL_DIR=str(tmp_path / "models"),
                 DATA_DIR=str(tmp_path), EXP_DIR=str(tmp_path / "exp"))
    assert result.returncode == 2
    assert f"model '{tmp_path}/models/Qwen3-4B/' does not exist" in result.stderr
    assert "submitting" not in result.stdout


def test_missing_env_is_named(dashboard) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "DATA_DIR", "EXP_DIR")}
    result = subprocess.run(["bash", SCRIPT, RECIPE], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**env, "RAY_DASHBOARD_ADDRESS": dashboard,
                                 "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])})
    assert result.returncode != 0 and "MODEL_DIR" in result.stderr
