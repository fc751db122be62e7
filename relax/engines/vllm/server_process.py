"""The vLLM server the front starts behind itself: a private directory, the process, its health, its stop.

vLLM stays in the front's process group, so the engine guard that stops the front's group
(``relax.engines.guard``) stops vLLM's API server, engine core and worker with it, however the front ends. The
front's own stop is gentler: SIGTERM to vLLM's API server (which stops its engine core and worker), then
SIGKILL to whatever of vLLM is left after the grace, then the private directory goes (vLLM never removes its
socket, and a leftover one fails the next start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psutil

log = logging.getLogger("relax.engines.vllm")


class VllmStartError(RuntimeError):
    """vLLM exited or did not answer in time; the message says which, with the end of its output where known."""


@dataclass
class VllmProcess:
    """A running vLLM API server on ``socket`` inside ``workdir`` (mode 0700, removed on stop)."""

    proc: subprocess.Popen[bytes]
    workdir: str
    socket: str

    @staticmethod
    def private_dir() -> str:
        """A fresh directory only this user can enter (``mkdtemp``'s 0700): vLLM's socket and temporary files."""
        return tempfile.mkdtemp(prefix="relax-vllm-")

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], workdir: str, socket: str) -> VllmProcess:
        proc = subprocess.Popen(argv, env=env, cwd=workdir)  # its output is the front's: one engine log
        log.info("vLLM pid=%d starting on %s", proc.pid, socket)
        return cls(proc, workdir, socket)

    async def wait_healthy(self, healthy: Callable[[], Awaitable[bool]], timeout_s: float) -> float:
        """Seconds until ``healthy()`` holds; raises :class:`VllmStartError` if vLLM exits or the time runs out."""
        began = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise VllmStartError(f"vLLM exited with code {self.proc.returncode} before it was healthy "
                                     "(its output is above in this log)")
            if os.path.exists(self.socket):
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    if await healthy():
                        return time.monotonic() - began
            if time.monotonic() - began > timeout_s:
                raise VllmStartError(f"vLLM was not healthy after {timeout_s:.0f} s (raise --startup-timeout if "
                                     "its output above shows it still loading)")
            await asyncio.sleep(0.5)  # a start-up with no event to wait on: the socket answers or it does not

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, the grace, SIGKILL to what is left of vLLM; the private directory removed. vLLM's exit code.
        A second call finds it stopped and returns the same code."""
        if self.proc.returncode is not None and not os.path.exists(self.workdir):
            return self.proc.returncode
        try:
            family = [self.proc.pid] + [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            family = [self.proc.pid]
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        _, alive = psutil.wait_procs(_live(family), timeout=max(0.0, grace_s / 3))
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)
        log.info("vLLM pid=%d stopped, exit code %s", self.proc.pid, code)
        return code


def _live(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(pid))
    return out


__all__ = ["VllmProcess", "VllmStartError"]
