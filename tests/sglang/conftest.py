"""The real SGLang 0.5.23, run on this machine's CPU (``make sglang-cpu``), for the tests of tests/sglang.

These tests never skip: without the SGLang venv they fail, saying how to install it. Engines are expensive here
(20-60 s to start, ~1 GB each), so one keyed engine serves every test of the session that does not stop or break
it; tests that must start their own say so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relax.engines.backends import SGLangBackend
from relax.engines.keys import EngineKeys, engine_keys, is_admin_route
from relax.engines.launcher import ServerLaunchError, ServerProcess
from relax.engines.sglang import SGLangOptions

REPO = Path(__file__).resolve().parents[2]
#: SGLang's start-up here: 19-41 s on a quiet machine, up to ~2 min under the rest of CI.
STARTUP_TIMEOUT_S = 300.0


def sglang_interpreter() -> str:
    python = os.environ.get("RELAX_SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python")
    if not os.path.exists(python):
        pytest.fail(f"no SGLang interpreter at {python}: run `make sglang-cpu` (or set RELAX_SGLANG_PYTHON)",
                    pytrace=False)
    return python


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return sglang_interpreter()


class KeyedAuth(httpx.Auth):
    """Each request carries the key its route needs: the admin key on control routes, else the generation key."""

    def __init__(self, keys: EngineKeys) -> None:
        self.keys = keys

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        key = self.keys.admin if is_admin_route(request.url.path) else self.keys.generation
        if key:
            request.headers["Authorization"] = f"Bearer {key}"
        yield request


def start_sglang(model_dir: Path, log_dir: Path, *, name: str, keys: EngineKeys = EngineKeys(),
                 extra_args: tuple[str, ...] = (), python: str | None = None,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> tuple[ServerProcess, object]:
    """A real SGLang server set up exactly as an EngineActor sets it up (the backend adapter), with ``keys``.

    Returns the server and the adapter's ``Prepared`` (release it after stopping: it holds the engine's cores).
    """
    from relax.cluster.network import free_port

    backend = SGLangBackend()
    options = SGLangOptions(python=python or sglang_interpreter(), api_key=keys.generation,
                            admin_api_key=keys.admin, extra_args=extra_args, cpu_engines_per_node=2)
    prepared = backend.prepare(options, str(model_dir), {}, cuda=False)
    port, nccl_port = free_port(), free_port()
    spec = backend.launch_spec(name, str(model_dir), "127.0.0.1", port, str(log_dir / f"{name}-{port}.log"),
                               weight_version=0, options=prepared.options, env=prepared.env, nccl_port=nccl_port)
    server = ServerProcess(spec)
    server.start()
    try:
        server.wait_healthy(timeout_s)
    except ServerLaunchError:
        server.stop()
        prepared.release()
        raise
    return server, prepared


#: The run secret the shared server's keys come from (it is ``engine_0`` of a run with this secret).
SHARED_ENGINE_SECRET = "tests-sglang-run-secret"


@pytest.fixture(scope="session")
def sglang_keys() -> EngineKeys:
    return engine_keys(SHARED_ENGINE_SECRET, "engine_0")


@pytest.fixture(scope="session")
def sglang_engine(tiny_preset, tmp_path_factory: pytest.TempPathFactory, sglang_keys: EngineKeys):
    """One real SGLang server on the tiny preset, keyed like the engines of a run; shared by the session."""
    server, prepared = start_sglang(tiny_preset.model_dir, tmp_path_factory.mktemp("sglang-logs"), name="engine_0",
                                    keys=sglang_keys)
    yield server
    server.stop()
    prepared.release()  # type: ignore[attr-defined]
