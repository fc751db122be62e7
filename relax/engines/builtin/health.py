"""``/health`` and ``/health_generate``: one probe generation shared by every concurrent caller.

As on SGLang, a health check is a real one-token generation: it proves the engine generates, which a process
that merely answers HTTP does not. But each one costs a generation, and a flood of probers (measured: 32
concurrent ones took 39 % of the engine's throughput) must cost what one prober costs. So:

* callers arriving while a probe generation is in flight wait for *its* outcome (success or failure) instead
  of starting their own;
* a success is served again, without a generation, for ``HEALTH_REUSE_S`` (1 s) after it came — unless
  generation is held meanwhile (paused, or a weight load holds or awaits the update lock): a probe then would
  wait, and fail after the timeout, as SGLang's does, so a success from before says nothing;
* a failure is never served again: the next caller starts a new probe, so an engine that recovered (generation
  continued) is healthy again at once, and one that is wedged is found out by a probe of its own.

What a probe detects is unchanged: the generation must answer (or the engine produce any token) within the
timeout, else 503. A wedged engine is reported by the first probe started after it wedged, at most
``HEALTH_REUSE_S`` after its last success.

:func:`shared_probe` configures the one :class:`~relax.single_flight.SharedCall` (the rule is
:func:`relax.single_flight.next_step`) to these terms.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from relax.single_flight import SharedCall

__all__ = ["HEALTH_REUSE_S", "shared_probe"]

#: How long a successful probe answers for the callers after it (seconds).
HEALTH_REUSE_S = 1.0


def shared_probe(probe: Callable[[], Awaitable[None]], generation_held: Callable[[], bool],
                 reuse_s: float = HEALTH_REUSE_S, clock: Callable[[], float] = time.monotonic) -> SharedCall[None]:
    """``await shared.get()`` returns when the engine is healthy and raises the probe's error when it is not.

    ``generation_held`` says whether generation is held now (paused, a weight load has or awaits the update
    lock): it withdraws a recent success. A failure is never reused."""
    return SharedCall(probe, reuse_s, clock, reuse_failures=False, reusable=lambda: not generation_held())
