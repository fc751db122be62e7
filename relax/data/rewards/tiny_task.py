"""Reward of the tiny preset's synthetic task (single-digit addition, ``Answer: N``).

The rule is DAPO's, reduced to integers: take the *last* ``Answer:`` in the response and compare
the number after it with the label. Using the last one means a response cannot earn reward by
listing several candidate answers; everything else (chat special tokens, whitespace, junk before
the answer) is tolerated so that formatting noise of a tiny policy is not punished twice.

The function is pure and never raises on any string: it sits on the hot path of every rollout.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_answer", "score_number"]

# "Answer:" (any case), optional spaces, then an integer or decimal with optional sign. The look-aheads
# refuse run-ons such as "Answer: 7abc" or "Answer: 7.5.1", which would otherwise read as 7; a
# sentence-ending period ("Answer: 7.") is fine.
_ANSWER_RE = re.compile(r"answer\s*:\s*([+-]?\d+(?:\.\d+)?)(?!\w)(?!\.\d)", re.IGNORECASE)


def extract_answer(response: str) -> float | None:
    """The number after the last ``Answer:`` in ``response``, or ``None`` when there is none."""
    if not isinstance(response, str):
        return None
    matches = _ANSWER_RE.findall(response)
    if not matches:
        return None
    try:
        return float(matches[-1])
    except ValueError:  # pragma: no cover - the regex only admits numbers
        return None


def compute_score(response: str, label: str) -> float:
    """1.0 when the response's last ``Answer:`` equals ``label`` numerically, else 0.0.

    ``label`` is the dataset's string label (``"7"``); an unparsable label scores 0 rather than
    raising, so one bad data line cannot stop a training run.
    """
    return score_number(extract_answer(response), label)


def score_number(predicted: float | None, label: str) -> float:
    """1.0 when ``predicted`` equals the numeric ``label``; 0.0 for no prediction or an unparsable label."""
    if predicted is None:
        return 0.0
    try:
        expected = float(str(label).strip())
    except ValueError:
        return 0.0
    return 1.0 if predicted == expected else 0.0
