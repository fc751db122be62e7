"""argparse value types shared by every Relax command line.

Each one turns the text of a flag into a value or raises ``ArgumentTypeError`` with a message that says what
is expected and what was given, so ``--port 70000`` and ``--lr fast`` fail the same way in every command
(``relax engine serve``, ``relax cluster``, ``relax monitor``, the training entrypoint).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

N = TypeVar("N", int, float)


def parse_int(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None


def parse_float(text: str, expected: str) -> float:
    """A finite float: ``nan`` and ``inf`` are never a sensible timeout, rate or coefficient."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def _bounded(parse: Callable[[str, str], N], expected: str, ok: Callable[[N], bool],
             name: str) -> Callable[[str], N]:
    """A value type: ``parse`` the text, then refuse values ``ok`` rejects, both with the same message."""

    def convert(text: str) -> N:
        value = parse(text, expected)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    convert.__name__ = name
    return convert


positive_int = _bounded(parse_int, "a positive integer", lambda v: v > 0, "positive_int")
non_negative_int = _bounded(parse_int, "an integer >= 0", lambda v: v >= 0, "non_negative_int")
top_k = _bounded(parse_int, "-1 (off) or a positive integer", lambda v: v == -1 or v > 0, "top_k")
# A port to listen on; 0 asks the system for a free one.
port = _bounded(parse_int, "a port number 0-65535 (0 picks a free port)", lambda v: 0 <= v <= 65535, "port")
# A port others must be told about in advance (an engine's), so 0 is not allowed.
fixed_port = _bounded(parse_int, "a port number 1-65535", lambda v: 1 <= v <= 65535, "fixed_port")
positive_float = _bounded(parse_float, "a number > 0", lambda v: v > 0, "positive_float")
positive_seconds = _bounded(parse_float, "a number of seconds > 0", lambda v: v > 0, "positive_seconds")
non_negative_float = _bounded(parse_float, "a number >= 0", lambda v: v >= 0, "non_negative_float")
fraction = _bounded(parse_float, "a number in (0, 1]", lambda v: 0 < v <= 1, "fraction")
beta = _bounded(parse_float, "a number in [0, 1)", lambda v: 0 <= v < 1, "beta")


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """``int_at_least(2, "chart points")``: an integer with a floor, named in the message."""
    return _bounded(parse_int, f"an integer >= {minimum} ({what})", lambda v: v >= minimum, f"int_at_least_{minimum}")


def enum_type(enum_cls: type[Enum]) -> Callable[[str], Enum]:
    """Turns a string into ``enum_cls`` with a message listing the choices."""

    def convert(text: str) -> Enum:
        try:
            return enum_cls(text)
        except ValueError:
            options = ", ".join(str(member.value) for member in enum_cls)
            raise argparse.ArgumentTypeError(f"invalid choice {text!r}; choose from {options}") from None

    convert.__name__ = enum_cls.__name__
    return convert


def choices_metavar(enum_cls: type[Enum]) -> str:
    return "{" + ",".join(str(member.value) for member in enum_cls) + "}"
