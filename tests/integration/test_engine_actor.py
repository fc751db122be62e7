"""EngineActor and the shared launcher against the real built-in engine on the tiny preset.

The built-in engine stands in for SGLang here: both go through the same LaunchSpec -> ServerProcess path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relax.engines.client import EngineClient
from relax.engines.launcher import BuiltinOptions, ServerLaunchError, ServerProcess, builtin_spec

pytestmark = pytest.mark.timeout(300)

START_TIMEOUT_S = 180.0
OPTIONS = BuiltinOptions(max_running_requests=8, max_total_tokens=4096, num_threads=1)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie no longer runs
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


async def exercise_engine(url: str) -> dict:
    """Health, a sampled generation with log-probs, and the weight version, through EngineClient."""
    async with EngineClient(url, timeout=60) as client:
        await client.health_generate()
        out = await client.generate(
            "1+2=",
            sampling_params={"temperature": 1.0, "max_new_tokens": 4},
            rid="it-1",
            return_logprob=True,
        )
        assert isinstance(out, dict)
        meta = out["meta_info"]
        assert meta["id"] == "it-1"
        assert 1 <= meta["completion_tokens"] <= 4
        assert len(out["output_ids"]) == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        assert meta["finish_reason"]["type"] in ("length", "stop")
        assert await client.get_weight_version() == "0"
        return out


def test_server_process_runs_the_builtin_engine(tiny_preset, tmp_path: Path) -> None:
    """The launcher path SGLang uses, driven with the built-in engine's spec (no Ray involved)."""
    from relax.cluster.network import free_port

    port = free_port()
    spec = builtin_spec(
        str(tiny_preset.model_dir), "127.0.0.1", port, str(tmp_path / "engine.log"),
        weight_version=0, options=OPTIONS, name="engine_sp",
    )  # fmt: skip
    server = ServerProcess(spec)
    pid = server.start()
    try:
        server.wait_healthy(START_TIMEOUT_S)
        asyncio.run(exercise_engine(server.url))
    finally:
        code = server.stop(grace_s=15)
    assert code is not None
    wait_for(lambda: pid_gone(pid), 15, "the engine process to exit")


def test_engine_actor_in_a_placement_group(ray_cluster, tiny_preset, tmp_path: Path) -> None:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from relax.engines.actor import spawn_engine_actor

    @ray.remote(num_cpus=0)
    class EvictionRecorder:
        def __init__(self) -> None:
            self.ids: list[str] = []

        def notify_eviction(self, engine_id: str) -> None:
            self.ids.append(engine_id)

        def seen(self) -> list[str]:
            return list(self.ids)

    pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
    recorder = EvictionRecorder.remote()
    actor = None
    try:
        ray.get(pg.ready(), timeout=60)
        actor = spawn_engine_actor(
            "engine_7", "builtin", str(tiny_preset.model_dir),
            placement_group=pg, bundle_index=0, options=OPTIONS, weight_version=0,
            log_dir=str(tmp_path), startup_timeout_s=START_TIMEOUT_S,
            on_eviction=recorder.notify_eviction,  # or the pair (recorder, "notify_eviction")
        )  # fmt: skip
        info = ray.get(actor.start.remote(), timeout=START_TIMEOUT_S + 30)
        assert info["engine_id"] == "engine_7"
        assert info["url"].startswith("http://127.0.0.1:")
        assert info["node_id"] == ray.get_runtime_context().get_node_id()
        assert info["pid"] > 0 and Path(info["log_path"]).is_file()
        assert ray.get(actor.start.remote()) == info  # idempotent
        assert ray.get(actor.url.remote()) == info["url"]
        assert ray.get(actor.is_alive.remote()) is True
        # The actor holds the bundle's GPU, so Ray handed its device to the server process.
        env = Path(f"/proc/{info['pid']}/environ").read_bytes().split(b"\0")
        assert any(e.startswith(b"CUDA_VISIBLE_DEVICES=") and len(e) > len(b"CUDA_VISIBLE_DEVICES=") for e in env)

        asyncio.run(exercise_engine(info["url"]))

        # Eviction: SIGTERM to the actor process notifies the manager and keeps the engine serving.
        os.kill(info["actor_pid"], signal.SIGTERM)
        wait_for(lambda: ray.get(recorder.seen.remote()) == ["engine_7"], 30, "the eviction notice")
        assert ray.get(actor.is_alive.remote()) is True
        asyncio.run(exercise_engine(info["url"]))

        code = ray.get(actor.shutdown.remote(grace_s=15), timeout=60)
        assert code is not None
        wait_for(lambda: pid_gone(info["pid"]), 15, "the engine process to exit")
        assert ray.get(actor.is_alive.remote()) is False
        assert ray.get(actor.shutdown.remote()) == code  # idempotent

        # A second SIGTERM means "now": the actor stops whatever is left and its worker exits.
        os.kill(info["actor_pid"], signal.SIGTERM)
        wait_for(lambda: pid_gone(info["actor_pid"]), 30, "the actor process to exit")
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.is_alive.remote(), timeout=30)
    finally:
        if actor is not None:
            ray.kill(actor)
        ray.kill(recorder)
        remove_placement_group(pg)
    wait_for(lambda: placement_group_table(pg)["state"] == "REMOVED", 30, "the placement group removal")


# A stand-in `sglang.launch_server` module: logs its argv and answers the health check, so the actor's
# SGLang path (command, ports, env, health wait) runs for real without CUDA.
FAKE_SGLANG = """
import http.server, sys
args = sys.argv[1:]
print("fake sglang argv:", " ".join(args), flush=True)
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer((host, port), H).serve_forever()
"""


def test_sglang_backend_path_and_ray_kill_ends_the_server(ray_cluster, tmp_path: Path) -> None:
    import ray

    from relax.engines.actor import spawn_engine_actor
    from relax.engines.sglang import SGLangOptions

    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_SGLANG)
    # installed as far as package metadata goes: the actor checks the version before it starts SGLang
    metadata = tmp_path / "fake" / "sglang-0.5.23.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    actor = spawn_engine_actor(
        "engine_sgl", "sglang", "/models/qwen3-4b", num_gpus=1, num_cpus=0,
        options=SGLangOptions(mem_fraction_static=0.7, extra_args=("--dtype", "bfloat16")),
        weight_version=2, env={"PYTHONPATH": str(tmp_path / "fake")},
        log_dir=str(tmp_path), startup_timeout_s=60,
    )  # fmt: skip
    try:
        info = ray.get(actor.start.remote(), timeout=90)
        logged = Path(info["log_path"]).read_text()
        for expected in (
            f"--port {info['port']}",
            "--tp-size 1",
            "--mem-fraction-static 0.7",
            "--enable-metrics",
            "--weight-version 2",
            "--nccl-port",
            "--dtype bfloat16",
        ):
            assert expected in logged
        assert ray.get(actor.is_alive.remote()) is True
        import psutil

        (server,) = psutil.Process(info["pid"]).children()  # info["pid"] is its guard (relax.engines.guard)
    finally:
        ray.kill(actor)
    # Ray SIGKILLs a dead worker's children (the guard); a server that does not watch its parent (SGLang, this
    # stand-in) must not outlive them.
    wait_for(lambda: pid_gone(info["pid"]) and pid_gone(server.pid), 30, "the server to die with its actor")


def test_launch_failure_quotes_the_server_log(ray_cluster, tmp_path: Path) -> None:
    import ray

    from relax.engines.actor import spawn_engine_actor

    actor = spawn_engine_actor(
        "engine_bad", "builtin", str(tmp_path / "no-such-model"),
        num_gpus=0, num_cpus=0, log_dir=str(tmp_path), startup_timeout_s=60,
    )  # fmt: skip
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(actor.start.remote(), timeout=120)
        cause = info.value.cause
        assert isinstance(cause, ServerLaunchError)
        assert cause.exit_code not in (None, 0)
        assert "has no config.json" in cause.log_tail  # what the server printed before exiting
        assert "has no config.json" in str(info.value)
        assert "engine_bad" in str(cause)
        assert ray.get(actor.is_alive.remote()) is False
    finally:
        ray.kill(actor)


def test_sglang_missing_or_too_old_is_one_line_before_anything_starts(ray_cluster, tmp_path: Path) -> None:
    import ray

    from relax.engines.actor import spawn_engine_actor
    from relax.engines.sglang import SGLangVersionError

    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "launch_server.py").write_text(FAKE_SGLANG)
    metadata = tmp_path / "fake" / "sglang-0.4.9.dist-info"  # before --weight-version existed
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.4.9\n")
    actor = spawn_engine_actor(
        "engine_old", "sglang", "/models/qwen3-4b", num_gpus=1, num_cpus=0,
        env={"PYTHONPATH": str(tmp_path / "fake")}, log_dir=str(tmp_path), startup_timeout_s=60,
    )  # fmt: skip
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(actor.start.remote(), timeout=120)
        assert isinstance(info.value.cause, SGLangVersionError)
        message = str(info.value.cause)
        assert "SGLang 0.4.9 is installed" in message and "\n" not in message
        assert not list(tmp_path.glob("engine_old-*.log"))  # no server was started
    finally:
        ray.kill(actor)
