"""Math rewards checked with ``math-verify`` (symbolic equivalence, not string equality): 1.0 or 0.0.

``math_verify.parse``/``verify`` enforce their time limits with ``signal.alarm``, which raises in any
thread but the main one, and rewards run in threaded/async Ray actors. So both calls get
``parsing_timeout=None, timeout_seconds=None`` here, and whoever runs rewards at scale bounds their time
from outside (a process pool with a deadline). Any exception counts as a wrong answer: a reward function
that raises would kill a rollout step over one odd response.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["compute_deepscaler_score", "compute_score", "last_boxed_content"]

logger = logging.getLogger(__name__)

THINK_END = "</think>"


def _parse(text: str) -> list[Any]:
    from math_verify import parse  # imported lazily: sympy + lark take a moment to load

    return parse(text, parsing_timeout=None)


def _verify(gold: list[Any], pred: list[Any]) -> bool:
    from math_verify import verify

    return bool(verify(gold, pred, timeout_seconds=None))


def _parse_label(label: str) -> list[Any]:
    """Parse a ground-truth answer.

    Labels are usually bare LaTeX (``\\sqrt{2}``, ``x^2+1``) which math-verify only recognises inside
    math delimiters, so a label without ``$`` or ``\\boxed`` is parsed as ``\\boxed{label}``.
    """
    s = str(label).strip()
    if not s:
        return []
    if "\\boxed" in s or "$" in s:
        return _parse(s)
    return _parse(f"\\boxed{{{s}}}") or _parse(s)


def compute_score(response: str, label: str) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the label, else 0.0."""
    try:
        gold = _parse_label(label)
        if not gold:
            logger.debug("math reward: label %r could not be parsed", label)
            return 0.0
        pred = _parse(response)
        if not pred:
            return 0.0
        return 1.0 if _verify(gold, pred) else 0.0
    except Exception:  # noqa: BLE001 - a reward never raises; see module docstring
        logger.debug("math reward: verification raised", exc_info=True)
        return 0.0


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed{", "\\fbox{")]
    idx, cmd = max(starts)
    if idx < 0:
        return None
    depth = 0
    begin = idx + len(cmd) - 1  # the opening brace
    for i in range(begin, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[begin + 1 : i]
    return None  # unbalanced: the response was cut off inside the box


def compute_deepscaler_score(response: str, label: str) -> float:
    """DeepScaleR-style reward: the answer must be in a ``\\boxed{}`` after the reasoning; 1.0 or 0.0.

    Only the text after the last ``</think>`` counts when there is one (the final answer, not a guess
    made while thinking). Stricter than ``compute_score``, which accepts any final-answer form.
    """
    try:
        tail = response.rsplit(THINK_END, 1)[-1]
        boxed = last_boxed_content(tail)
        if boxed is None or not boxed.strip():
            return 0.0
        if boxed.strip() == str(label).strip():
            return 1.0
        gold = _parse_label(label)
        pred = _parse(f"\\boxed{{{boxed}}}")
        if not gold or not pred:
            return 0.0
        return 1.0 if _verify(gold, pred) else 0.0
    except Exception:  # noqa: BLE001
        logger.debug("deepscaler reward: verification raised", exc_info=True)
        return 0.0
