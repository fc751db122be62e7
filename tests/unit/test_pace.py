"""``relax.pace``: callers without a secret are answered at a bounded pace; the run's own are not."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from relax.pace import BURST, MAX_WAIT_S, RATE_PER_S, Pace, PaceAnonymous, next_turn
from relax.rollout.control.api import create_app

# ---------------------------------------------------------------------- the rule


def _turns(arrivals: list[float], *, interval_s: float = 0.1, burst: int = 3, max_wait_s: float = 1.0) -> list[Any]:
    free_at, turns = float("-inf"), []
    for now in arrivals:
        turn = next_turn(now=now, free_at=free_at, interval_s=interval_s, burst=burst, max_wait_s=max_wait_s)
        free_at = turn.free_at
        turns.append(turn)
    return turns


def test_a_burst_is_answered_at_once_and_the_rest_one_interval_apart() -> None:
    waits = [round(t.wait_s, 6) for t in _turns([5.0] * 6)]
    assert waits == [0.0, 0.0, 0.0, 0.1, 0.2, 0.3]


def test_callers_at_the_pace_never_wait() -> None:
    assert all(t.admitted and t.wait_s == 0 for t in _turns([i * 0.25 for i in range(50)], interval_s=0.25, burst=1))


def test_idle_time_is_not_saved_up_beyond_the_burst() -> None:
    """After a long quiet spell only ``burst`` callers go at once, not one per interval of the quiet."""
    waits = [round(t.wait_s, 6) for t in _turns([0.0] + [100.0] * 5)]
    assert waits == [0.0, 0.0, 0.0, 0.0, 0.1, 0.2]


def test_a_caller_beyond_the_longest_wait_is_refused_after_it_and_takes_no_turn() -> None:
    turns = _turns([0.0] * 14, max_wait_s=1.0)  # burst 3, then waits 0.1 .. 1.0, then 1.1: refused
    assert [t.admitted for t in turns] == [True] * 13 + [False]
    assert turns[-1].wait_s == 1.0 and turns[-1].free_at == turns[-2].free_at
    # the refused caller took no turn: one arriving when the queue has moved on is admitted
    later = next_turn(now=0.2, free_at=turns[-1].free_at, interval_s=0.1, burst=3, max_wait_s=1.0)
    assert later.admitted and later.wait_s == pytest.approx(0.9)


def test_a_clock_that_went_back_never_asks_for_a_negative_wait() -> None:
    assert all(t.wait_s >= 0 for t in _turns([10.0, 9.0, 8.0, 7.0]))


def test_the_default_terms_let_probes_and_scrapes_through_and_bound_the_wait() -> None:
    assert RATE_PER_S >= 10 and BURST >= 10 and 1.0 <= MAX_WAIT_S < 10.0  # < Prometheus' default scrape timeout


@pytest.mark.parametrize("terms", [(0.0, 1, 1.0), (1.0, 0, 1.0), (1.0, 1, -1.0)])
def test_a_pace_that_could_not_answer_is_refused_at_construction(terms: tuple[float, int, float]) -> None:
    with pytest.raises(ValueError, match="a pace needs"):
        Pace(*terms)


# ---------------------------------------------------------------------- the pace, with a clock of its own


class Clock:
    """Time that stands still, or moves only as far as a caller sleeps (``advance``); ``slept`` records every
    wait asked for."""

    def __init__(self, *, advance: bool = False) -> None:
        self.now = 0.0
        self.advance = advance
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds if self.advance else 0.0
        await asyncio.sleep(0)


def _pace(clock: Clock, *, rate: float = 10.0, burst: int = 2, max_wait_s: float = 0.25) -> Pace:
    return Pace(rate, burst, max_wait_s, clock=clock, sleep=clock.sleep)


async def test_concurrent_callers_queue_and_the_ones_past_the_longest_wait_are_refused() -> None:
    clock = Clock()
    pace = _pace(clock)
    admitted = await asyncio.gather(*(pace.turn() for _ in range(6)))
    assert admitted == [True, True, True, True, False, False]
    assert clock.slept == [0.1, 0.2, 0.25, 0.25]  # the refused wait the longest wait, then hear so
    assert (pace.answered, pace.waited, pace.refused) == (4, 2, 2)


# ---------------------------------------------------------------------- in front of the routes (ASGI)

TOKEN = "the-run-token"


async def test_the_control_plane_paces_anonymous_probes_and_scrapes_but_not_its_token_holders(backend) -> None:
    clock = Clock(advance=True)
    pace = _pace(clock, burst=2, max_wait_s=0.15)
    app = create_app(backend, token=TOKEN, pace=pace)
    transport = httpx.ASGITransport(app=app)
    async with (httpx.AsyncClient(transport=transport, base_url="http://relax") as anonymous,
                httpx.AsyncClient(transport=transport, base_url="http://relax",
                                  headers={"Authorization": f"Bearer {TOKEN}"}) as operator):
        answers = [await anonymous.get(path) for path in ("/health", "/metrics", "/health")]
        assert [a.status_code for a in answers] == [200, 200, 200] and clock.slept == [0.1]
        # the token skips the queue, on open paths and others alike; it takes no turn
        for path in ("/health", "/metrics", "/rollout/engines"):
            assert (await operator.get(path)).status_code == 200
        assert clock.slept == [0.1] and pace.answered == 3
        # a wrong token is anonymous
        assert (await anonymous.get("/health", headers={"Authorization": "Bearer guess"})).status_code == 200
        assert clock.slept == [0.1, 0.1]
        clock.advance = False  # three at once: the first waits 0.1 s, the others' turns are past the longest wait
        answers = await asyncio.gather(*(anonymous.get("/metrics") for _ in range(3)))
        assert [a.status_code for a in answers] == [200, 503, 503] and clock.slept[-3:] == [0.1, 0.15, 0.15]
        refused = answers[-1]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "too many requests without a token" in refused.json()["detail"]
        assert "\n" not in refused.json()["detail"] and (pace.answered, pace.refused) == (5, 2)
        # a guarded path asked without the token is paced too: its 401 costs as much as an answer
        clock.now, clock.advance = clock.now + 1.0, True  # a quiet second: the burst is back
        answers = [await anonymous.get("/rollout/engines") for _ in range(3)]
        assert [a.status_code for a in answers] == [401, 401, 401] and clock.slept[5:] == [0.1]
        assert (await operator.get("/rollout/engines")).status_code == 200
        assert clock.slept[5:] == [0.1]  # the token holder took no turn


async def test_without_a_token_nothing_is_paced(backend) -> None:
    """Without a token every route is open to all: pacing would slow the run's own callers and stop no one."""
    clock = Clock()
    app = create_app(backend, token=None, pace=_pace(clock, burst=1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://relax") as http:
        for path in ("/health", "/metrics", "/rollout/engines") * 2:
            assert (await http.get(path)).status_code == 200
    assert clock.slept == []


async def test_the_middleware_paces_every_path_without_trust_and_lets_trusted_callers_through() -> None:
    seen: list[str] = []
    inner = FastAPI()

    @inner.get("/{path:path}")
    async def anything(path: str) -> dict[str, str]:
        seen.append(path)
        return {"path": path}

    clock = Clock()
    pace = _pace(clock, burst=1, max_wait_s=0.0)
    app = PaceAnonymous(inner, pace=pace, trusted=lambda h: h == "yes",
                        refusal=lambda message, retry: JSONResponse({"m": message}, status_code=503))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
        codes = [(await http.get(p)).status_code for p in ("/open", "/closed")]
        assert codes == [200, 503]
        assert (await http.get("/closed", headers={"Authorization": "yes"})).status_code == 200
    assert seen == ["open", "closed"] and (pace.answered, pace.refused) == (1, 1)
