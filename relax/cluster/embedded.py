"""The embedded Ray cluster leaves nothing behind, and what a killed driver left is stopped next time.

A driver that starts its own cluster (``start_local``) owns a Ray session directory
(``<ray temp>/session_<date>_<pid>``). Every process of that cluster — GCS, raylet, workers, and the
dashboard and runtime-env agents — keeps log files open in it, which is how its processes are found
without guessing from names (Ray rewrites their titles to ``ray::...``).

Two paths:

* **Normal exits** (end of run, failure, SIGTERM at any moment): after ``ray.shutdown()`` the driver calls
  :func:`stop_session` on its own session; anything still holding files there after a short grace is
  stopped (measured: Ray's two agents can outlive a shutdown early in start-up, ignoring SIGTERM).
* **A driver killed by pid** (``kill -9``, the OOM killer) runs no code: its raylet and workers exit on
  their own within seconds, but the agents stay. Each embedded session is marked with
  ``relax-embedded.json`` (driver pid and start time); the next ``start_local`` finds marked sessions whose
  driver is gone and stops their processes, naming each in the log. Sessions without the marker (a
  user's own ``ray start``, another tool) are never touched.

And it stays small over days of training (:func:`embedded_system_config`, passed to ``ray.init`` as
``_system_config``): Ray's GCS keeps an event record of every task and actor call, for ``ray list tasks`` and
``ray timeline``, up to 100 000 of them by default, and once it drops records it keeps their ids, up to 1 000 000
per job. A tiny-preset step makes about a dozen actor calls, each record ~3.5 KB in the GCS: measured +6-13 MB a
minute (~40 KB a step) until it holds 100 000 (~350 MB), then slower, by the dropped ids. The embedded cluster keeps
the latest 10 000 records and 10 000 dropped ids (the GCS levels off at ~88 MB, from 50 MB at start, within
minutes); a ``RAY_<name>`` variable the user exported wins. Nothing in Relax reads task events, and an embedded
cluster has no state API anyway (its dashboard process loads no state module); ``ray timeline`` still shows the
latest calls. A cluster Relax does not start keeps Ray's defaults unless its head is started with these settings as
``RAY_<name>`` variables (:func:`embedded_ray_env`).

Nor does it start workers nobody uses: by default Ray starts idle task workers for the first driver, each a Python
process that imports Ray (~1.2 CPU-s here) and waits. Relax runs actors only, each in a worker of its own, so those
workers never serve anything: measured 3 of them in a tiny run (2 engines, 2 trainer ranks), 1 without them,
and 38 over the test suite's clusters (66 CPU-s).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

__all__ = [
    "EMBEDDED_RAY_SETTINGS",
    "MARKER",
    "clean_stale_sessions",
    "embedded_ray_env",
    "embedded_system_config",
    "mark_session",
    "session_processes",
    "stop_session",
]

log = logging.getLogger("relax.cluster")

MARKER = "relax-embedded.json"

#: Ray settings (``_system_config`` names) of an embedded cluster: what its GCS keeps per task, and no idle workers.
EMBEDDED_RAY_SETTINGS: dict[str, int | bool] = {
    # task event records kept for ``ray list tasks`` / ``ray timeline``; Ray's default 100 000 (~350 MB here)
    "task_events_max_num_task_in_gcs": 10_000,
    # ids of the records dropped above, per job; Ray's default 1 000 000
    "task_events_max_dropped_task_attempts_tracked_per_job_in_gcs": 10_000,
    # no idle task workers started for the driver: Relax runs actors, each in a worker of its own
    "prestart_worker_first_driver": False,
}


def embedded_ray_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`embedded_system_config` as the ``RAY_<name>`` variables a ``ray start`` node reads (booleans as
    ``true``/``false``)."""
    return {f"RAY_{name}": (str(value).lower() if isinstance(value, bool) else str(value))
            for name, value in embedded_system_config(environ).items()}


def embedded_system_config(environ: Mapping[str, str] | None = None) -> dict[str, int | bool]:
    """``ray.init(_system_config=...)`` for an embedded cluster: :data:`EMBEDDED_RAY_SETTINGS`, less any the user
    set as ``RAY_<name>`` in ``environ`` (Ray applies ``_system_config`` over its environment variables, so
    passing the name anyway would silently override the user's value)."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in EMBEDDED_RAY_SETTINGS.items() if f"RAY_{name}" not in env}


def ray_temp_root() -> Path:
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"


def current_session_dir() -> Path | None:
    """This process's Ray session directory (a private Ray API: None when it moves)."""
    try:
        from ray._private import worker

        node = worker._global_node  # noqa: SLF001
        return None if node is None else Path(node.get_session_dir_path())
    except Exception:  # noqa: BLE001 - best effort across Ray versions
        return None


def mark_session(session_dir: Path) -> None:
    """Record that this process owns the embedded cluster of ``session_dir``."""
    me = psutil.Process()
    (session_dir / MARKER).write_text(json.dumps({"driver_pid": me.pid, "driver_started": me.create_time()}))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def session_processes(session_dir: Path, *, exclude: set[int] | None = None) -> list[psutil.Process]:
    """Live processes holding files in ``session_dir`` or naming it on their command line."""
    root = str(session_dir.resolve())
    skip = {os.getpid(), *(exclude or set())}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(root in arg for arg in proc.cmdline()) or any(_under(f.path, root) for f in proc.open_files()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {proc.pid} {' '.join(proc.cmdline())[:80] or proc.name()}"
    return f"pid {proc.pid}"


def stop_session(session_dir: Path, *, grace_s: float = 3.0, why: str = "") -> list[str]:
    """Stop what still runs in ``session_dir`` after ``grace_s`` (SIGTERM, then SIGKILL); returns what was stopped."""
    deadline = time.monotonic() + grace_s
    left = session_processes(session_dir)
    while left and time.monotonic() < deadline:  # Ray's own shutdown may still be finishing
        time.sleep(0.2)
        left = session_processes(session_dir)
    stopped = [_describe(p) for p in left]
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=2.0)
    for proc in alive:  # the agents ignore SIGTERM once their raylet is gone
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=2.0)
    for item in stopped:
        log.warning("stopped a leftover of the embedded Ray cluster in %s%s: %s", session_dir.name,
                    f" ({why})" if why else "", item)
    return stopped


def _driver_alive(record: dict) -> bool:
    try:
        proc = psutil.Process(int(record["driver_pid"]))
        return abs(proc.create_time() - float(record["driver_started"])) < 1.0  # not a reused pid
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return False


def clean_stale_sessions(root: Path | None = None) -> list[str]:
    """Stop the processes of marked embedded sessions whose driver is gone; returns what was stopped."""
    stopped: list[str] = []
    base = root or ray_temp_root()
    for marker in sorted(base.glob(f"session_*/{MARKER}")):
        try:
            record = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if _driver_alive(record):
            continue
        stopped += stop_session(marker.parent, grace_s=0.0,
                                why=f"its driver pid {record.get('driver_pid')} is gone")
        with contextlib.suppress(OSError):
            marker.rename(marker.with_name("relax-embedded.cleaned.json"))
    return stopped
