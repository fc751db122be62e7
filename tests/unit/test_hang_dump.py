"""A test past its time limit ends its worker and says where it hung, also under xdist (tests/hang_dump.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HANGING = '''
import threading
import pytest

@pytest.mark.timeout(3)
def test_waits_forever():
    threading.Event().wait()  # blocks in a lock, as a hung call would
'''

HOLDING_THE_GIL = '''
import re
import pytest

@pytest.mark.timeout(3)
def test_holds_the_gil():
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: minutes in C, the GIL held throughout
'''


def run_hanging(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_hanging.py").write_text(source)
    # only the plugins at stake: schemathesis and hypothesis alone take seconds to load in each process
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist", "-p", "pytest_timeout", "-p", "tests.hang_dump",
         "-p", "no:cacheprovider", "-n", "1",
         "--max-worker-restart", "0", "-o", "timeout_method=thread", "-W", "ignore", "test_hanging.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_hung_test_ends_its_worker_with_every_stack_on_stderr(tmp_path: Path) -> None:
    result = run_hanging(tmp_path, HANGING)
    assert result.returncode == 1, result.stdout + result.stderr
    # the dump reached the worker's real stderr, pointing at the line that hung; xdist names the test
    assert "Timeout (0:00:02" in result.stderr, result.stderr
    assert 'test_hanging.py", line 7 in test_waits_forever' in result.stderr
    assert "crashed while running 'test_hanging.py::test_waits_forever'" in result.stdout


def test_a_test_stuck_in_c_with_the_gil_held_is_ended_too(tmp_path: Path) -> None:
    """pytest-timeout's timer thread needs the GIL; faulthandler's does not."""
    result = run_hanging(tmp_path, HOLDING_THE_GIL)
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'test_hanging.py", line 7 in test_holds_the_gil' in result.stderr, result.stderr
    assert "crashed while running 'test_hanging.py::test_holds_the_gil'" in result.stdout
