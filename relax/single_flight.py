"""One call shared by every concurrent caller, its outcome reused for a short while.

Open endpoints are cheap to call and can be expensive to answer: each control-plane ``/metrics`` scrape asks
the rollout manager through Ray, each engine ``/health_generate`` runs a generation. A flood of callers (32
Prometheus replicas, a misconfigured prober) must cost what one caller costs, so the answer is computed at
most once per ``max_age_s``: callers arriving while it is being computed wait for that computation, and
callers arriving shortly after get its outcome.

Whether an outcome may be reused is the owner's to say: ``/metrics`` reuses a failure too (an outage is not
hammered), a health check never does (an engine that recovered is healthy at once), and ``reusable`` can
withdraw a success early (an engine paused since its last probe must be probed again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Generic, TypeVar

__all__ = ["SharedCall", "Step", "next_step"]

T = TypeVar("T")


class Step(str, Enum):
    JOIN = "join"  # a call is in flight: wait for its outcome
    REUSE = "reuse"  # the last outcome is recent and may be reused: no call
    START = "start"  # run the call


def next_step(*, now: float, running: bool, finished_at: float | None, failed: bool, max_age_s: float,
              reuse_failures: bool, reusable: bool) -> Step:
    """What a caller arriving at ``now`` does.

    An answer in the making is fresher than one given, so a call in flight is joined first. A finished outcome
    is reused while younger than ``max_age_s`` (a clock that went back is not trusted), if it may be (a failure
    only with ``reuse_failures``; nothing when the owner says ``reusable`` is false)."""
    if running:
        return Step.JOIN
    if (finished_at is not None and reusable and (reuse_failures or not failed)
            and 0.0 <= now - finished_at < max_age_s):
        return Step.REUSE
    return Step.START


class SharedCall(Generic[T]):
    """``await shared.get()``: the outcome of one ``call()`` shared by all callers, per :func:`next_step`.

    The shared call runs as its own task, so a caller that goes away (a scraper that disconnects and cancels
    its request) does not cancel it for the others waiting on it. The counters show what the sharing saves."""

    def __init__(self, call: Callable[[], Awaitable[T]], max_age_s: float,
                 clock: Callable[[], float] = time.monotonic, *, reuse_failures: bool = True,
                 reusable: Callable[[], bool] = lambda: True) -> None:
        self._call = call
        self._max_age_s = max_age_s
        self._clock = clock
        self._reuse_failures = reuse_failures
        self._reusable = reusable
        self._task: asyncio.Task[T] | None = None
        self._finished_at: float | None = None
        self.gets = 0  # callers answered or waiting
        self.calls = 0  # calls actually run
        self.reused = 0  # callers answered by an earlier outcome, without a call

    async def get(self) -> T:
        self.gets += 1
        task = self._task
        running = task is not None and not task.done()
        failed = task is not None and task.done() and (task.cancelled() or task.exception() is not None)
        step = next_step(now=self._clock(), running=running, finished_at=self._finished_at, failed=failed,
                         max_age_s=self._max_age_s, reuse_failures=self._reuse_failures,
                         reusable=self._reusable())
        if step is Step.REUSE:
            self.reused += 1
        elif step is Step.START:
            task = self._task = asyncio.ensure_future(self._run())
            # every caller may have gone away: the outcome is still retrieved, so a failure is not reported
            # as "exception was never retrieved"
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        assert task is not None
        return await asyncio.shield(task)

    async def _run(self) -> T:
        self.calls += 1
        self._finished_at = None  # what this call finds supersedes any earlier outcome
        try:
            return await self._call()
        finally:
            self._finished_at = self._clock()
