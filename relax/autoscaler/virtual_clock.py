"""An asyncio event loop on simulated time, so async shells can be replayed at CPU speed.

The autoscaler simulator drives the real scale executor, whose bring-ups, deadlines and drains are
``asyncio`` sleeps and timeouts. On this loop the clock stands still while anything is ready to run and
jumps straight to the next timer when nothing is: an hour of simulated start-ups and drains takes
milliseconds, and the order of events is exactly reproducible (no wall clock anywhere).

Only for code that waits on timers; a coroutine waiting for I/O would stall the clock forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual; idle time is skipped by moving the clock to the earliest scheduled timer.

    Relies on two attributes of CPython's ``BaseEventLoop`` (``_ready``, the callbacks due now, and
    ``_scheduled``, the timer heap), stable since Python 3.4; the simulator's tests fail loudly if they change.
    """

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._virtual_now = float(start)

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        ready: Any = getattr(self, "_ready")  # noqa: B009 - private by necessity, see the class docstring
        scheduled: Any = getattr(self, "_scheduled")  # noqa: B009
        if not ready and scheduled:
            self._virtual_now = max(self._virtual_now, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]


def run_virtual(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop` and close it."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


__all__ = ["VirtualTimeLoop", "run_virtual"]
