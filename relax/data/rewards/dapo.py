"""DAPO's rule-based math reward, as published with DAPO (verl's ``math_dapo``, after Minerva).

The rule: look at the last 300 characters of the response, take the text after the *last*
``Answer:`` (case-insensitive) up to the end of its line, normalise it and the label the same way
(Minerva's ``normalize_final_answer``: keep what follows the last ``=``, drop units, spaces, ``\\text{}``,
``\\boxed{}``, dollar signs and thousands separators, expand ``\\frac12``-style shorthand), and compare
the strings. Correct gives +1, anything else (including no ``Answer:`` line) gives -1.

The normalisation tables below are the published ones on purpose: a reward that differs in a corner
case from the paper's makes results incomparable with it.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_answer", "normalize_final_answer"]

#: DAPO only looks at the tail of the response; the longest MATH answer is well under this.
TAIL_CHARS = 300
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

# (before, after) replacements, applied in order.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Units, filler words and formatting that do not change the answer; removed in order.
_REMOVED: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)


def normalize_final_answer(answer: str) -> str:
    """Normalise a final answer so that equivalent spellings compare equal as strings."""
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")

    # Keep only the first $...$ math span, then unwrap formatting commands.
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    s = re.sub(r"(\\text\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)

    # Shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")

    # "1,000" -> "1000" (only when the whole answer is a number with separators).
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` in the response's tail, or None when there is none."""
    matches = _ANSWER_RE.findall(response[-TAIL_CHARS:])
    return matches[-1] if matches else None


def compute_score(response: str, label: str) -> float:
    """+1.0 when the last ``Answer:`` line matches the label after normalisation, else -1.0."""
    extracted = extract_answer(response)
    pred = normalize_final_answer(extracted if extracted is not None else INVALID)
    return 1.0 if pred == normalize_final_answer(str(label)) else -1.0
