"""After which weight loads an engine's served weights are checked against the trainer's publication.

One enum from the flag (``--verify-weights``) through the manager to the weight sync's rules
(``relax.rollout.refit.rules``), so the policy is spelled one way everywhere.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["VerifyPolicy"]


class VerifyPolicy(str, Enum):
    """``--verify-weights`` (docs/engine.md, "Verified refits")."""

    EVERY = "every"  # every load (the engine stays paused for the check: its cost is in every pause)
    FIRST = "first"  # an engine's first load (its join), and any repair; later loads are trusted
    OFF = "off"
