"""The guard's wait for its server: None while it runs, its exit code once it exits, however it exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from relax.engines.guard import exit_waiter


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_running_child_times_out_then_its_exit_code_comes_back() -> None:
    child = _child("import time; time.sleep(60)")
    wait = exit_waiter(child)
    started = time.monotonic()
    assert wait(0.2) is None
    assert time.monotonic() - started >= 0.19  # it waited the timeout, not less
    child.terminate()
    assert wait(30) == -signal.SIGTERM
    assert wait(0) == -signal.SIGTERM  # asked again: the same answer, at once


def test_an_exit_code_and_a_sigkill_are_reported_as_popen_does() -> None:
    assert exit_waiter(_child("import sys; sys.exit(3)"))(30) == 3
    child = _child("import time; time.sleep(60)")
    wait = exit_waiter(child)
    child.kill()
    assert wait(30) == -signal.SIGKILL


def test_the_wait_returns_when_the_child_exits_not_at_the_timeout() -> None:
    child = _child("pass")
    started = time.monotonic()
    assert exit_waiter(child)(60) == 0
    assert time.monotonic() - started < 30  # woken by the exit (a broken wait would sleep the whole minute)
