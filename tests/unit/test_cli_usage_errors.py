"""A usage error of the ``relax`` command is one line on stderr and exit code 2, not argparse's usage block."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax import cli


@pytest.mark.parametrize(("argv", "says"), [
    (["engine", "serve", "--model-path", "m", "--bogus"], "unrecognized arguments: --bogus"),
    (["engine", "serve", "--model-path", "m", "--port", "abc"], "--port: must be a port number 1-65535, got 'abc'"),
    (["engine", "serve", "--model-path", "m", "--model-impl", "x"], "--model-impl: invalid choice: 'x'"),
    (["engine", "serve", "--model-path"], "--model-path needs a value"),
    (["engine", "serve"], "the following arguments are required: --model-path"),
])
def test_a_bad_engine_serve_flag_is_one_line_and_exit_2(argv: list[str], says: str, capsys) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("relax engine serve: error: ") and says in err
    assert err.rstrip().endswith("(see relax engine serve --help)")


def test_the_error_names_the_sub_command_it_was_given_to(capsys) -> None:
    assert cli.main(["engine"]) == 2
    assert capsys.readouterr().err == (
        "relax engine: error: the following arguments are required: ACTION (see relax engine --help)\n")
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("relax: error: argument COMMAND: invalid choice: 'nope'")


def test_help_still_prints_the_usage_and_exits_0(capsys) -> None:
    assert cli.main(["engine", "serve", "--help"]) == 0
    assert "--model-path MODEL_PATH" in capsys.readouterr().out


def test_the_command_itself_exits_2_with_one_stderr_line() -> None:
    done = subprocess.run([sys.executable, "-m", "relax.cli", "engine", "serve", "--model-path", "m", "--bogus"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "relax engine serve: error: unrecognized arguments: --bogus (see relax engine serve --help)"]
