"""A writer-preferring readers-writer lock for asyncio: the one SGLang's weight updates take.

SGLang's tokenizer manager holds a *reader* lock for every generation and takes the *writer* lock for a
weight update on a server that is not paused: the update waits for every in-flight generation to end, and
a writer that waits blocks new readers (so a stream of requests cannot starve it). The built-in engine
takes the same lock the same way, so a manager that forgets to pause before loading sees, in CPU tests,
the stall a real SGLang deployment would show.

A reader's hold is a :class:`ReaderLease` that can be given back from a plain callback, not only by leaving
an ``async with``: a stream gives its slot back the moment its generation ends inside the engine, while the
bytes still travel to a client that may be slow (or has stopped reading) — what is left to send uses no
weights, so it must not keep a weight load, and every request queued behind that load, waiting.

Everything runs on one event loop, so the counters need no lock: a check and the change it allows happen
without an ``await`` between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class ReaderLease:
    """One reader's hold on a :class:`WriterPreferringLock`; :meth:`release` gives it back, once."""

    def __init__(self, lock: WriterPreferringLock) -> None:
        self._lock = lock
        self.released = False

    def release(self) -> None:
        """Give the slot back (idempotent: the stream's end and its generation's end may both call it)."""
        if not self.released:
            self.released = True
            self._lock._release_reader()


class WriterPreferringLock:
    """Many readers or one writer; once a writer waits, new readers wait behind it."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def writer_pending(self) -> bool:
        """A writer holds the lock or waits for it: no new reader gets in until it is done."""
        return self._writer or self._writers_waiting > 0

    async def acquire_reader(self) -> ReaderLease:
        await self._wait_until(lambda: not self.writer_pending)
        self._readers += 1
        return ReaderLease(self)

    @asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        lease = await self.acquire_reader()
        try:
            yield
        finally:
            lease.release()

    @asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        self._writers_waiting += 1
        try:
            await self._wait_until(lambda: not self._writer and self._readers == 0)
        except BaseException:
            self._writers_waiting -= 1
            self._wake()  # readers held behind a writer that gave up waiting may go on
            raise
        self._writers_waiting -= 1
        self._writer = True
        try:
            yield
        finally:
            self._writer = False
            self._wake()

    def _release_reader(self) -> None:
        self._readers -= 1
        self._wake()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while not ready():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)

    def _wake(self) -> None:
        """Every waiter looks again (readers and writers wait for different conditions)."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
