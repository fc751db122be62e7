"""Per-run scratch space on each node: run-unique, leased by the processes that use it, never shared.

Why: weight copies for the engines live in shared memory (``/dev/shm``: RAM, so a load costs no disk I/O).
With one fixed directory, two runs on a node overwrote each other's versions and each run's clean-up
deleted the other's files; after a crash the copies stayed in RAM for good.

The rules:

* **Run-unique.** Every run gets ``<base>/relax-run-<run id>/``: the driver draws the id
  (:func:`new_run_id`) and hands it to every process of the run as ``RELAX_RUN_ID``; a process outside a
  run (a bare engine actor) gets one of its own.
* **Leased.** A process that uses the directory holds a shared ``flock`` on its ``.lease`` file for as
  long as it lives; the kernel drops it when the process dies, however it dies (SIGKILL and OOM included).
  No pids to compare, no clocks, nothing that breaks across hosts: each node's directory is leased by the
  processes on that node.
* **Removed by the last one out.** :func:`release` drops this process's lease and removes the directory if
  no other process holds one; :func:`sweep` removes every ``relax-run-*`` directory nobody leases — at the
  start of a run (what a crash left), when an engine first uses scratch on a node, and at the driver's exit.
  Only directories with Relax's name *and* its lease file are touched, and each removal is logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["LEASE", "OWNER", "PREFIX", "RUN_ID_ENV", "SCRATCH_DIR_ENV", "claim", "held", "new_run_id", "release",
           "run_dir", "run_id", "scratch_base", "sweep", "weights_root"]

log = logging.getLogger("relax.cluster")

PREFIX = "relax-run-"
LEASE = ".lease"
RUN_ID_ENV = "RELAX_RUN_ID"
SCRATCH_DIR_ENV = "RELAX_SCRATCH_DIR"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")

OWNER = ".relax-owner"  # in a run's output directory: who writes there now

_lock = threading.Lock()
_claims: dict[Path, int] = {}  # output directories this process writes, exclusively locked
_held: dict[Path, int] = {}  # run directory -> fd of its lease file, shared-locked by this process


def scratch_base() -> Path:
    """``RELAX_SCRATCH_DIR``, else ``/dev/shm`` when writable (RAM-backed), else the temp dir."""
    given = os.environ.get(SCRATCH_DIR_ENV)
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def run_id() -> str:
    """This run's id: ``RELAX_RUN_ID`` (the driver sets it for every process of the run), else this process's."""
    given = os.environ.get(RUN_ID_ENV)
    if given:
        return _SAFE.sub("-", given)[:80]
    return f"pid{os.getpid()}"


def new_run_id() -> str:
    """A fresh id for a driver to hand to its run: readable (start time, pid) and unique (random suffix)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def run_dir(base: Path | None = None, run: str | None = None) -> Path:
    """This run's scratch directory on this node, created and leased by this process on first use."""
    root = (base or scratch_base()) / f"{PREFIX}{run or run_id()}"
    with _lock:
        if root in _held:
            return root
        first = not root.exists()
        if first:
            sweep(base or scratch_base())  # the first user on a node clears what crashed runs left here
        _held[root] = _lease(root)
    if first:
        log.info("run scratch %s (leased by pid %d)", root, os.getpid())
    return root


def weights_root(engine_id: str) -> Path:
    """``<run scratch>/weights/<engine_id>``: where an engine's weight copies go (``relax.weights.buckets``
    writes them), this run's own leased directory in shared memory, so two runs on one node never touch each
    other's copies and a crashed run's copies are swept by the next one."""
    return run_dir() / "weights" / engine_id


def _lease(root: Path) -> int:
    """Open and share-lock ``root/.lease``, retrying if a sweeper removed the directory meanwhile."""
    for _ in range(20):
        root.mkdir(parents=True, exist_ok=True)
        path = root / LEASE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while a sweeper holds it exclusively (it is removing it)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the sweeper won: our lock is on a file that no longer exists; start again
    raise RuntimeError(f"could not lease the run scratch directory {root}")


def held() -> list[Path]:
    """The run directories this process leases now."""
    with _lock:
        return list(_held)


def release(root: Path | None = None) -> list[Path]:
    """Drop this process's lease on ``root`` (default: every one it holds); remove each no one else holds."""
    removed: list[Path] = []
    with _lock:
        roots = [root] if root is not None else list(_held)
        for r in roots:
            fd = _held.pop(r, None)
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # converts our shared lock: only if we were last
            except OSError:
                os.close(fd)
                continue
            shutil.rmtree(r, ignore_errors=True)
            os.close(fd)
            removed.append(r)
            log.info("run scratch %s removed (last user, pid %d)", r, os.getpid())
    return removed


def sweep(base: Path | None = None) -> list[Path]:
    """Remove every Relax run directory under ``base`` that no live process leases; returns them."""
    base = base or scratch_base()
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        lease = entry / LEASE
        if not entry.name.startswith(PREFIX) or entry in _held or not lease.is_file():
            continue
        try:
            fd = os.open(lease, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live process of that run holds it
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed abandoned run scratch %s (no live process leases it)", entry)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return removed


def claim(directory: Path) -> str | None:
    """Make ``directory`` this process's alone for as long as it lives; None, or why another process has it.

    A run's output directory (metrics, summary, engine logs) must not be shared by two live runs: their
    rows would interleave. An exclusive ``flock`` on ``directory/.relax-owner`` (with the holder's pid in it,
    for the message) says so at start-up; the kernel drops it when the holder dies, so a crashed run never
    blocks the next one. Idempotent within a process.
    """
    directory = directory.resolve()
    with _lock:
        if directory in _claims:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / OWNER
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            return f"{directory} is in use by another live run (pid {holder})"
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _claims[directory] = fd
        return None
