"""``relax.single_flight``: one call for every concurrent caller, its outcome reused for ``max_age_s``."""

from __future__ import annotations

import asyncio

import pytest

from relax.single_flight import SharedCall, Step, next_step


def _step(now: float, *, running: bool = False, finished_at: float | None = None, failed: bool = False,
          reuse_failures: bool = True, reusable: bool = True) -> Step:
    return next_step(now=now, running=running, finished_at=finished_at, failed=failed, max_age_s=1.0,
                     reuse_failures=reuse_failures, reusable=reusable)


def test_an_outcome_is_reused_for_max_age_only() -> None:
    assert _step(10.0) is Step.START and _step(10.0, running=True, finished_at=9.9) is Step.JOIN
    assert _step(10.0, finished_at=10.0) is Step.REUSE and _step(10.999, finished_at=10.0) is Step.REUSE
    assert _step(11.0, finished_at=10.0) is Step.START
    assert _step(9.0, finished_at=10.0) is Step.START  # a clock that went back is not trusted


def test_the_owner_says_what_may_be_reused() -> None:
    assert _step(10.5, finished_at=10.0, failed=True) is Step.REUSE  # /metrics: an outage is not hammered
    assert _step(10.5, finished_at=10.0, failed=True, reuse_failures=False) is Step.START  # a health check
    assert _step(10.5, finished_at=10.0, reusable=False) is Step.START


async def test_concurrent_callers_share_one_call_and_later_ones_reuse_it_until_it_is_old() -> None:
    now = [0.0]
    gate = asyncio.Event()

    async def call() -> int:
        await gate.wait()
        return shared.calls

    shared = SharedCall(call, 1.0, clock=lambda: now[0])
    waiting = [asyncio.ensure_future(shared.get()) for _ in range(8)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiting) == [1] * 8 and shared.calls == 1
    now[0] = 0.5
    assert await shared.get() == 1 and shared.calls == 1
    now[0] = 1.0
    assert await shared.get() == 2 and shared.calls == 2


async def test_a_failure_is_shared_too_and_retried_once_old() -> None:
    now = [0.0]

    async def call() -> int:
        if shared.calls == 1:
            raise RuntimeError("the manager is unavailable")
        return 7

    shared = SharedCall(call, 1.0, clock=lambda: now[0])
    for _ in range(3):  # an outage is not hammered: one call, the same error for everyone
        with pytest.raises(RuntimeError, match="unavailable"):
            await shared.get()
    assert shared.calls == 1
    now[0] = 2.0
    assert await shared.get() == 7


async def test_a_caller_that_goes_away_does_not_cancel_the_call_for_the_others() -> None:
    gate = asyncio.Event()

    async def call() -> str:
        await gate.wait()
        return "done"

    shared = SharedCall(call, 1.0)
    leaver, stayer = asyncio.ensure_future(shared.get()), asyncio.ensure_future(shared.get())
    await asyncio.sleep(0)
    leaver.cancel()
    gate.set()
    assert await stayer == "done" and leaver.cancelled()
