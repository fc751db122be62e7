"""The suite checks itself: no engine server, guard or Ray process it started may outlive it.

At the end of the session every process that the suite started and that is still alive — a descendant
of pytest, or an orphan (re-parented) created since the session began that carries this session's mark
(:data:`SESSION_ENV`, set by ``tests/conftest.py`` and inherited by everything the suite starts: Ray's daemons
and workers, engine servers and guards) — fails the run, named with its command line and, where its environment
says so, the test that was running when its process tree was started. The leftovers are then killed, by pid.

The mark, not the command line, says whose an orphan is: another run on the same host (a soak, someone else's
training) has the same command lines, and must never be killed by the suite. Ray's two agents (dashboard and
runtime env) overwrite their environment when they rename themselves, so they carry no readable mark; they exit
with the raylet they belong to, which does carry it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

#: The environment variable that marks every process of one test session (its value is the session's own).
SESSION_ENV = "RELAX_TEST_SESSION"


@dataclass(frozen=True)
class Leftover:
    pid: int
    cmdline: str
    test: str | None

    def describe(self) -> str:
        started = f" (started during {self.test})" if self.test else ""
        return f"pid {self.pid}: {self.cmdline[:160]}{started}"


def _ours(proc: psutil.Process, descendants: set[int], since: float, session: str | None) -> bool:
    try:
        if proc.pid in descendants:
            return proc.status() != psutil.STATUS_ZOMBIE
        if session is None or proc.create_time() < since or proc.status() == psutil.STATUS_ZOMBIE:
            return False
        parent = proc.parent()
        orphaned = parent is None or parent.pid == 1 or parent.name() in ("tini", "dumb-init", "init")
        return orphaned and proc.environ().get(SESSION_ENV) == session
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False  # gone, or another user's: not this session's


def find_leftovers(since: float, session: str | None = None) -> list[Leftover]:
    """This session's processes still alive: descendants of this process, and orphans created since ``since``
    that carry ``session`` (default: this process's own mark; without one, only descendants count)."""
    session = session or os.environ.get(SESSION_ENV)
    me = psutil.Process()
    descendants = {p.pid for p in me.children(recursive=True)}
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me.pid or not _ours(proc, descendants, since, session):
            continue
        try:
            cmd = " ".join(proc.cmdline())
            try:
                test = proc.environ().get("PYTEST_CURRENT_TEST")
            except (psutil.AccessDenied, psutil.ZombieProcess):
                test = None
            found.append(Leftover(proc.pid, cmd, test))
        except psutil.NoSuchProcess:
            continue
    return found


def wait_for_leftovers(since: float, grace_s: float = 20.0) -> list[Leftover]:
    """Leftovers that are still alive after ``grace_s`` (processes that are shutting down get the time)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = find_leftovers(since)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.25)


def kill(leftovers: list[Leftover]) -> None:
    for item in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(item.pid, 9)
