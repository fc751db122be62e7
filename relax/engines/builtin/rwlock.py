"""A writer-preferring readers-writer lock for asyncio: the one SGLang's weight updates take.

SGLang's tokenizer manager holds a *reader* lock for every generation and takes the *writer* lock for a
weight update on a server that is not paused: the update waits for every in-flight generation to end, and
a writer that waits blocks new readers (so a stream of requests cannot starve it). The built-in engine
takes the same lock the same way, so a manager that forgets to pause before loading sees, in CPU tests,
the stall a real SGLang deployment would show.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class WriterPreferringLock:
    """Many readers or one writer; once a writer waits, new readers wait behind it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @property
    def readers(self) -> int:
        return self._readers

    @asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()
