"""GRPO's group-relative advantages, in plain Python.

The rollout manager computes them as each prompt's group is scored, so this module must not need torch: a
process that imports torch pays ~3 CPU-seconds and ~200 MB before its first request, and the manager has no
other use for it. A group is small (``--n-samples-per-prompt``), so plain floats cost nothing; the values
are computed in double precision and the trainer reads them as fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from relax.data.sample import PromptGroup

__all__ = ["assign_group_advantages", "group_advantages"]


def group_advantages(rewards: Sequence[float], *, scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO advantages of one group's rewards.

    ``(r - mean(group)) / (std(group) + eps)``, with the unbiased std as in DeepSeekMath and common
    implementations; ``scale_by_std=False`` keeps only the mean baseline (Dr. GRPO). A group whose
    rewards are all equal carries no learning signal and gets exactly zero advantages (not
    ``tiny / eps``); so does a single-sample group.
    """
    r = [float(x) for x in rewards]
    n = len(r)
    if n < 2 or max(r) == min(r):
        return [0.0] * n
    mean = math.fsum(r) / n
    centred = [x - mean for x in r]
    if not scale_by_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def assign_group_advantages(
    groups: Sequence[PromptGroup], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[PromptGroup]:
    """Scored groups -> the same groups with each sample's advantage set (groups may differ in size)."""
    return [g.with_advantages(group_advantages(g.rewards, scale_by_std=scale_by_std, eps=eps)) for g in groups]
