"""One real local Ray cluster per test session (ray.init costs 5-8 s on a 2-core machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from relax.cluster import scratch
    from relax.cluster.connect import start_local
    from relax.cluster.embedded import current_session_dir, stop_session

    start_local(num_gpus=8, num_cpus=8, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    session = current_session_dir()
    try:
        yield
    finally:
        ray.shutdown()
        if session is not None:
            stop_session(session, why="the test session ends")
        # What engines the tests killed left in shared memory, as a driver's exit removes its run's.
        scratch.sweep()


@pytest.fixture(scope="session")
def start_engine(tmp_path_factory: pytest.TempPathFactory):
    """Factory: start a real built-in engine subprocess on a free loopback port; all stopped at the end."""
    from relax.cluster.network import free_port
    from relax.engines.launcher import BuiltinOptions, ServerLaunchError, ServerProcess, builtin_spec

    started: list[ServerProcess] = []

    def start(model_dir, *, max_running_requests: int | None = None, max_total_tokens: int | None = None,
              weight_version: str | None = None, env: dict[str, str] | None = None,
              load_format: str | None = None) -> ServerProcess:
        logs = tmp_path_factory.mktemp("engine-logs")
        for attempt in range(3):  # the port can be taken between choosing it and the server binding it
            spec = builtin_spec(
                str(model_dir), "127.0.0.1", free_port(), str(logs / f"engine-{attempt}.log"),
                weight_version=weight_version, env=env,
                options=BuiltinOptions(max_running_requests=max_running_requests, max_total_tokens=max_total_tokens,
                                       num_threads=1, load_format=load_format),
                name=f"test-engine-{len(started)}",
            )
            proc = ServerProcess(spec)
            started.append(proc)
            proc.start()
            try:
                proc.wait_healthy(timeout=120)
                return proc
            except ServerLaunchError as exc:
                if attempt == 2 or not exc.port_was_taken:
                    raise
        raise AssertionError("unreachable")

    yield start
    for proc in started:
        proc.stop(grace_s=5)


@pytest.fixture
def logprob_tol() -> float:
    """How close served log-probs must be to a teacher-forced fp32 forward: the built-in engine serves fp32."""
    return 1e-4


@pytest.fixture(scope="session")
def perturbed(tiny_preset, tmp_path_factory):
    """(directory, HF state dict) of the preset with different weights: what a training step would publish."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_preset.model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    out = tmp_path_factory.mktemp("broadcast-v1")
    model.save_pretrained(out)
    return out, load_file(str(out / "model.safetensors"))
