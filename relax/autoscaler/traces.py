"""Load traces for the autoscaler simulator: request arrival rate over time (``relax autoscaler simulate``).

A trace is a list of points ``(t, rate[, tokens][, phase])``: at ``t`` seconds the arrival rate is
``rate`` requests per second, each request asking for ``tokens`` output tokens on average. Between two
points rate and tokens are interpolated **linearly**; two points at the same ``t`` make a step (the later
one wins from ``t`` on). The trace ends at its last point. Why linear points rather than buckets: one
format then writes steps, ramps and spikes alike, and a measured rate curve (Grafana export, one row a
minute) replays as it was drawn.

``phase`` (``rollout`` | ``train``) is the RL-specific part and is optional. It marks which part of the
training loop the cluster is in, holds from its point until the next point that names a phase, and lets
the simulator derive the trainer's wait-for-data fraction (see ``relax.autoscaler.simulator``).

Formats (chosen by extension, else sniffed: a line starting with ``{`` means JSONL):

* CSV ``t_secs,rate[,tokens[,phase]]`` -- an optional header row names the columns (``t`` or ``t_secs``,
  ``rate``, ``tokens``, ``phase``, any order); ``#`` starts a comment line.
* JSONL -- one object a line: ``{"t": 0, "rate": 10, "tokens": 1500, "phase": "rollout"}``.

Every error names the file and line (``TraceError``), because a trace is usually hand-written or
exported by a script, and "line 57: rate must be >= 0" is the whole fix.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_TRACES",
    "Phase",
    "Trace",
    "TraceError",
    "TracePoint",
    "builtin_trace",
    "load_trace",
    "load_trace_file",
    "parse_trace_text",
    "trace_names",
]

_MINUTE = 60.0


class TraceError(ValueError):
    """A trace that cannot be used; the message is one line naming the trace (and line) to fix."""


class Phase(str, Enum):
    """Which half of an RL step the cluster is in: generating samples, or the trainer training on them."""

    ROLLOUT = "rollout"
    TRAIN = "train"


@dataclass(frozen=True)
class TracePoint:
    """The load at time ``t`` (seconds from the trace start)."""

    t: float
    rate: float
    """Arriving requests per second."""
    tokens: float | None = None
    """Mean output tokens per request; ``None`` = the simulator's default."""
    phase: Phase | None = None
    """RL phase from this point on; ``None`` = unchanged (or no phases at all)."""


@dataclass(frozen=True)
class Trace:
    """A validated trace; query it with ``rate_at``, ``tokens_at`` and ``phase_at``."""

    name: str
    points: tuple[TracePoint, ...]
    description: str = ""
    _times: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate_points(self.points, self.name)
        object.__setattr__(self, "_times", tuple(p.t for p in self.points))

    @property
    def duration_secs(self) -> float:
        return self.points[-1].t

    @property
    def has_phases(self) -> bool:
        return any(p.phase is not None for p in self.points)

    def _segment(self, t: float) -> int:
        """Index of the last point at or before ``t`` (0 before the start)."""
        return max(0, bisect.bisect_right(self._times, t) - 1)

    def _interpolate(self, t: float, value: Callable[[TracePoint], float | None]) -> float | None:
        i = self._segment(t)
        here = self.points[i]
        if i + 1 >= len(self.points):
            return value(here)
        after = self.points[i + 1]
        a, b = value(here), value(after)
        if a is None or b is None:
            return a
        span = after.t - here.t
        return a + (b - a) * (t - here.t) / span if span > 0 else b

    def rate_at(self, t: float) -> float:
        """Arrival rate (requests/s) at ``t``, linearly interpolated."""
        value = self._interpolate(t, lambda p: p.rate)
        return float(value) if value is not None else 0.0

    def tokens_at(self, t: float) -> float | None:
        """Mean output tokens per request at ``t``; ``None`` where the trace does not say."""
        return self._interpolate(t, lambda p: p.tokens)

    def phase_at(self, t: float) -> tuple[Phase | None, int]:
        """The RL phase at ``t`` and the index of the point that started it (a phase's identity)."""
        for i in range(self._segment(t), -1, -1):
            if self.points[i].phase is not None:
                return self.points[i].phase, i
        return None, -1


def _validate_points(points: tuple[TracePoint, ...], name: str) -> None:
    if len(points) < 2:
        raise TraceError(f"trace {name}: needs at least two points (the start at t=0 and the end)")
    if points[0].t != 0:
        raise TraceError(f"trace {name}: the first point must be at t=0, got t={points[0].t:g}")
    if points[-1].t <= 0:
        raise TraceError(f"trace {name}: the last point must be after t=0 (it marks the end of the trace)")


# --------------------------------------------------------------------------------------------------
# Built-in traces. Sizes are in the units of the simulator's default engine (about 4 requests/s of
# 1500-token answers per engine) and the recipe's bounds (4..8 engines, i.e. about 16..32 requests/s).


def _steady() -> Trace:
    return Trace("steady", (TracePoint(0, 10), TracePoint(40 * _MINUTE, 10)),
                 "10 req/s for 40 min: well inside 4 engines; a good policy never moves")


def _step() -> Trace:
    m = _MINUTE
    points = (TracePoint(0, 10), TracePoint(10 * m, 10), TracePoint(10 * m, 26), TracePoint(30 * m, 26),
              TracePoint(30 * m, 10), TracePoint(45 * m, 10))
    return Trace("step", points, "10 req/s, a step to 26 req/s (about 7 engines) for 20 min, back to 10; 45 min")


def _ramp() -> Trace:
    m = _MINUTE
    points = (TracePoint(0, 6), TracePoint(25 * m, 30), TracePoint(50 * m, 6))
    return Trace("ramp", points, "6 req/s rising linearly to 30 req/s over 25 min and falling back; 50 min")


def _spike() -> Trace:
    m = _MINUTE
    points = (TracePoint(0, 10), TracePoint(15 * m, 10), TracePoint(15 * m, 40), TracePoint(19 * m, 40),
              TracePoint(19 * m, 10), TracePoint(40 * m, 10))
    return Trace("spike", points, "10 req/s with a 4-min spike to 40 req/s (beyond 8 engines) at 15 min; 40 min")


def _rl_phases(cycles: int = 6, rollout_secs: float = 5 * _MINUTE, train_secs: float = 3 * _MINUTE,
               rollout_rate: float = 20.0, train_rate: float = 0.2,
               tokens: tuple[float, float] = (1000.0, 2200.0)) -> Trace:
    """RL steps: generation bursts, training pauses, and answers that grow longer as the policy learns.

    The growth is the RL-specific part besides the bursts: GRPO runs on reasoning tasks lengthen their
    responses step after step, so the same request rate needs more engines later in the run
    (here from about 3.3 to 7.3 engines' worth of tokens during generation).
    """
    points: list[TracePoint] = []
    end = cycles * (rollout_secs + train_secs)

    def length(at: float) -> float:
        return tokens[0] + (tokens[1] - tokens[0]) * at / end

    t = 0.0
    for _ in range(cycles):
        points += [TracePoint(t, rollout_rate, length(t), Phase.ROLLOUT),
                   TracePoint(t + rollout_secs, rollout_rate, length(t + rollout_secs))]
        t += rollout_secs
        points += [TracePoint(t, train_rate, length(t), Phase.TRAIN),
                   TracePoint(t + train_secs, train_rate, length(t + train_secs))]
        t += train_secs
    description = (f"{cycles} RL steps: {rollout_secs / _MINUTE:g} min of generation at {rollout_rate:g} req/s, then "
                   f"{train_secs / _MINUTE:g} min of training at {train_rate:g} req/s; answers grow from "
                   f"{tokens[0]:g} to {tokens[1]:g} tokens (about 3.3 to 7.3 engines while generating)")
    return Trace("rl-phases", tuple(points), description)


BUILTIN_TRACES: dict[str, Callable[[], Trace]] = {
    "steady": _steady,
    "step": _step,
    "ramp": _ramp,
    "spike": _spike,
    "rl-phases": _rl_phases,
}


def trace_names() -> list[str]:
    return list(BUILTIN_TRACES)


def builtin_trace(name: str) -> Trace:
    """A built-in trace by name; ``TraceError`` listing the names for an unknown one."""
    try:
        return BUILTIN_TRACES[name]()
    except KeyError:
        raise TraceError(f"unknown built-in trace {name!r}; choose one of {', '.join(BUILTIN_TRACES)}") from None


def load_trace(spec: str) -> Trace:
    """``spec`` is a built-in name or a path to a CSV/JSONL file."""
    if spec in BUILTIN_TRACES:
        return builtin_trace(spec)
    path = Path(spec)
    if path.exists():
        return load_trace_file(path)
    if path.suffix or "/" in spec or "\\" in spec:
        raise TraceError(f"trace file {spec}: no such file")
    raise TraceError(
        f"unknown trace {spec!r}: not a built-in ({', '.join(BUILTIN_TRACES)}) and no file of that name"
    )


def load_trace_file(path: str | Path) -> Trace:
    """Read a CSV or JSONL trace; every problem is a ``TraceError`` naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"trace file {path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"trace file {path}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace file {path}: not a UTF-8 text file") from None
    except OSError as error:
        raise TraceError(f"trace file {path}: cannot read it ({error.strerror})") from None
    suffix = path.suffix.lower()
    kind = "jsonl" if suffix in (".jsonl", ".ndjson") else "csv" if suffix == ".csv" else None
    return parse_trace_text(text, name=str(path), kind=kind)


def parse_trace_text(text: str, *, name: str = "<trace>", kind: str | None = None) -> Trace:
    """Parse trace text; ``kind`` is ``"csv"``, ``"jsonl"`` or ``None`` (sniffed from the first line)."""
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), start=1)]
    lines = [(number, line) for number, line in lines if line and not line.startswith("#")]
    if not lines:
        raise TraceError(f"trace file {name}: is empty (expected 't_secs,rate' rows or JSON lines)")
    if kind is None:
        kind = "jsonl" if lines[0][1].startswith("{") else "csv"
    if kind not in ("csv", "jsonl"):
        raise ValueError(f"kind must be 'csv', 'jsonl' or None, got {kind!r}")
    rows = _csv_rows(lines, name) if kind == "csv" else _jsonl_rows(lines, name)
    points: list[TracePoint] = []
    for number, row in rows:
        point = _point(row, f"trace file {name}, line {number}")
        if points and point.t < points[-1].t:
            raise TraceError(
                f"trace file {name}, line {number}: t={point.t:g} is before the previous point's "
                f"t={points[-1].t:g}; times must not decrease"
            )
        points.append(point)
    return Trace(name, tuple(points), f"from {name}")


_COLUMNS = {"t": "t", "t_secs": "t", "time": "t", "rate": "rate", "tokens": "tokens", "phase": "phase"}


def _csv_rows(lines: list[tuple[int, str]], name: str) -> Iterable[tuple[int, dict[str, Any]]]:
    columns = ["t", "rate", "tokens", "phase"]
    first_number, first = lines[0]
    cells = next(csv.reader([first]))
    if cells and not _is_number(cells[0]):
        header = [cell.strip().lower() for cell in cells]
        unknown = [cell for cell in header if cell not in _COLUMNS]
        if unknown:
            raise TraceError(
                f"trace file {name}, line {first_number}: unknown column {unknown[0]!r} in the header; "
                "columns are t_secs (or t), rate, tokens, phase"
            )
        columns = [_COLUMNS[cell] for cell in header]
        missing = [c for c in ("t", "rate") if c not in columns]
        if missing:
            raise TraceError(f"trace file {name}, line {first_number}: the header lacks the {missing[0]!r} column")
        lines = lines[1:]
        if not lines:
            raise TraceError(f"trace file {name}: has a header but no rows")
    for number, line in lines:
        cells = [cell.strip() for cell in next(csv.reader([line]))]
        if len(cells) > len(columns):
            raise TraceError(
                f"trace file {name}, line {number}: {len(cells)} fields, expected at most {len(columns)} "
                f"({','.join(columns)})"
            )
        if len(cells) < 2:
            raise TraceError(f"trace file {name}, line {number}: expected 't_secs,rate', got {line!r}")
        yield number, {column: cell for column, cell in zip(columns, cells, strict=False) if cell != ""}


def _jsonl_rows(lines: list[tuple[int, str]], name: str) -> Iterable[tuple[int, dict[str, Any]]]:
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"trace file {name}, line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise TraceError(
                f"trace file {name}, line {number}: expected an object like {{\"t\": 0, \"rate\": 10}}, "
                f"got {type(row).__name__}"
            )
        unknown = [key for key in row if key not in ("t", "rate", "tokens", "phase")]
        if unknown:
            raise TraceError(
                f"trace file {name}, line {number}: unknown key {unknown[0]!r}; keys are t, rate, tokens, phase"
            )
        yield number, row


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _number(row: dict[str, Any], key: str, where: str, *, required: bool) -> float | None:
    if key not in row or row[key] is None:
        if required:
            raise TraceError(f"{where}: missing {key!r}")
        return None
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TraceError(f"{where}: {key} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise TraceError(f"{where}: {key} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise TraceError(f"{where}: {key} must be finite, got {value!r}")
    return number


def _point(row: dict[str, Any], where: str) -> TracePoint:
    t = _number(row, "t", where, required=True)
    rate = _number(row, "rate", where, required=True)
    tokens = _number(row, "tokens", where, required=False)
    assert t is not None and rate is not None
    if t < 0:
        raise TraceError(f"{where}: t must be >= 0, got {t:g}")
    if rate < 0:
        raise TraceError(f"{where}: rate must be >= 0 requests/s, got {rate:g}")
    if tokens is not None and tokens <= 0:
        raise TraceError(f"{where}: tokens must be > 0, got {tokens:g}")
    phase = None
    if row.get("phase") is not None:
        try:
            phase = Phase(str(row["phase"]).strip().lower())
        except ValueError:
            raise TraceError(
                f"{where}: phase must be one of {', '.join(p.value for p in Phase)}, got {row['phase']!r}"
            ) from None
    return TracePoint(t, rate, tokens, phase)
