"""The driver's one line per step (relax.training.console) and the log level every Relax process takes."""

from __future__ import annotations

import logging

from relax.logs import LOG_LEVEL_ENV, log_level
from relax.training.console import StepLine, eta_seconds, format_duration


def test_the_eta_averages_the_newest_steps_times_the_steps_left() -> None:
    assert eta_seconds([], 10) is None
    assert eta_seconds([2.0, 4.0], 3) == 9.0
    # only the newest ten count: a slow start (a cold pool) does not haunt the estimate
    assert eta_seconds([100.0] + [1.0] * 10, 5) == 5.0
    assert eta_seconds([1.0, float("nan")], 2) == 2.0 and eta_seconds([1.0], 0) == 0.0


def test_durations_read_as_an_operator_writes_them() -> None:
    assert [format_duration(s) for s in (None, 42.4, 185, 7620)] == ["?", "42s", "3m05s", "2h07m"]


def test_one_line_per_step_with_a_bar_only_on_a_terminal_and_never_escape_codes() -> None:
    line = StepLine(step=12, total=100, reward=0.4123, staleness_max=1.0, active_engines=4, step_s=2.34, eta_s=202)
    plain = line.render(tty=False)
    assert plain == ("training step 12/100: reward 0.412, staleness max 1, 4 ACTIVE engines, 2.3s/step, "
                     "ETA 3m22s")
    bar = line.render(tty=True)
    assert bar.startswith("[##..................] ") and bar.endswith(plain)
    assert "\x1b" not in plain + bar and "\n" not in plain + bar
    done = StepLine(step=100, total=100, reward=None, staleness_max=None, active_engines=None, step_s=1.0, eta_s=0)
    assert done.render(tty=True).startswith("[" + "#" * 20 + "]")
    assert "reward n/a, staleness max n/a, n/a ACTIVE engines" in done.render(tty=False)


def test_the_log_level_comes_from_the_environment_every_process_inherits(monkeypatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert log_level() == logging.INFO
    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
    assert log_level() == logging.DEBUG
    monkeypatch.setenv(LOG_LEVEL_ENV, "nonsense")
    assert log_level() == logging.INFO  # a bad value never stops a worker; the flag itself is checked up front
