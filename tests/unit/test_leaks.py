"""The suite's leak check finds what outlived its owner, and only that."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from tests import leaks


def _orphan(marker: str | None) -> int:
    """A shell that starts a "guard" in the background and exits at once: the guard is re-parented."""
    env = {k: v for k, v in os.environ.items() if k != leaks.SESSION_ENV}
    if marker is not None:
        env[leaks.SESSION_ENV] = marker
    script = "import time; time.sleep(30)  # relax.engines.guard"
    out = subprocess.run(["sh", "-c", f'{sys.executable} -c "{script}" relax.engines.guard >/dev/null 2>&1 & echo $!'],
                         capture_output=True, text=True, timeout=10, env=env)
    return int(out.stdout.strip())


def test_another_runs_orphans_are_left_alone_whatever_they_run() -> None:
    """Another run on the host (a soak, someone's training) has the same command lines, not this session's mark."""
    since = time.time() - 1
    others = [_orphan(None), _orphan("another-session")]
    try:
        found = {x.pid for x in leaks.find_leftovers(since)}
        assert not found & set(others)
        assert {x.pid for x in leaks.find_leftovers(since, session="another-session")} >= {others[1]}
    finally:
        for pid in others:
            os.kill(pid, 9)


def test_an_orphaned_relax_process_is_found_and_a_live_descendant_too() -> None:
    since = time.time() - 1
    orphan = _orphan(os.environ[leaks.SESSION_ENV])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = {x.pid: x for x in leaks.find_leftovers(since)}
        assert orphan in found and "relax.engines.guard" in found[orphan].cmdline
        assert child.pid in found  # a descendant of the session counts whatever it runs
        leaks.kill([found[orphan]])
        deadline = time.monotonic() + 10
        while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in {x.pid for x in leaks.find_leftovers(since)}


def test_processes_older_than_the_session_are_not_ours() -> None:
    assert all(x.pid != 1 for x in leaks.find_leftovers(time.time()))
