"""A server process that cannot outlive the process that started it.

``ServerProcess`` starts every engine server (SGLang or built-in) as ``python -m relax.engines.guard
--owner-pid P -- <server argv>``. The guard is the session leader of the server's process group and the
server's parent; it watches its own parent (the owner: a Ray worker holding an ``EngineActor``, or a test).
When the owner is gone, however it went (SIGKILL by the OOM killer, a raylet taking its workers down, a
driver killed by pid), the guard is re-parented and notices within ``POLL_S``; it then stops the whole
process group (SIGTERM, ``GRACE_S``, SIGKILL), so SGLang's scheduler and detokenizer children go too.

Why not only ``PR_SET_PDEATHSIG`` on the server: Linux sends it when the *thread* that forked the child
exits, not the process, and Ray runs actor methods on pool threads; a server started from one would die with
a thread. So the guard polls its owner, and sets ``PR_SET_PDEATHSIG`` on the server it forks from its own
single thread: when Ray SIGKILLs a dead worker's children (the guard among them), the server goes too. The
built-in server also runs the parent check itself (``parent_watchdog``).

Standard library only (and relax.engines.shm_leftovers, which is too), so it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from relax.engines.shm_leftovers import ShmLedger, group_pids

POLL_S = 0.5
GRACE_S = 10.0
#: The group's shared memory is noted every this many polls (a /proc scan).
NOTE_EVERY_POLLS = 4


def owner_alive(owner_pid: int) -> bool:
    """Whether our parent is still the owner (a dead owner's children are re-parented to a reaper)."""
    return os.getppid() == owner_pid


def parent_watchdog(on_orphaned: Callable[[], None], *, poll_s: float = POLL_S) -> threading.Thread:
    """A daemon thread that calls ``on_orphaned`` once when this process's parent changes."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        on_orphaned()

    thread = threading.Thread(target=watch, name="relax-parent-watchdog", daemon=True)
    thread.start()
    return thread


def _stop_group(child: subprocess.Popen[bytes], grace_s: float, ledger: ShmLedger) -> None:
    """SIGTERM the server (it stops what it forked), then SIGKILL what is left of our group, us included; the
    server's shared-memory files are swept just before that last kill."""
    pgid = os.getpgid(0)
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group kill below must not end us before it is sent
    others = group_pids(pgid) - {os.getpid()}
    for pid in others:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while group_pids(pgid) - {os.getpid()} and time.monotonic() < deadline:
        time.sleep(0.02)
    ledger.sweep()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # includes us: nothing of the group survives


def _die_with_the_guard(guard_pid: int) -> None:
    """In the server, before exec: SIGKILL when the guard dies (``PR_SET_PDEATHSIG``).

    Safe here, unlike in a Ray worker: the guard forks from its only thread, which lives as long as the guard.
    It matters because Ray SIGKILLs a dead worker's children, the guard among them, before the guard can
    stop anything; a server that does not watch its parent itself (SGLang) would then be left running.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != guard_pid:  # the guard died before the call (re-parented): nothing would signal us
        os._exit(137)


def exit_waiter(child: subprocess.Popen[bytes]) -> Callable[[float], int | None]:
    """``wait(timeout)``: the child's exit code once it has exited, None after ``timeout`` seconds if not.

    On Linux the wait sleeps in ``select`` on a pidfd, which the kernel wakes when the child exits.
    ``Popen.wait(timeout)`` instead polls ``waitpid`` up to every 50 ms: 20 wake-ups a second for the whole life
    of every engine (measured: 0.08 CPU-s a guard per 20 s, as much as everything else it does).
    """
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        def poll_wait(timeout: float) -> int | None:
            try:
                return child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        return poll_wait

    def pidfd_wait(timeout: float) -> int | None:
        if child.returncode is None:
            readable, _, _ = select.select([pidfd], [], [], timeout)
            if not readable:
                return None
        code = child.wait()  # it has exited: reaps at once
        with contextlib.suppress(OSError):
            os.close(pidfd)
        return code

    return pidfd_wait


def run(owner_pid: int, argv: Sequence[str], *, poll_s: float = POLL_S, grace_s: float = GRACE_S,
        shm_tags: Sequence[str] = ()) -> int:
    # same process group (ours), stdout/stderr inherited (the server log); the server dies with us
    die = functools.partial(_die_with_the_guard, os.getpid()) if sys.platform == "linux" else None
    child = subprocess.Popen(list(argv), preexec_fn=die)
    stopping = threading.Event()

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # what the server's processes hold in /dev/shm, noted every few polls: the guard sweeps it when it stops the
    # group for an owner that is gone (the owner's own stop sweeps otherwise; relax.engines.shm_leftovers)
    ledger = ShmLedger(tags=tuple(shm_tags))
    polls = 0
    wait = exit_waiter(child)
    while True:
        code = wait(poll_s)
        if code is not None:
            if code < 0:  # the server died of a signal: say which, then die of the same one (our owner sees it)
                print(f"relax guard: server pid {child.pid} {describe_exit(code)}", file=sys.stderr, flush=True)
                if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught or reset
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
        polls += 1
        if polls % NOTE_EVERY_POLLS == 1:
            ledger.note(os.getpgid(0))
        if not stopping.is_set() and not owner_alive(owner_pid):
            print(f"relax guard: owner pid {owner_pid} is gone; stopping server pid {child.pid} and its process "
                  "group", file=sys.stderr, flush=True)
            ledger.note(os.getpgid(0))
            _stop_group(child, grace_s, ledger)
            return 137


def describe_exit(code: int) -> str:
    """``Popen.returncode`` in words: ``exited with code 1``, or ``was killed by SIGKILL (signal 9) — out of
    memory?`` (the kernel's OOM killer and Ray's memory monitor both send SIGKILL)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " — out of memory?" if -code == signal.SIGKILL else ""
    return f"was killed by {name} (signal {-code}){hint}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax.engines.guard", description=__doc__.splitlines()[0])
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--shm-tag", action="append", default=[], help="a /dev/shm name fragment of the server's")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's argv")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command after --")
    if not owner_alive(args.owner_pid):  # the owner died before we even started
        return 137
    return run(args.owner_pid, command, shm_tags=args.shm_tag)


if __name__ == "__main__":
    raise SystemExit(main())
