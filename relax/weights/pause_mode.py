"""How an engine is paused around a weight load: SGLang's ``/pause_generation`` modes, or not at all.

One enum from the flag (``--weight-sync-pause-mode``) through the manager to the engine client's
``paused`` bracket, so the mode is spelled one way everywhere.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["PauseMode"]


class PauseMode(str, Enum):
    """A weight load's pause (docs/architecture.md, "Weights and staleness")."""

    RETRACT = "retract"  # running requests re-encode on the new weights: no old KV cache mixed with new tokens
    IN_PLACE = "in_place"  # keep the old KV cache (cheaper; the tokens after the load attend to old-weight KV)
    ABORT = "abort"  # end in-flight requests; the router retries them from scratch
    NONE = "none"  # load unpaused: SGLang then waits for every in-flight request and blocks new ones

    @property
    def pauses(self) -> bool:
        """Whether this mode calls ``/pause_generation`` (every mode but ``none``)."""
        return self is not PauseMode.NONE

    @property
    def flushes_cache(self) -> bool:
        """Whether a weight update in this mode asks the engine to flush its prefix cache.

        Not ``in_place``: its requests stay in the running batch, and SGLang refuses a flush while any request
        runs or waits — it loads the weights, then answers 400 ("Weights were updated, but the cache was not
        flushed because requests are still running or queued", measured on 0.5.23), which reads as a failed
        update. So in ``in_place`` the prefix cache keeps entries computed on older weights, as the running
        requests keep their own KV cache: the mode's trade-off, named in docs/training.md.
        """
        return self is not PauseMode.IN_PLACE
