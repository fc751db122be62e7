"""The driver dies the hard ways, and nothing of its run survives: by-pid SIGKILL, SIGTERM in start-up.

Real driver (``python -m relax.entrypoints.train``) with its embedded Ray cluster and two built-in engines on
the tiny preset. What a run started is found as the platform sees it: every process holding files in the
run's Ray session directory, and every engine guard/server whose command line names this run's model copy.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from relax.cluster.embedded import MARKER, clean_stale_sessions, ray_temp_root, session_processes
from relax.cluster.network import free_port
from relax.demo.local import train_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _start(preset, out: Path) -> tuple[subprocess.Popen[bytes], Path]:
    argv = train_argv(preset, out, num_rollout=1000, trainer_gpus=1, rollout_gpus=1,
                      extra=("--api-port", str(free_port())))
    log = out.parent / f"{out.name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait_log(proc: subprocess.Popen[bytes], log: Path, marker: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while marker not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{marker!r} not in the driver's log after {timeout}s"
        time.sleep(0.2)


def _session_of(pid: int) -> Path:
    (session,) = [p.parent for p in ray_temp_root().glob(f"session_*_{pid}/{MARKER}")]
    return session


def _guards_of(owners: set[int]) -> list[psutil.Process]:
    """Engine guards whose ``--owner-pid`` is one of ``owners``. Other processes on the machine (another test
    run's, a zombie) are skipped, not read: their command line may be gone by the time it is asked for."""
    found = []
    for proc in psutil.process_iter():
        try:
            argv = proc.cmdline()
            if "relax.engines.guard" in argv and int(argv[argv.index("--owner-pid") + 1]) in owners:
                found.append(proc)
        except (psutil.Error, ValueError, IndexError):
            continue
    return found


def _engine_processes(session: Path) -> list[psutil.Process]:
    """Guards (and their servers) whose owner is a worker of this run's cluster."""
    found = []
    for guard in _guards_of({p.pid for p in session_processes(session)}):
        found.append(guard)
        with contextlib.suppress(psutil.Error):
            found.extend(guard.children(recursive=True))
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _wait_none(procs_fn, timeout: float) -> float:
    began = time.monotonic()
    while procs := procs_fn():
        assert time.monotonic() - began < timeout, [p.pid for p in procs]
        time.sleep(0.2)
    return time.monotonic() - began


def _cleanup(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_driver_killed_by_pid_leaves_only_what_the_next_start_stops(tiny_preset, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, log = _start(tiny_preset, out)
    try:
        _wait_log(proc, log, "initial engine(s) ACTIVE")
        session = _session_of(proc.pid)
        engines = _engine_processes(session)
        assert len([p for p in engines if "relax.engines.guard" in p.cmdline()]) == 1
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # by pid only: nothing of the driver's code runs
        proc.wait(timeout=30)
        # the engines go with their workers (the guards see their owners die)
        engines_gone = _wait_none(lambda: _alive(engines), timeout=90)
        # Ray's raylet and workers exit by themselves in time, its two agents never (measured); whatever is left
        # at this moment, the next start stops it
        left_names = sorted(p.name() for p in _alive(session_processes(session)))
        # what the next start does first: stop the leftovers of marked sessions whose driver is gone
        stopped = clean_stale_sessions()
        # the two agents never exit by themselves: the cleanup must be what stops them (a worker that was still
        # exiting at the snapshot may be gone on its own by now, so the counts need not match)
        for agent in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"):
            if agent in left_names:
                assert any(agent in line for line in stopped), (agent, stopped)
        assert _wait_none(lambda: session_processes(session), timeout=15) < 15
        assert not (session / MARKER).exists()  # marked as cleaned: never looked at again
        print(f"driver SIGKILLed: engines gone after {engines_gone:.1f}s; left for the next start: {left_names}; "
              f"total {time.monotonic() - killed_at:.1f}s")
    finally:
        _cleanup(proc)


def test_a_driver_sigtermed_during_start_up_leaves_nothing(tiny_preset, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, log = _start(tiny_preset, out)
    try:
        _wait_log(proc, log, "placement groups ready")  # Ray is up, the engines are starting
        session = _session_of(proc.pid)
        workers = session_processes(session)
        began = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
        exited = time.monotonic() - began
        text = log.read_text(errors="replace")
        # the start is abandoned where it waits (trainer ranks, engines), not finished first
        assert code == 0 and "SIGTERM during start-up: stopping before the first step" in text, text[-3000:]
        assert "initial engine(s) ACTIVE" not in text
        assert _wait_none(lambda: session_processes(session), timeout=10) < 10
        assert _wait_none(lambda: _alive(workers), timeout=30) < 30  # incl. the engines' actors (and so the engines)
        assert not _alive(_guards_of({w.pid for w in workers}))
        assert "Traceback" not in log.read_text(errors="replace")
        print(f"driver SIGTERMed in start-up: exited (code {code}) after {exited:.1f}s, nothing left")
    finally:
        _cleanup(proc)


def test_a_trainer_rank_killed_as_the_memory_monitor_kills_ends_the_run_in_one_line(tiny_preset,
                                                                                    tmp_path: Path) -> None:
    """Ray's memory monitor (and the kernel's OOM killer) end a worker with SIGKILL. Here the rank dies while the
    driver waits for the rollout (the engine is stopped, so that wait would last the partition timeout) or, when
    the next step's samples were already in, during its train_step: the driver stops at once with one line
    naming the rank and Ray's cause, exit code 1, no traceback, and every process of the run goes."""
    out = tmp_path / "run"
    proc, log = _start(tiny_preset, out)
    frozen: list[psutil.Process] = []
    try:
        _wait_log(proc, log, "training step 2/")
        session = _session_of(proc.pid)
        # the engine's server is stopped in place (SIGSTOP): the driver's next take_step waits for its samples
        frozen = [p for p in _engine_processes(session) if p.cmdline()[2:5] == ["relax.cli", "engine", "serve"]]
        assert len(frozen) == 1
        frozen[0].suspend()
        ranks = [p for p in session_processes(session) if any("TrainerActor" in part for part in p.cmdline())]
        assert len(ranks) == 1, [p.cmdline() for p in session_processes(session)]
        workers = session_processes(session)
        killed_at = time.monotonic()
        os.kill(ranks[0].pid, signal.SIGKILL)
        _wait_log(proc, log, "training stopped: ", timeout=60)  # said before the shutdown, which the frozen
        frozen[0].resume()  # server would only slow down
        stopped_after = time.monotonic() - killed_at
        code = proc.wait(timeout=180)
        text = log.read_text(errors="replace")
        assert code == 1, text[-3000:]
        [line] = [line for line in text.splitlines() if "training stopped: " in line]
        # found by the liveness check while the driver waits for the rollout, or by train_step when samples of
        # the next step were already in (the run is asynchronous): either way one line, the rank, Ray's cause
        assert re.search(r"trainer rank 0 failed in (its liveness check|train_step): ActorDiedError", line), line
        assert "Traceback" not in text, text[-3000:]
        assert _wait_none(lambda: session_processes(session), timeout=15) < 15
        assert _wait_none(lambda: _alive(workers), timeout=30) < 30
        print(f"trainer rank SIGKILLed while the driver waited for the rollout: the run said why in "
              f"{stopped_after:.1f}s")
    finally:
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.resume()
        _cleanup(proc)
