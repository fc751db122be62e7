"""When a streaming client that stopped reading is given up on (pure: the clock and the environment are the
caller's).

A stream's bytes go out through the connection's send buffers; once they are full, writing the next chunk
waits until the client reads. A client that never reads again (a hung process, a debugger, a peer whose host
vanished behind a NAT) would make that write wait forever, holding its requests in the engine and the
connection open. So a write may wait for the client at most the stream stall timeout
(``ServerArgs.stream_stall_timeout``; unless given, ``RELAX_ENGINE_STREAM_STALL_TIMEOUT`` or 20 s): then the
stream is stalled, its requests are aborted and its connection closed (``stream_response``).

What counts is how long *one* write waits. A write that completes means the client read something (the
buffers drained), so a slow but live reader is never stalled however long its stream runs; and the time the
stream waits for the engine (a long prefill, a paused engine) is not the client's and does not count.

The default, 20 s, is SGLang's own verdict on silence: its health check declares a server dead after 20 s
without an answer (``SGLANG_HEALTH_CHECK_TIMEOUT``). A live client's read pauses (a garbage collection, a
busy event loop, a burst of other streams) are far shorter than that, and a dead one should cost no more
than a health check's patience.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_STREAM_STALL_TIMEOUT_S", "STREAM_STALL_TIMEOUT_ENV", "StallBound", "stall_timeout_from_env"]

DEFAULT_STREAM_STALL_TIMEOUT_S = 20.0
#: Where the bound is read from when the server is not given one (seconds; 0 = never give up).
STREAM_STALL_TIMEOUT_ENV = "RELAX_ENGINE_STREAM_STALL_TIMEOUT"


@dataclass(frozen=True)
class StallBound:
    """How long one write of a stream may wait for its client; ``0`` means forever (the check is off)."""

    seconds: float = DEFAULT_STREAM_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"the stream stall timeout must be a finite number of seconds >= 0 (0: never), "
                             f"got {self.seconds!r}")

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def deadline(self, waiting_since: float) -> float | None:
        """When a write that began at ``waiting_since`` turns the stream stalled; None: never."""
        return waiting_since + self.seconds if self.enabled else None

    def stalled(self, waiting_since: float | None, now: float) -> bool:
        """Whether a write waiting since ``waiting_since`` (None: no write waits) has waited too long at ``now``."""
        deadline = None if waiting_since is None else self.deadline(waiting_since)
        return deadline is not None and now >= deadline


def stall_timeout_from_env(env: Mapping[str, str] | None = None) -> float:
    """The bound the server uses when it is not given one: ``RELAX_ENGINE_STREAM_STALL_TIMEOUT`` or 20 s.

    A value that is not a number of seconds >= 0 is refused (the server does not start), never read as the
    default: a bound someone set and mistyped must not silently become another one.
    """
    raw = (os.environ if env is None else env).get(STREAM_STALL_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_STREAM_STALL_TIMEOUT_S
    try:
        return StallBound(float(raw)).seconds
    except ValueError:
        raise ValueError(f"{STREAM_STALL_TIMEOUT_ENV}={raw!r}: expected seconds (a number >= 0; 0: never)") from None
