"""LaunchSpec / ServerProcess with a stand-in server script, the built-in command, network helpers."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import relax
from relax.cluster.network import LOCALHOST, free_port, free_ports, node_ip
from relax.engines.actor import build_launch_spec, resolve_host
from relax.engines.launcher import (
    BuiltinOptions,
    LaunchSpec,
    ServerLaunchError,
    ServerProcess,
    builtin_command,
    builtin_spec,
    connect_host,
    read_log_tail,
)
from relax.engines.sglang import SGLangOptions

# A stand-in engine: serves GET /health_generate and behaves as the mode says.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    print("fake server starting, MARK=" + os.environ.get("MARK", "-"), flush=True)
    if mode == "fail":
        for i in range(100):
            print(f"log line {i}", flush=True)
        print("Traceback: model not found", flush=True)
        sys.exit(3)
    if mode == "torch":  # what an engine does first: torch's first matmul loads MKL's kernels
        import torch
        print("matmul", float((torch.ones(64, 64) @ torch.ones(64, 64)).sum()), "cwd", os.getcwd(), flush=True)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "spawn-child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[3], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = 503 if mode == "never" else 200
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"{}")
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is as good as gone: it no longer runs
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def fake_spec(tmp_path: Path) -> Callable[..., LaunchSpec]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def make(mode: str = "ok", *extra: str, env: dict[str, str] | None = None) -> LaunchSpec:
        port = free_port()
        return LaunchSpec(
            argv=(sys.executable, str(script), str(port), mode, *extra),
            host="127.0.0.1",
            port=port,
            log_path=str(tmp_path / "logs" / f"fake-{port}.log"),
            env=env or {},
            name="engine_test",
        )

    return make


# -- LaunchSpec -------------------------------------------------------------------------------------


def test_launch_spec_validates_and_builds_the_url() -> None:
    spec = LaunchSpec(argv=["x", 1], host="10.0.0.2", port=30000, log_path="/tmp/x.log", env={"A": 1})
    assert spec.argv == ("x", "1") and spec.env == {"A": "1"}
    assert spec.url == "http://10.0.0.2:30000"
    assert spec.health_path == "/health_generate"
    with pytest.raises(ValueError, match="argv"):
        LaunchSpec(argv=(), host="h", port=1, log_path="l")
    with pytest.raises(ValueError, match="port"):
        LaunchSpec(argv=("x",), host="h", port=70000, log_path="l")
    with pytest.raises(ValueError, match="health_path"):
        LaunchSpec(argv=("x",), host="h", port=1, log_path="l", health_path="health")
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize(
    ("bind", "connect"),
    [("0.0.0.0", "127.0.0.1"), ("::", "[::1]"), ("fe80::1", "[fe80::1]"), ("10.1.2.3", "10.1.2.3")],
)
def test_connect_host(bind: str, connect: str) -> None:
    assert connect_host(bind) == connect


# -- built-in engine command --------------------------------------------------------------------------


def test_builtin_command_minimal() -> None:
    assert builtin_command("/m", "127.0.0.1", 31000) == [
        sys.executable, "-m", "relax.cli", "engine", "serve",
        "--model-path", "/m", "--host", "127.0.0.1", "--port", "31000",
    ]  # fmt: skip


def test_builtin_command_all_options() -> None:
    argv = builtin_command(
        "/m", "0.0.0.0", 31000, max_running_requests=8, max_total_tokens=4096, weight_version=2, num_threads=1
    )
    assert argv[5:] == [
        "--model-path", "/m", "--host", "0.0.0.0", "--port", "31000",
        "--max-running-requests", "8", "--max-total-tokens", "4096", "--weight-version", "2", "--num-threads", "1",
    ]  # fmt: skip


def test_builtin_spec_makes_the_package_importable_and_logs_unbuffered(tmp_path: Path) -> None:
    spec = builtin_spec(
        "/m", "127.0.0.1", 31000, str(tmp_path / "e.log"),
        weight_version=0, options=BuiltinOptions(num_threads=2), env={"EXTRA": "1"}, name="engine_3",
    )  # fmt: skip
    root = str(Path(relax.__file__).resolve().parent.parent)
    assert spec.env["PYTHONPATH"].split(os.pathsep)[0] == root
    assert spec.env["PYTHONUNBUFFERED"] == "1"
    assert spec.env["OMP_NUM_THREADS"] == "2"
    assert spec.env["EXTRA"] == "1"
    assert spec.name == "engine_3" and spec.url == "http://127.0.0.1:31000"
    assert "--num-threads" in spec.argv and "--weight-version" in spec.argv


def test_build_launch_spec_dispatches_by_backend(tmp_path: Path) -> None:
    log = str(tmp_path / "e.log")
    builtin = build_launch_spec("builtin", "engine_0", "/m", "127.0.0.1", 1234, log)
    assert builtin.argv[1:3] == ("-m", "relax.cli")
    sgl = build_launch_spec("sglang", "engine_0", "/m", "127.0.0.1", 1234, log, nccl_port=2345)
    assert sgl.argv[1:3] == ("-m", "sglang.launch_server") and "--nccl-port" in sgl.argv
    with pytest.raises(ValueError, match="unknown engine backend 'vllm'"):
        build_launch_spec("vllm", "engine_0", "/m", "127.0.0.1", 1234, log)
    with pytest.raises(TypeError, match="BuiltinOptions"):
        build_launch_spec("builtin", "engine_0", "/m", "127.0.0.1", 1234, log, options=SGLangOptions())
    with pytest.raises(TypeError, match="SGLangOptions"):
        build_launch_spec("sglang", "engine_0", "/m", "127.0.0.1", 1234, log, options=BuiltinOptions())


def test_port_taken_detection() -> None:
    def err(tail: str, code: int | None) -> ServerLaunchError:
        return ServerLaunchError("x", name="e", exit_code=code, log_path="l", log_tail=tail)

    assert err("OSError: [Errno 98] Address already in use", 1).port_was_taken
    assert not err("OSError: [Errno 98] Address already in use", None).port_was_taken
    assert not err("FileNotFoundError: model", 1).port_was_taken


# -- ServerProcess ------------------------------------------------------------------------------------


def test_start_wait_healthy_stop(fake_spec: Callable[..., LaunchSpec]) -> None:
    server = ServerProcess(fake_spec("ok", env={"MARK": "hello"}))
    assert server.pid is None and not server.alive and server.stop() is None
    pid = server.start()
    try:
        took = server.wait_healthy(timeout=30)
        assert took >= 0 and server.alive and server.returncode is None
        assert "MARK=hello" in server.log_tail()  # env overrides reach the server
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
    finally:
        code = server.stop(grace_s=10)
    assert code == -signal.SIGTERM
    assert not server.alive
    wait_for(lambda: pid_gone(pid), 10, "the server pid to go")
    assert server.stop() == code  # idempotent


def test_exit_during_startup_fails_fast_with_log_tail(fake_spec: Callable[..., LaunchSpec]) -> None:
    server = ServerProcess(fake_spec("fail"))
    server.start()
    began = time.monotonic()
    with pytest.raises(ServerLaunchError) as info:
        server.wait_healthy(timeout=60)
    assert time.monotonic() - began < 30  # did not wait for the deadline
    err = info.value
    assert err.exit_code == 3
    assert "exited with code 3" in str(err)
    assert "Traceback: model not found" in str(err)
    assert "log line 99" in str(err) and "log line 50" not in str(err)  # only the last 40 lines
    assert len(err.log_tail.splitlines()) == 40
    assert err.log_path == server.spec.log_path
    back = pickle.loads(pickle.dumps(err))
    assert (back.exit_code, back.log_tail, str(back)) == (3, err.log_tail, str(err))
    assert server.stop() == 3


# A Ray worker whose working directory a joining node's runtime-env agent removes and re-extracts.
WORKER = textwrap.dedent(
    """
    import json, sys
    from relax.engines.launcher import LaunchSpec, ServerProcess
    spec = LaunchSpec(**json.loads(sys.argv[1]))
    print("ready", flush=True)
    sys.stdin.readline()  # the test replaces our working directory meanwhile
    server = ServerProcess(spec)
    server.start()
    try:
        server.wait_healthy(timeout=120)
        print("healthy", flush=True)
    except Exception as exc:
        print("failed", exc, flush=True)
    finally:
        server.stop(grace_s=5)
    """
)


@pytest.mark.parametrize("re_extracted", [True, False], ids=["re-extracted", "gone"])
def test_server_starts_when_the_workers_directory_was_removed(tmp_path: Path, re_extracted: bool) -> None:
    """Ray re-extracts a job's working_dir (rmtree + unzip) when a node on the same filesystem first needs
    it; a server started from the deleted directory aborted in torch (MKL cannot load, exit 2)."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    workdir = tmp_path / "working_dir_files" / "_ray_pkg_abc"
    workdir.mkdir(parents=True)
    port = free_port()
    log_path = tmp_path / "logs" / "engine.log"
    spec = {"argv": [sys.executable, str(script), str(port), "torch"], "host": "127.0.0.1", "port": port,
            "log_path": str(log_path), "name": "engine_cwd"}
    env = {**os.environ, "PYTHONPATH": str(Path(relax.__file__).parent.parent), "PWD": str(workdir)}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(spec)], cwd=workdir, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "ready"
        shutil.rmtree(workdir)
        if re_extracted:
            workdir.mkdir()
        worker.stdin.write("go\n")
        worker.stdin.flush()
        out, _ = worker.communicate(timeout=180)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = log_path.read_text()
    assert out.strip() == "healthy", f"{out}\n{log}"
    assert "matmul 262144.0" in log and "FATAL" not in log
    assert f"cwd {workdir if re_extracted else log_path.parent}" in log


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5, trust_env=False).status_code
    except httpx.HTTPError:
        return None


def test_never_healthy_times_out_and_leaves_stopping_to_the_caller(fake_spec: Callable[..., LaunchSpec]) -> None:
    server = ServerProcess(fake_spec("never"))
    server.start()
    try:
        # the fake server must be up first (a loaded machine can take seconds to start Python): then the
        # one-second wait below always ends on a 503, never on "nothing listens yet"
        deadline = time.monotonic() + 60
        while _status(server.url + server.spec.health_path) != 503:
            assert time.monotonic() < deadline, "the fake server never answered"
            time.sleep(0.05)
        with pytest.raises(ServerLaunchError, match=r"not healthy after 1s \(last probe: HTTP 503\)") as info:
            server.wait_healthy(timeout=1.0, poll_interval=0.1)
        assert info.value.exit_code is None
        assert server.alive
    finally:
        server.stop(grace_s=5)
    assert not server.alive


def test_stop_escalates_to_sigkill(fake_spec: Callable[..., LaunchSpec]) -> None:
    server = ServerProcess(fake_spec("ignore-term"))
    server.start()
    server.wait_healthy(timeout=30)
    assert server.stop(grace_s=0.5) == -signal.SIGKILL


def test_stop_reaches_the_whole_process_group(fake_spec: Callable[..., LaunchSpec], tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    server = ServerProcess(fake_spec("spawn-child", str(pid_file)))
    server.start()
    try:
        server.wait_healthy(timeout=30)
        child = int(pid_file.read_text())
        assert not pid_gone(child)
    finally:
        server.stop(grace_s=5)
    wait_for(lambda: pid_gone(child), 10, "the server's child to go")


def test_wait_healthy_before_start_is_a_bug(fake_spec: Callable[..., LaunchSpec]) -> None:
    with pytest.raises(RuntimeError, match="before start"):
        ServerProcess(fake_spec()).wait_healthy(1)


def test_read_log_tail(tmp_path: Path) -> None:
    assert read_log_tail(tmp_path / "missing.log") == ""
    log = tmp_path / "a.log"
    log.write_bytes(b"".join(f"l{i}\n".encode() for i in range(10)) + b"\xff bad utf8\n")
    assert read_log_tail(log, 2) == "l9\n\ufffd bad utf8"


def test_popen_does_not_leak_the_log_file_descriptor(fake_spec: Callable[..., LaunchSpec]) -> None:
    def open_on_log(path: str) -> list[str]:
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == path:
                    fds.append(fd)
            except OSError:  # closed while we looked
                pass
        return fds

    server = ServerProcess(fake_spec("ok"))
    server.start()
    try:
        assert open_on_log(os.path.realpath(server.spec.log_path)) == []  # only the child holds it open
    finally:
        server.stop()


# -- EngineActor's eviction hook (the plain class, no Ray) -------------------------------------------


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_actor_validates_backend_and_callback(restore_sigterm: None) -> None:
    from relax.engines.actor import EngineActor

    with pytest.raises(ValueError, match="unknown engine backend"):
        EngineActor("engine_0", "vllm", "/m")
    with pytest.raises(TypeError, match="on_eviction"):
        EngineActor("engine_0", "builtin", "/m", on_eviction=("handle", 3))
    actor = EngineActor("engine_0", "builtin", "/m")
    assert actor.info() is None and actor.url() is None and actor.pid() is None
    assert actor.is_alive() is False and actor.log_tail() == "" and actor.shutdown() is None
    with pytest.raises(RuntimeError, match="start after shutdown"):
        actor.start()


@pytest.mark.parametrize("is_async", [False, True])
def test_first_sigterm_notifies_and_keeps_serving(restore_sigterm: None, is_async: bool) -> None:
    from relax.engines.actor import EngineActor

    seen: list[str] = []

    def notify(engine_id: str) -> None:
        seen.append(engine_id)

    async def notify_async(engine_id: str) -> None:
        seen.append(engine_id)

    chained: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    actor = EngineActor("engine_5", "builtin", "/m", on_eviction=notify_async if is_async else notify)
    assert signal.getsignal(signal.SIGTERM) == actor._on_sigterm
    actor._on_sigterm(signal.SIGTERM, None)  # returns: no exit on the first notice
    wait_for(lambda: seen == ["engine_5"], 10, "the eviction callback")
    assert chained == []
    actor._on_sigterm(signal.SIGTERM, None)  # the eviction was recorded: a second notice means "now"
    assert chained == [signal.SIGTERM] and seen == ["engine_5"]


def test_sigterm_without_callback_chains_to_the_previous_handler(restore_sigterm: None) -> None:
    from relax.engines.actor import EngineActor

    chained: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    actor = EngineActor("engine_6", "builtin", "/m")
    actor._on_sigterm(signal.SIGTERM, None)
    assert chained == [signal.SIGTERM]


# -- network helpers ----------------------------------------------------------------------------------


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind((LOCALHOST, port))


def test_free_ports_are_distinct_and_skip_the_ones_promised_elsewhere() -> None:
    first = free_ports(64)
    assert len(set(first)) == 64  # Ray refuses a start where two components share a port
    second = free_ports(64, avoid=first)  # released, the kernel may hand the first ones out again
    assert len(set(second)) == 64 and not set(second) & set(first)
    assert free_ports(0) == []


def test_node_ip_and_resolve_host() -> None:
    import ray

    expected = ray.util.get_node_ip_address() if ray.is_initialized() else LOCALHOST
    assert node_ip() == expected
    assert resolve_host("node") == expected
    assert resolve_host("127.0.0.1") == "127.0.0.1"


def test_weight_load_budget_grows_with_the_bytes() -> None:
    from relax.engines.weight_load import LOAD_BASE_S, load_timeout_s

    assert load_timeout_s(0) == LOAD_BASE_S
    assert load_timeout_s(8 * 10**9) == pytest.approx(LOAD_BASE_S + 80)  # Qwen3-4B in bf16
    assert load_timeout_s(16 * 10**9) > load_timeout_s(8 * 10**9) > load_timeout_s(513 * 2**20)


def test_launch_spec_repr_masks_the_api_key() -> None:
    spec = LaunchSpec(argv=("python", "-m", "sglang.launch_server", "--api-key", "s3cret"), host="127.0.0.1",
                      port=30000, log_path="/tmp/x.log", token="s3cret")
    assert "s3cret" not in repr(spec) and "***" in repr(spec)


# -- which backend `auto` means (relax.rollout.pool.launcher) ------------------------------------------------


def test_auto_means_sglang_on_cuda_engines_and_builtin_elsewhere() -> None:
    from relax.rollout.pool.launcher import resolve_backend

    assert resolve_backend("auto", engines_have_cuda=True) == "sglang"
    assert resolve_backend("auto", engines_have_cuda=False) == "builtin"
    assert resolve_backend("sglang", engines_have_cuda=False) == "sglang"  # asked for: never overridden
    assert resolve_backend("builtin", engines_have_cuda=True) == "builtin"


def test_auto_on_this_cpu_machine_is_the_builtin_engine() -> None:
    # The CPU test suite runs with Ray's logical GPUs: they are not CUDA devices, so `auto` stays builtin.
    import torch

    from relax.rollout.pool.launcher import engine_node_facts, resolve_backend

    assert not torch.cuda.is_available()
    assert resolve_backend("auto") == "builtin"
    facts = engine_node_facts("auto", "/opt/sglang/bin/python")
    assert (facts.cuda, facts.backend, facts.problem) == (False, "builtin", None)


def _fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def test_sglang_on_a_node_without_it_is_one_line_naming_the_interpreter_and_the_fixes(tmp_path: Path) -> None:
    from relax.rollout.pool.launcher import engine_node_facts

    python = _fake_python(tmp_path, 'echo "importlib.metadata.PackageNotFoundError: sglang" >&2; exit 1')
    facts = engine_node_facts("sglang", str(python))
    assert facts.backend == "sglang" and facts.python == str(python) and facts.sglang_version is None
    assert facts.problem is not None and "\n" not in facts.problem
    assert f"SGLang is not installed for {python}" in facts.problem
    for fix in ("sglang==0.5.23", "--sglang-python PATH", "--rollout-backend builtin"):
        assert fix in facts.problem


def test_sglang_on_a_node_with_it_reports_its_version(tmp_path: Path) -> None:
    from relax.rollout.pool.launcher import engine_node_facts

    python = _fake_python(tmp_path, 'echo "0.5.23"')
    facts = engine_node_facts("sglang", str(python))
    assert (facts.backend, facts.python, facts.sglang_version, facts.problem) == ("sglang", str(python), "0.5.23", None)
