"""The engine's writer-preferring update lock (SGLang's), and a reader's lease given back from a plain callback."""

from __future__ import annotations

import asyncio

import pytest

from relax.engines.builtin.rwlock import WriterPreferringLock


async def _settle() -> None:
    """Let every task that can run, run (the lock's hand-offs are plain futures: a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_writer_waits_for_readers_and_new_readers_wait_behind_it() -> None:
    lock = WriterPreferringLock()
    lease = await lock.acquire_reader()
    entered = asyncio.Event()

    async def write() -> None:
        async with lock.writer():
            entered.set()

    writer = asyncio.ensure_future(write())
    await _settle()
    assert not entered.is_set() and lock.writer_pending
    late_reader = asyncio.ensure_future(lock.acquire_reader())
    await _settle()
    assert not late_reader.done()  # behind the waiting writer, though only a reader holds the lock

    lease.release()  # a plain call, not the end of an `async with`
    await asyncio.wait_for(writer, timeout=5)
    assert entered.is_set()
    (await asyncio.wait_for(late_reader, timeout=5)).release()
    assert lock._readers == 0 and not lock.writer_pending


async def test_a_lease_gives_its_slot_back_once() -> None:
    lock = WriterPreferringLock()
    first = await lock.acquire_reader()
    second = await lock.acquire_reader()
    first.release()
    first.release()  # the generation's end and the stream's end both release it
    assert lock._readers == 1
    second.release()
    assert lock._readers == 0


async def test_a_writer_that_gives_up_waiting_lets_the_readers_behind_it_in() -> None:
    lock = WriterPreferringLock()
    lease = await lock.acquire_reader()

    async def write() -> None:
        async with lock.writer():
            raise AssertionError("never gets the lock")

    writer = asyncio.ensure_future(write())
    await _settle()
    reader = asyncio.ensure_future(lock.acquire_reader())
    await _settle()
    assert not reader.done()
    writer.cancel()  # the load's caller went away
    with pytest.raises(asyncio.CancelledError):
        await writer
    (await asyncio.wait_for(reader, timeout=5)).release()
    lease.release()
    assert not lock.writer_pending and lock._readers == 0


async def test_the_reader_context_releases_on_error() -> None:
    lock = WriterPreferringLock()
    with pytest.raises(RuntimeError):
        async with lock.reader():
            assert lock._readers == 1
            raise RuntimeError("generation failed")
    assert lock._readers == 0
    async with lock.writer():
        assert lock.writer_pending
