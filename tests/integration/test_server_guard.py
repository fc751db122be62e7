"""No engine server outlives the process that started it (``relax.engines.guard``), however that one dies.

Faults as the platform makes them: the owner is SIGKILLed by pid alone (an OOM kill, ``kill -9 <driver>``),
not by process group, so nothing but the guard can take the server down.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from relax.engines import guard

OWNER = textwrap.dedent("""
    import json, sys, time
    from relax.cluster.network import free_port
    from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
    spec = builtin_spec(sys.argv[1], "127.0.0.1", free_port(), sys.argv[2], name="guarded",
                        options=BuiltinOptions(num_threads=1))
    proc = ServerProcess(spec)
    proc.start()
    proc.wait_healthy(timeout=120)
    print(json.dumps({"guard": proc.pid, "port": spec.port}), flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float) -> float:
    began = time.monotonic()
    while not all(_gone(p) for p in pids):
        assert time.monotonic() - began < timeout, f"still alive after {timeout}s: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.1)
    return time.monotonic() - began


def _listeners(port: int) -> list[int | None]:
    """Pids listening on ``port`` (None where the socket's owner is not visible)."""
    return [c.pid for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN]


def _listening(port: int) -> bool:
    return bool(_listeners(port))


def _wait_closed(port: int, timeout: float = 10) -> None:
    """The port is released once the process's last thread is gone, which can trail the main thread's exit
    (a SIGKILLed server shows as a zombie while its other threads unwind)."""
    deadline = time.monotonic() + timeout
    while _listening(port):
        assert time.monotonic() < deadline, f"port {port} still listened on by {_listeners(port)} after {timeout}s"
        time.sleep(0.05)


@pytest.fixture
def owner(tiny_preset, tmp_path: Path):
    """A process that started a guarded built-in engine; yields (owner Popen, guard pid, server pid, port)."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(tiny_preset.model_dir), str(tmp_path / "engine.log")],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the owner exited ({proc.poll()}); engine log:\n{(tmp_path / 'engine.log').read_text()[-2000:]}"
        info = json.loads(line)
        (server,) = psutil.Process(info["guard"]).children()
        yield proc, info["guard"], server.pid, info["port"]
    finally:
        with contextlib.suppress(ProcessLookupError):  # the owner's group (the server has its own session)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_an_owner_killed_by_pid_takes_its_server_with_it(owner) -> None:
    proc, guard_pid, server_pid, port = owner
    assert _listening(port)
    os.kill(proc.pid, signal.SIGKILL)  # by pid: the server is in its own session, this reaches only the owner
    proc.wait(timeout=10)
    took = _wait_gone([guard_pid, server_pid], timeout=15)
    _wait_closed(port)
    print(f"owner SIGKILLed: server gone after {took:.1f}s")


def test_a_server_whose_guard_is_killed_stops_itself(owner) -> None:
    _, guard_pid, server_pid, port = owner
    os.kill(guard_pid, signal.SIGKILL)
    took = _wait_gone([server_pid], timeout=20)  # the death signal the guard set (SIGKILL), or the watchdog
    _wait_closed(port)
    print(f"guard SIGKILLed: server gone after {took:.1f}s")


def _guarded_sleeper() -> tuple[subprocess.Popen[bytes], psutil.Process]:
    """A guard (owned by this process) over a "server" that sleeps and never watches its parent."""
    proc = subprocess.Popen([sys.executable, "-m", "relax.engines.guard", "--owner-pid", str(os.getpid()), "--",
                             sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not psutil.Process(proc.pid).children():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (child,) = psutil.Process(proc.pid).children()
    return proc, child


def test_the_guard_passes_the_exit_code_and_signals_through(tmp_path: Path) -> None:
    code = subprocess.run([sys.executable, "-m", "relax.engines.guard", "--owner-pid", str(os.getpid()), "--",
                           sys.executable, "-c", "raise SystemExit(3)"], timeout=30).returncode
    assert code == 3
    proc, child = _guarded_sleeper()
    proc.send_signal(signal.SIGTERM)  # forwarded: the server stops, and the guard ends as the server did
    assert proc.wait(timeout=10) == -signal.SIGTERM
    _wait_gone([child.pid], timeout=5)


def test_a_server_killed_by_sigkill_is_reported_as_such_without_a_traceback() -> None:
    """An OOM kill reads as one: the guard names the signal and dies of it too (no Python traceback)."""
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"  # what the kernel's OOM killer does
    run = subprocess.run([sys.executable, "-m", "relax.engines.guard", "--owner-pid", str(os.getpid()), "--",
                          sys.executable, "-c", killed], capture_output=True, text=True, timeout=30)
    assert run.returncode == -signal.SIGKILL
    assert "was killed by SIGKILL (signal 9) — out of memory?" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert guard.describe_exit(1) == "exited with code 1"
    assert guard.describe_exit(-signal.SIGTERM) == "was killed by SIGTERM (signal 15)"


def test_a_server_that_does_not_watch_its_parent_dies_with_a_sigkilled_guard() -> None:
    """As Ray kills a dead worker's children: the guard gets SIGKILL and runs no code; its server must go too."""
    proc, child = _guarded_sleeper()
    proc.kill()
    proc.wait(timeout=10)
    _wait_gone([child.pid], timeout=5)


def test_a_guard_whose_owner_is_already_gone_starts_nothing() -> None:
    assert guard.main(["--owner-pid", "1" if os.getppid() != 1 else "2", "--", "true"]) == 137


def test_a_guard_without_a_command_explains_itself(capsys) -> None:
    with pytest.raises(SystemExit):
        guard.main(["--owner-pid", str(os.getppid()), "--"])
    assert "no server command" in capsys.readouterr().err


def test_a_paused_server_stops_promptly_on_sigterm(start_engine, tiny_preset) -> None:
    """A request held by a pause never finishes on its own; SIGTERM must not wait for it until the SIGKILL."""
    import httpx

    server = start_engine(tiny_preset.model_dir)
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"}, timeout=10,
                      trust_env=False).status_code == 200
    held = subprocess.Popen([sys.executable, "-c", f"import httpx; httpx.post('{server.url}/generate', json="
                             "{'input_ids': [1, 2, 3], 'sampling_params': {'max_new_tokens': 8}}, timeout=60)"])
    try:
        deadline = time.monotonic() + 30
        def queued() -> float:
            text = httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("sglang:num_queue_reqs") or line.startswith("sglang:num_running_reqs"))

        while queued() < 1:
            assert time.monotonic() < deadline, "the held request never reached the engine"
            time.sleep(0.05)
        began = time.monotonic()
        code = server.stop(grace_s=30)  # SIGTERM the group, SIGKILL only after 30 s
        took = time.monotonic() - began
        print(f"paused server stopped {took:.2f}s after SIGTERM (exit {code})")
        assert code is not None and code != -signal.SIGKILL and took < 10, (code, took)
    finally:
        held.kill()
        held.wait(timeout=10)
