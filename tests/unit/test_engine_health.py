"""Concurrent /health_generate calls share one probe generation: the rule (pure) and its coordinator."""

from __future__ import annotations

import asyncio

import pytest

from relax.engines.builtin.health import HEALTH_REUSE_S, shared_probe
from relax.single_flight import SharedCall, Step, next_step

# ---------------------------------------------------------------------- the rule, in the health check's terms


def _action(now: float, *, probing: bool = False, last_success_at: float | None = None,
            held: bool = False, failed: bool = False) -> Step:
    return next_step(now=now, running=probing, finished_at=last_success_at, failed=failed, max_age_s=1.0,
                     reuse_failures=False, reusable=not held)


def test_the_first_check_starts_a_probe() -> None:
    assert _action(10.0) is Step.START


def test_a_check_while_a_probe_runs_joins_it() -> None:
    assert _action(10.0, probing=True) is Step.JOIN
    assert _action(10.0, probing=True, held=True) is Step.JOIN  # its outcome says what generation does
    assert _action(10.0, probing=True, last_success_at=9.9) is Step.JOIN


def test_a_success_is_reused_for_a_second_and_not_a_millisecond_longer() -> None:
    assert _action(10.0, last_success_at=10.0) is Step.REUSE
    assert _action(10.999, last_success_at=10.0) is Step.REUSE
    assert _action(11.0, last_success_at=10.0) is Step.START
    assert _action(11.001, last_success_at=10.0) is Step.START


def test_a_success_says_nothing_while_generation_is_held() -> None:
    """Paused, or a weight load has (or waits for) the lock: a probe would wait and fail after the timeout."""
    assert _action(10.1, last_success_at=10.0, held=True) is Step.START


def test_a_failure_is_never_reused() -> None:
    """An engine that recovered is healthy again at once; a wedged one is found out by a probe of its own."""
    assert _action(10.1, last_success_at=10.0, failed=True) is Step.START


def test_a_success_from_a_clock_that_went_back_is_not_reused() -> None:
    assert _action(9.0, last_success_at=10.0) is Step.START


def test_the_default_reuse_is_about_a_second() -> None:
    assert 0 < HEALTH_REUSE_S <= 1.0


# ---------------------------------------------------------------------- the coordinator


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Probe:
    """A probe generation the test answers: ``release`` ends it with success or ``fail`` with an error."""

    def __init__(self) -> None:
        self.started = 0
        self.outcome: asyncio.Future[None] | None = None

    async def __call__(self) -> None:
        self.started += 1
        self.outcome = asyncio.get_running_loop().create_future()
        await self.outcome

    def release(self) -> None:
        assert self.outcome is not None
        self.outcome.set_result(None)

    def fail(self, exc: Exception) -> None:
        assert self.outcome is not None
        self.outcome.set_exception(exc)


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def _healthy_once(shared: SharedCall[None], probe: Probe) -> None:
    """One check whose probe generation succeeds."""
    first = asyncio.ensure_future(shared.get())
    await _settle()
    probe.release()
    await first


def _shared(probe: Probe, clock: Clock, held: list[bool] | None = None) -> SharedCall[None]:
    held = held if held is not None else [False]
    return shared_probe(probe, generation_held=lambda: held[0], reuse_s=1.0, clock=clock)


async def test_concurrent_checks_share_one_generation() -> None:
    probe, clock = Probe(), Clock()
    shared = _shared(probe, clock)
    checks = [asyncio.ensure_future(shared.get()) for _ in range(32)]
    await _settle()
    assert probe.started == 1 and not any(c.done() for c in checks)
    probe.release()
    await asyncio.wait_for(asyncio.gather(*checks), timeout=5)
    assert (shared.gets, shared.calls, shared.reused) == (32, 1, 0)


async def test_a_recent_success_answers_without_a_generation_then_a_new_probe_runs() -> None:
    probe, clock = Probe(), Clock()
    shared = _shared(probe, clock)
    await _healthy_once(shared, probe)
    clock.now += 0.999
    await asyncio.wait_for(shared.get(), timeout=5)  # answered at once: no probe to release
    assert probe.started == 1 and shared.reused == 1
    clock.now += 0.001
    late = asyncio.ensure_future(shared.get())
    await _settle()
    assert probe.started == 2 and not late.done()
    probe.release()
    await late


async def test_no_reuse_while_generation_is_held() -> None:
    probe, clock, held = Probe(), Clock(), [False]
    shared = _shared(probe, clock, held)
    await _healthy_once(shared, probe)
    held[0] = True  # paused right after the success
    clock.now += 0.1
    check = asyncio.ensure_future(shared.get())
    await _settle()
    assert probe.started == 2 and not check.done()  # a real probe, which waits as SGLang's would
    probe.fail(RuntimeError("did not answer"))
    with pytest.raises(RuntimeError):
        await check


async def test_a_failure_reaches_every_caller_of_its_probe_and_is_not_reused() -> None:
    probe, clock = Probe(), Clock()
    shared = _shared(probe, clock)
    # a success, then a probe that fails: the success must not answer for the engine after that
    await _healthy_once(shared, probe)
    clock.now += 5
    checks = [asyncio.ensure_future(shared.get()) for _ in range(4)]
    await _settle()
    probe.fail(TimeoutError("health generation did not answer"))
    results = await asyncio.gather(*checks, return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results) and probe.started == 2
    retry = asyncio.ensure_future(shared.get())  # at the same instant: a new probe, not the failure again
    await _settle()
    assert probe.started == 3 and not retry.done()
    probe.release()
    await retry


async def test_a_fast_failure_after_a_success_is_not_hidden_by_it() -> None:
    probe, clock = Probe(), Clock()
    shared = _shared(probe, clock)
    await _healthy_once(shared, probe)
    clock.now += 1.5
    failing = asyncio.ensure_future(shared.get())
    await _settle()
    probe.fail(RuntimeError("engine is shutting down"))
    with pytest.raises(RuntimeError):
        await failing
    clock.now += 0.01  # the earlier success is past its second anyway, and the failure wiped it
    nxt = asyncio.ensure_future(shared.get())
    await _settle()
    assert probe.started == 3
    probe.release()
    await nxt


async def test_a_caller_that_goes_away_does_not_cancel_the_probe_for_the_others() -> None:
    probe, clock = Probe(), Clock()
    shared = _shared(probe, clock)
    leaving, staying = asyncio.ensure_future(shared.get()), asyncio.ensure_future(shared.get())
    await _settle()
    leaving.cancel()
    await _settle()
    assert probe.outcome is not None and not probe.outcome.cancelled()
    probe.release()
    await asyncio.wait_for(staying, timeout=5)
    assert probe.started == 1
