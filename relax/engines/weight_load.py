"""Loading a weight version from a directory into a running engine: ``/update_weights_from_disk``, paused.

The object-store path (the EngineActor writes the version to its node's shared memory) and external engines
(the manager writes it where the engine can read it) both end here, inside the client's one pause bracket
(:meth:`~relax.engines.client.EngineClient.paused`). The pause is SGLang's rule, not a nicety: an unpaused
SGLang server takes a writer lock for the load that first waits for every in-flight generation (minutes at
8k-16k tokens) and blocks new ones.
"""

from __future__ import annotations

from pathlib import Path

from relax.engines.client import EngineClient, PauseWindow
from relax.weights.pause_mode import PauseMode

__all__ = ["CONTROL_TIMEOUT_S", "LOAD_BASE_S", "LOAD_MIN_BYTES_PER_S", "load_from_disk", "load_timeout_s"]

#: Control calls (pause, continue) answer at once on a healthy engine.
CONTROL_TIMEOUT_S = 60.0
#: A load may take this long plus the time to read its bytes at the slowest rate we accept.
LOAD_BASE_S = 120.0
LOAD_MIN_BYTES_PER_S = 100e6


def load_timeout_s(nbytes: int) -> float:
    """Time budget of one weight load: grows with the bytes (8 GB of Qwen3-4B bf16 -> 200 s; 0.5 GB -> 125 s)."""
    return LOAD_BASE_S + max(0, nbytes) / LOAD_MIN_BYTES_PER_S


async def load_from_disk(client: EngineClient, path: str | Path, version: int, mode: PauseMode, *,
                         nbytes: int = 0) -> PauseWindow:
    """Pause (``mode``), load ``path`` as ``version``, continue; raises (engine left paused) when the load fails."""
    async with client.paused(mode) as window:
        await client.update_weights_from_disk(str(path), version, timeout=load_timeout_s(nbytes),
                                              flush_cache=mode.flushes_cache)
    return window
