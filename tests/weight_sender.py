"""What a trainer's rank-0 ``WeightSender`` holds, read the way the weight tests check it.

The product never asks (the rollout manager learns a version is gone when ``acquire`` refuses it), so this is the
tests' reading of the sender's state, not a method of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax.training.sender import WeightSender


def held_versions(sender: WeightSender) -> list[int]:
    """The versions ``sender`` holds for broadcast, oldest first."""
    with sender._lock:
        return sorted(sender._versions)
