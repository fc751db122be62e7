"""The two sides of a weight-group collective (``relax.rollout.refit.broadcast._together``): the first failure or the
deadline ends both, and no outcome is left for asyncio to report as "never retrieved"."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from relax.rollout.refit.broadcast import _together


async def _unretrieved(body: Any) -> list[dict[str, Any]]:
    """Run ``body`` and collect what the loop's exception handler was told (after the garbage collector ran)."""
    import gc

    loop = asyncio.get_running_loop()
    told: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: told.append(context))
    try:
        await body()
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    return told


async def test_an_engine_that_fails_to_join_ends_the_wait_and_the_other_side_quietly() -> None:
    async def engine() -> None:
        raise ConnectionError("engine refused the group")

    async def trainer() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            raise RuntimeError("the rendezvous broke while it was cancelled")  # a side that fails on cancel

    async def body() -> None:
        with pytest.raises(ConnectionError, match="refused"):
            await _together((engine(), trainer()), 5.0, "late")

    assert await _unretrieved(body) == []


async def test_an_engine_that_never_joins_is_a_timeout_naming_it() -> None:
    async def never() -> None:
        await asyncio.sleep(60)

    async def body() -> None:
        with pytest.raises(TimeoutError, match="engine_3 did not join"):
            await _together((never(), never()), 0.05, "engine_3 did not join weight group g within 0.05s")

    assert await _unretrieved(body) == []


async def test_both_sides_done_gives_both_results_in_order() -> None:
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert await _together((value(1, 0.02), value(2, 0.0)), 5.0, "late") == [1, 2]
