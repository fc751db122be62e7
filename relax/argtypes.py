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


def _checked(value: float, ok: bool, expected: str, text: str) -> None:
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")


def positive_int(text: str) -> int:
    value = parse_int(text, "a positive integer")
    _checked(value, value > 0, "a positive integer", text)
    return value


def non_negative_int(text: str) -> int:
    value = parse_int(text, "an integer >= 0")
    _checked(value, value >= 0, "an integer >= 0", text)
    return value


def top_k(text: str) -> int:
    expected = "-1 (off) or a positive integer"
    value = parse_int(text, expected)
    _checked(value, value == -1 or value > 0, expected, text)
    return value


def port(text: str) -> int:
    """A port to listen on; 0 asks the system for a free one."""
    expected = "a port number 0-65535 (0 picks a free port)"
    value = parse_int(text, expected)
    _checked(value, 0 <= value <= 65535, expected, text)
    return value


def fixed_port(text: str) -> int:
    """A port others must be told about in advance (an engine's), so 0 is not allowed."""
    expected = "a port number 1-65535"
    value = parse_int(text, expected)
    _checked(value, 1 <= value <= 65535, expected, text)
    return value


def positive_float(text: str) -> float:
    value = parse_float(text, "a number > 0")
    _checked(value, value > 0, "a number > 0", text)
    return value


def positive_seconds(text: str) -> float:
    value = parse_float(text, "a number of seconds > 0")
    _checked(value, value > 0, "a number of seconds > 0", text)
    return value


def non_negative_float(text: str) -> float:
    value = parse_float(text, "a number >= 0")
    _checked(value, value >= 0, "a number >= 0", text)
    return value


def fraction(text: str) -> float:
    value = parse_float(text, "a number in (0, 1]")
    _checked(value, 0 < value <= 1, "a number in (0, 1]", text)
    return value


def beta(text: str) -> float:
    value = parse_float(text, "a number in [0, 1)")
    _checked(value, 0 <= value < 1, "a number in [0, 1)", text)
    return value


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """``int_at_least(2, "chart points")``: an integer with a floor, named in the message."""
    expected = f"an integer >= {minimum} ({what})"

    def convert(text: str) -> int:
        value = parse_int(text, expected)
        _checked(value, value >= minimum, expected, text)
        return value

    convert.__name__ = f"int_at_least_{minimum}"
    return convert


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
