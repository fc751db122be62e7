"""Callers without a secret are answered at a bounded pace.

``/health``, ``/health_generate`` and ``/metrics`` need no secret (probes and Prometheus scrapes come without
one), so anyone on the host may call them as fast as they like. Sharing one answer among concurrent callers
(:mod:`relax.single_flight`) makes each answer cheap, but not free: on a 2-core host, 32 keep-alive scrapers
got about 900 answers a second out of the control plane, and parsing and answering them alone cost a third of
training's steps. Refusals are no cheaper: the same flood asking a guarded route without the secret got 3,600
401s a second from the control plane (−28 % steps) and 2,700 from an engine (−69 %). No legitimate caller
without a secret needs that: Prometheus scrapes every 15 s, a liveness probe comes every few seconds, and a
client that forgot its token needs one 401. So a server that has a secret answers requests without it at most
:data:`RATE_PER_S` a second (after a burst of :data:`BURST`), on every path. A server without one paces nothing:
every route is open to all there, and pacing would slow its own callers and stop no one. A caller
over the pace waits for its turn instead of being answered at once, which slows a flood down to the pace
without failing a well-behaved caller that happens to arrive in it.

A caller whose turn is more than :data:`MAX_WAIT_S` away is not queued: it gets ``503`` with ``Retry-After``
after waiting that long (waiting first, so that a flood of refused callers asks at most once per
``MAX_WAIT_S`` each, rather than as fast as it can read refusals). Requests that carry a valid secret (Relax's
own health probes send the engine's key; ``relax monitor`` and a Prometheus job configured with the run's token
send it) are never paced: a flood of anonymous callers cannot starve the run's own checks.

The rule is the generic cell rate algorithm (a leaky bucket kept as one number, the *theoretical arrival
time*): :func:`next_turn` is pure; :class:`Pace` keeps that number and waits; :class:`PaceAnonymous` is the
ASGI middleware both servers put in front of their routes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["BURST", "MAX_WAIT_S", "RATE_PER_S", "Pace", "PaceAnonymous", "Turn", "next_turn"]

#: Answers per second to callers without a secret, after a burst.
RATE_PER_S = 20.0
#: Answers given at once, before the pace holds callers back (a scrape of every target, a few probes).
BURST = 20
#: The longest a caller waits for its turn; beyond, it is refused (503) after waiting this long.
MAX_WAIT_S = 5.0


@dataclass(frozen=True)
class Turn:
    """A caller's turn: answered after ``wait_s``, or refused (``admitted`` false) after ``wait_s``."""

    admitted: bool
    wait_s: float
    free_at: float  # the pace's theoretical arrival time after this caller


def next_turn(*, now: float, free_at: float, interval_s: float, burst: int, max_wait_s: float) -> Turn:
    """The turn of a caller arriving at ``now`` when the pace's theoretical arrival time is ``free_at``.

    Each answer moves ``free_at`` on by ``interval_s`` (never from a point in the past: idle time is not saved
    up beyond the burst); a caller is answered as soon as ``free_at`` is within ``burst`` answers of it. A
    caller that would wait longer than ``max_wait_s`` is refused, takes no turn, and is told so after
    ``max_wait_s``."""
    start_from = max(free_at, now)
    wait_s = max(0.0, start_from - (burst - 1) * interval_s - now)
    if wait_s > max_wait_s:
        return Turn(admitted=False, wait_s=max_wait_s, free_at=free_at)
    return Turn(admitted=True, wait_s=wait_s, free_at=start_from + interval_s)


class Pace:
    """``await pace.turn()``: True when the caller may be answered now, False when it is refused.

    Counters for the servers' own metrics and the tests: ``answered`` (admitted at once or after waiting),
    ``waited`` (admitted after a wait), ``refused``."""

    def __init__(self, rate_per_s: float = RATE_PER_S, burst: int = BURST, max_wait_s: float = MAX_WAIT_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        if rate_per_s <= 0 or burst < 1 or max_wait_s < 0:
            raise ValueError(f"a pace needs rate_per_s > 0, burst >= 1 and max_wait_s >= 0, "
                             f"got {rate_per_s}, {burst}, {max_wait_s}")
        self.interval_s = 1.0 / rate_per_s
        self.burst = burst
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._sleep = sleep
        self._free_at = -math.inf
        self.answered = 0
        self.waited = 0
        self.refused = 0

    async def turn(self) -> bool:
        turn = next_turn(now=self._clock(), free_at=self._free_at, interval_s=self.interval_s,
                         burst=self.burst, max_wait_s=self.max_wait_s)
        self._free_at = turn.free_at  # taken before waiting: callers arriving meanwhile queue behind it
        if turn.wait_s > 0:
            await self._sleep(turn.wait_s)
        if not turn.admitted:
            self.refused += 1
            return False
        self.answered += 1
        self.waited += turn.wait_s > 0
        return True


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class PaceAnonymous:
    """ASGI middleware of a server that has a secret: HTTP requests that ``trusted`` does not accept, whatever
    their path, wait for their turn of ``pace``; a refused one gets ``refusal(message)`` with ``Retry-After``.

    ``trusted(authorization)`` gets the ``Authorization`` header (None when absent) and says whether it carries
    a secret of this server. Every other request passes straight through."""

    def __init__(self, app: AsgiApp, *, pace: Pace, trusted: Callable[[str | None], bool],
                 refusal: Callable[[str, int], AsgiApp]) -> None:
        self.app = app
        self.pace = pace
        self._trusted = trusted
        self._refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._trusted(_authorization(scope.get("headers", ()))):
            await self.app(scope, receive, send)
            return
        if await self.pace.turn():
            await self.app(scope, receive, send)
            return
        rate = 1.0 / self.pace.interval_s
        message = (f"too many requests without a token: they are answered {rate:g} a second in all; ask less "
                   f"often, or send 'Authorization: Bearer <token>' to skip the queue")
        await self._refusal(message, math.ceil(self.pace.max_wait_s))(scope, receive, send)


def _authorization(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None
