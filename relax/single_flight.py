"""One call shared by every concurrent caller, its outcome reused for a short while.

Open endpoints are cheap to call and can be expensive to answer: each control-plane ``/metrics`` scrape asks
the rollout manager through Ray, each ``/health_generate`` runs a generation. A flood of callers (32
Prometheus replicas, a misconfigured prober) must cost what one caller costs, so the answer is computed at
most once per ``max_age_s``: callers arriving while it is being computed wait for that computation, and
callers arriving shortly after get its outcome — a failure included, so an outage is not hammered either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["SharedCall", "is_fresh"]

T = TypeVar("T")


def is_fresh(finished_at: float | None, now: float, max_age_s: float) -> bool:
    """Whether an outcome finished at ``finished_at`` may still be served at ``now``."""
    return finished_at is not None and 0.0 <= now - finished_at < max_age_s


class SharedCall(Generic[T]):
    """``await shared.get()``: the outcome of one ``call()`` shared by all callers within ``max_age_s``.

    The shared call runs as its own task, so a caller that goes away (a scraper that disconnects and
    cancels its request) does not cancel it for the others waiting on it."""

    def __init__(self, call: Callable[[], Awaitable[T]], max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._call = call
        self._max_age_s = max_age_s
        self._clock = clock
        self._task: asyncio.Task[T] | None = None
        self._finished_at: float | None = None
        self.calls = 0  # how many times the call actually ran: what the sharing saves is visible

    async def get(self) -> T:
        task = self._task
        if task is None or (task.done() and not is_fresh(self._finished_at, self._clock(), self._max_age_s)):
            task = self._task = asyncio.ensure_future(self._run())
            # every caller may have gone away: the outcome is still retrieved, so a failure is not reported
            # as "exception was never retrieved"
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(task)

    async def _run(self) -> T:
        self.calls += 1
        try:
            return await self._call()
        finally:
            self._finished_at = self._clock()
