"""Reward of the smollm2 preset's task: the last number in the response equals the label.

Why not the ``Answer: N`` line of the tiny task or DAPO: SmolLM2-135M-Instruct never writes that line
unprompted (0 of 48 sampled replies, measured), so a format-bound reward gives every sample of a group
the same score and GRPO has no signal. It does answer small additions in its own words ("7 + 7 = 14",
"The answer is 17."), correctly about a third of the time at temperature 0.7: the last number it writes
is what it claims, and a reply that rambles past its answer, lists candidates or is cut off by the length
limit ends on a different number and scores 0. So the reward teaches a short, correct final number.

Pure and total: never raises on any string (it sits on the hot path of every rollout).
"""

from __future__ import annotations

import re

from relax.data.rewards.tiny_task import score_number

__all__ = ["compute_score", "last_number"]

# An integer or decimal with optional sign; thousands separators are not numbers here ("1,000" -> 1, 000).
_NUMBER_RE = re.compile(r"[+-]?\d+(?:\.\d+)?")


def last_number(response: str) -> float | None:
    """The value of the last number written in ``response``, or ``None`` when it has none."""
    if not isinstance(response, str):
        return None
    matches = _NUMBER_RE.findall(response)
    return float(matches[-1]) if matches else None


def compute_score(response: str, label: str) -> float:
    """1.0 when the last number in ``response`` equals ``label`` numerically, else 0.0 (bad labels score 0)."""
    return score_number(last_number(response), label)
