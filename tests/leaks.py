"""The suite checks itself: no engine server, guard or Ray process it started may outlive it.

At the end of the session every process that the suite started and that is still alive — a descendant
of pytest, or an orphan (re-parented) created since the session began whose command line is Relax's or
Ray's — fails the run, named with its command line and, where its environment says so, the test that
was running when its process tree was started. The leftovers are then killed, by pid.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

PATTERNS = ("sglang", "relax.engines.guard", "relax.cli engine serve", "relax.cli", "ray::", "raylet", "gcs_server",
            "dashboard", "runtime_env", "log_monitor", "monitor.py", "default_worker.py", "relax.entrypoints")


@dataclass(frozen=True)
class Leftover:
    pid: int
    cmdline: str
    test: str | None

    def describe(self) -> str:
        started = f" (started during {self.test})" if self.test else ""
        return f"pid {self.pid}: {self.cmdline[:160]}{started}"


def _ours(proc: psutil.Process, descendants: set[int], since: float) -> bool:
    try:
        if proc.pid in descendants:
            return proc.status() != psutil.STATUS_ZOMBIE
        if proc.create_time() < since or proc.status() == psutil.STATUS_ZOMBIE:
            return False
        parent = proc.parent()
        orphaned = parent is None or parent.pid == 1 or parent.name() in ("tini", "dumb-init", "init")
        if not orphaned:
            return False
        cmd = " ".join(proc.cmdline())
        if any(p in cmd for p in PATTERNS):
            return True
        try:  # anything that inherited pytest's environment is the suite's, whatever it runs
            return "PYTEST_CURRENT_TEST" in proc.environ()
        except (psutil.AccessDenied, psutil.ZombieProcess):
            return False
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def find_leftovers(since: float) -> list[Leftover]:
    me = psutil.Process()
    descendants = {p.pid for p in me.children(recursive=True)}
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me.pid or not _ours(proc, descendants, since):
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
