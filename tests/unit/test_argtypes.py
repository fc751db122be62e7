"""The shared argparse value types: what each accepts, and the message for what it refuses."""

from __future__ import annotations

import argparse
from enum import Enum

import pytest

from relax import argtypes


class Color(Enum):
    RED = "red"
    BLUE = "blue"


@pytest.mark.parametrize("convert,text,value", [
    (argtypes.positive_int, "3", 3),
    (argtypes.non_negative_int, "0", 0),
    (argtypes.top_k, "-1", -1),
    (argtypes.top_k, "20", 20),
    (argtypes.port, "0", 0),
    (argtypes.port, "65535", 65535),
    (argtypes.fixed_port, "1", 1),
    (argtypes.positive_float, "0.5", 0.5),
    (argtypes.positive_seconds, "1e-3", 0.001),
    (argtypes.non_negative_float, "0", 0.0),
    (argtypes.fraction, "1", 1.0),
    (argtypes.beta, "0", 0.0),
    (argtypes.int_at_least(2, "points"), "2", 2),
    (argtypes.enum_type(Color), "blue", Color.BLUE),
])
def test_accepts(convert, text, value) -> None:
    assert convert(text) == value


@pytest.mark.parametrize("convert,text,message", [
    (argtypes.positive_int, "0", "must be a positive integer, got '0'"),
    (argtypes.positive_int, "2.5", "must be a positive integer, got '2.5'"),
    (argtypes.non_negative_int, "-1", "must be an integer >= 0, got '-1'"),
    (argtypes.top_k, "0", "must be -1 (off) or a positive integer, got '0'"),
    (argtypes.top_k, "-2", "must be -1 (off) or a positive integer"),
    (argtypes.port, "70000", "must be a port number 0-65535 (0 picks a free port), got '70000'"),
    (argtypes.fixed_port, "0", "must be a port number 1-65535, got '0'"),
    (argtypes.positive_float, "nan", "must be a number > 0, got 'nan'"),
    (argtypes.positive_float, "-1", "must be a number > 0"),
    (argtypes.positive_seconds, "inf", "must be a number of seconds > 0, got 'inf'"),
    (argtypes.positive_seconds, "soon", "must be a number of seconds > 0, got 'soon'"),
    (argtypes.non_negative_float, "-0.1", "must be a number >= 0"),
    (argtypes.fraction, "1.5", "must be a number in (0, 1]"),
    (argtypes.fraction, "0", "must be a number in (0, 1]"),
    (argtypes.beta, "1", "must be a number in [0, 1)"),
    (argtypes.int_at_least(2, "points in a chart"), "1", "must be an integer >= 2 (points in a chart), got '1'"),
    (argtypes.enum_type(Color), "green", "invalid choice 'green'; choose from red, blue"),
])
def test_refuses_with_a_message(convert, text, message) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        convert(text)
    assert message in str(err.value)


def test_argparse_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="relax")
    parser.add_argument("--port", type=argtypes.fixed_port)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--port", "99999"])
    assert exit_.value.code == 2
    assert "argument --port: must be a port number 1-65535, got '99999'" in capsys.readouterr().err
    assert argtypes.choices_metavar(Color) == "{red,blue}"
