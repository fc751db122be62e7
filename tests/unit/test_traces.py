"""Load traces for the autoscaler simulator: built-ins, CSV, JSONL, and errors that name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.autoscaler.traces import (
    Phase,
    Trace,
    TraceError,
    TracePoint,
    builtin_trace,
    load_trace,
    load_trace_file,
    parse_trace_text,
    trace_names,
)


def mean_rate(trace: Trace) -> float:
    """Average arrival rate over the whole trace (trapezoids)."""
    points = trace.points
    area = sum((b.t - a.t) * (a.rate + b.rate) / 2 for a, b in zip(points, points[1:], strict=False))
    return area / trace.duration_secs


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- built-ins ----------------------------------------------------------------------------------------


def test_builtin_names() -> None:
    assert trace_names() == ["steady", "step", "ramp", "spike", "rl-phases"]


@pytest.mark.parametrize("name", ["steady", "step", "ramp", "spike", "rl-phases"])
def test_builtins_last_30_to_60_minutes_with_sane_rates(name: str) -> None:
    trace = load_trace(name)
    assert trace.name == name
    assert 30 * 60 <= trace.duration_secs <= 60 * 60
    assert trace.description
    assert all(trace.rate_at(t) >= 0 for t in range(0, int(trace.duration_secs) + 1, 30))
    assert mean_rate(trace) > 0


def test_step_is_a_step() -> None:
    trace = builtin_trace("step")
    assert trace.rate_at(599) == pytest.approx(10)
    assert trace.rate_at(600) == pytest.approx(26)  # two points at one t: the later one wins from t on
    assert trace.rate_at(1799) == pytest.approx(26)
    assert trace.rate_at(1800) == pytest.approx(10)


def test_ramp_interpolates_linearly() -> None:
    trace = builtin_trace("ramp")
    assert trace.rate_at(0) == pytest.approx(6)
    assert trace.rate_at(750) == pytest.approx(18)  # half way up
    assert trace.rate_at(1500) == pytest.approx(30)
    assert trace.rate_at(trace.duration_secs + 100) == pytest.approx(6)  # past the end: the last rate


def test_rl_phases_alternate_and_answers_grow() -> None:
    trace = builtin_trace("rl-phases")
    assert trace.has_phases
    phase, first = trace.phase_at(60)
    assert phase is Phase.ROLLOUT and trace.rate_at(60) > 10
    phase, train = trace.phase_at(6 * 60)
    assert phase is Phase.TRAIN and trace.rate_at(6 * 60) < 1
    assert train > first
    phase, second = trace.phase_at(9 * 60)
    assert phase is Phase.ROLLOUT and second > train  # each phase has its own identity
    early, late = trace.tokens_at(60), trace.tokens_at(trace.duration_secs - 60)
    assert early is not None and late is not None and late > early * 1.8


def test_traces_without_phases_report_none() -> None:
    trace = builtin_trace("steady")
    assert not trace.has_phases
    assert trace.phase_at(100) == (None, -1)
    assert trace.tokens_at(100) is None


# -- files ----------------------------------------------------------------------------------------


def test_csv_without_header(tmp_path: Path) -> None:
    path = write(tmp_path, "load.csv", "# a comment\n0,5\n\n60,5\n60,20\n120,20\n")
    trace = load_trace(str(path))
    assert trace.duration_secs == 120
    assert trace.rate_at(30) == pytest.approx(5)
    assert trace.rate_at(90) == pytest.approx(20)
    assert trace.name == str(path)


def test_csv_header_names_columns_in_any_order(tmp_path: Path) -> None:
    path = write(tmp_path, "load.csv", "rate,t_secs,phase,tokens\n10,0,rollout,1000\n0.5,300,train,\n0.5,400,,\n")
    trace = load_trace_file(path)
    assert trace.points[0] == TracePoint(0, 10, 1000, Phase.ROLLOUT)
    assert trace.points[1] == TracePoint(300, 0.5, None, Phase.TRAIN)
    assert trace.phase_at(350)[0] is Phase.TRAIN  # a phase holds until a point names another
    assert trace.tokens_at(150) == 1000  # tokens known on one side only: no invented interpolation


def test_jsonl(tmp_path: Path) -> None:
    path = write(tmp_path, "load.jsonl",
                 '{"t": 0, "rate": 2, "tokens": 500}\n# comment\n{"t": 100, "rate": 4, "tokens": 1500}\n')
    trace = load_trace(str(path))
    assert trace.rate_at(50) == pytest.approx(3)
    assert trace.tokens_at(50) == pytest.approx(1000)


def test_format_is_sniffed_without_extension(tmp_path: Path) -> None:
    json_path = write(tmp_path, "load", '{"t": 0, "rate": 1}\n{"t": 10, "rate": 1}\n')
    csv_path = write(tmp_path, "load2", "0,1\n10,1\n")
    assert load_trace(str(json_path)).duration_secs == 10
    assert load_trace(str(csv_path)).duration_secs == 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,1\n10,x\n", "line 2: rate must be a number, got 'x'"),
        ("0,1\n# c\n10,-1\n", "line 3: rate must be >= 0"),
        ("0,1\n20,1\n10,1\n", "line 3: t=10 is before the previous point's t=20"),
        ("0,1\n10,1,1000,rollout,extra\n", "line 2: 5 fields, expected at most 4"),
        ("0,1\n10\n", "line 2: expected 't_secs,rate'"),
        ("time,speed\n0,1\n", "line 1: unknown column 'speed'"),
        ("t,tokens\n0,1\n", "line 1: the header lacks the 'rate' column"),
        ("0,1\n10,1,0\n", "line 2: tokens must be > 0"),
        ("0,1,,warmup\n10,1\n", "line 1: phase must be one of rollout, train, got 'warmup'"),
        ("0,1\n-5,1\n", "line 2: t must be >= 0"),
        ("0,nan\n10,1\n", "line 1: rate must be finite"),
    ],
)
def test_csv_errors_name_the_line(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as error:
        load_trace(str(path))
    assert expected in str(error.value)
    assert str(path) in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"t": 0, "rate": 1}\n{"t": 5, "rate": 1\n', "line 2: not valid JSON"),
        ('{"t": 0, "rate": 1}\n[5, 1]\n', "line 2: expected an object"),
        ('{"t": 0, "rate": 1}\n{"t": 5, "rate": 1, "burst": 2}\n', "line 2: unknown key 'burst'"),
        ('{"t": 0, "rate": 1}\n{"t": 5}\n', "line 2: missing 'rate'"),
        ('{"t": 0, "rate": true}\n{"t": 5, "rate": 1}\n', "line 1: rate must be a number"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(TraceError, match="line") as error:
        load_trace(str(path))
    assert expected in str(error.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "is empty"),
        ("# only a comment\n", "is empty"),
        ("t,rate\n", "has a header but no rows"),
        ("0,1\n", "needs at least two points"),
        ("5,1\n10,1\n", "the first point must be at t=0"),
        ("0,1\n0,2\n", "the last point must be after t=0"),
    ],
)
def test_whole_file_errors(text: str, expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        parse_trace_text(text, name="t.csv", kind="csv")


def test_unknown_names_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"unknown trace 'stedy'.*steady, step, ramp, spike, rl-phases"):
        load_trace("stedy")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "missing.csv"))
    with pytest.raises(TraceError, match="is a directory"):
        load_trace_file(tmp_path)
    with pytest.raises(TraceError, match="unknown built-in trace"):
        builtin_trace("flat")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.csv"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not a UTF-8 text file"):
        load_trace_file(path)


def test_trace_validates_points_directly() -> None:
    with pytest.raises(TraceError, match="at least two points"):
        Trace("x", (TracePoint(0, 1),))
