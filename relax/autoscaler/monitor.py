"""``relax monitor``: a terminal dashboard of a running autoscaler (docs/architecture.md, "The autoscaler").

It polls the ``/autoscaler`` REST routes of the control plane every ``--interval`` seconds and shows what an
operator asks when the pool grows or shrinks: how many engines, how loaded (token usage, queues, throughput,
P95 queue time and TTFT), which scale-out (ANY) and scale-in (ALL) conditions hold and for how long against
how long they must, what blocks acting now (cooldown, backoff, a pending request), and the recent decisions.

Why the shape:

* **Data shaping is pure.** ``overview_rows``, ``metric_rows``, ``engine_rows``, ``condition_rows``,
  ``history_rows``, ``chart_rows`` and ``sparkline`` turn the routes' JSON into rows of strings; tests call
  them directly and the Textual app only puts those rows on screen.
* **Fail before the TUI.** ``check_endpoint`` asks ``GET /status`` once before the app starts, so a wrong URL,
  a missing token or something that is not an autoscaler ends in one line on stderr and an exit code (2 for
  a malformed URL, 1 otherwise) instead of a full-screen app that can only show an error.
* **A poll that fails does not end the app.** Once running, an unreachable server is shown on the status line
  and the last good data stays on screen: the control plane restarting is exactly when one wants to watch.
* **Textual is imported lazily** (``make_app``) so registering the sub-command keeps ``relax --help`` fast.
* **One vocabulary.** Condition names, their words, the rules and the outcomes come from
  ``relax.autoscaler.policy`` (a light import), request statuses from ``relax.rollout.scaling`` (imported on
  first use), so the dashboard says what the server means.
* **The history is the monitor's own.** Charts show what this monitor saw (one point per poll, a few minutes'
  worth in memory); the server keeps no time series of its own to ask for.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any

import httpx
from rich.text import Text

from relax import argtypes
from relax.autoscaler.policy import CONDITION_LABELS, Mode, Outcome, Rule, ScaleAction, Unit, rules_summary

if TYPE_CHECKING:
    from textual.app import App

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_URL",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "TOKEN_ENV",
    "ConditionRow",
    "MetricSeries",
    "MonitorError",
    "Snapshot",
    "add_monitor_parser",
    "chart_rows",
    "check_endpoint",
    "condition_rows",
    "engine_rows",
    "fetch_snapshot",
    "history_rows",
    "make_app",
    "metric_rows",
    "normalize_url",
    "overview_rows",
    "run_monitor",
    "sparkline",
]

DEFAULT_URL = "http://127.0.0.1:8000/autoscaler"
DEFAULT_INTERVAL_S = 2.0
TOKEN_ENV = "RELAX_API_TOKEN"
HTTP_TIMEOUT_S = 5.0
HISTORY_POINTS = 150
"""Points kept per chart: five minutes at the default interval, a few kilobytes."""
HISTORY_ROWS = 20
"""Scale decisions asked for on every poll (``GET /scale_history?limit=``)."""
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NONE = "—"
"""How an unknown or not-applicable value is shown: never as 0, which would read as "idle"."""

_STATUS_KEYS = frozenset({"enabled", "floor", "ceiling", "engines"})
"""Keys every ``GET /autoscaler/status`` answer has: how the probe tells an autoscaler from anything else."""


class MonitorError(Exception):
    """A failure already worded for the operator; ``exit_code`` is what the command returns."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


# --------------------------------------------------------------------------------------------------
# Formatting


def as_number(value: Any) -> float | None:
    """A JSON number as a float; ``"+Inf"``/``"-Inf"`` (how the server spells infinity) as ``±inf``; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if not math.isnan(value) else None
    if value == "+Inf":
        return math.inf
    if value == "-Inf":
        return -math.inf
    return None


RATE = "rate"
"""A unit of the monitor's own (throughput), beside the conditions' :class:`~relax.autoscaler.policy.Unit`."""


def fmt_value(value: Any, kind: str = Unit.COUNT) -> str:
    """One value for a cell: ``fraction`` 0.85, ``percent`` 85%, ``secs`` 1.23s, ``rate`` 1600 tok/s, ``count``."""
    number = as_number(value)
    if number is None:
        return NONE
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    if kind == Unit.FRACTION:
        return f"{number:.2f}"
    if kind == Unit.PERCENT:
        return f"{number:.0%}"
    if kind == Unit.SECS:
        return f"{number:.2f}s"
    if kind == RATE:
        return f"{number:.0f} tok/s" if number >= 10 else f"{number:.2f} tok/s"
    return f"{number:.0f}" if number == round(number) else f"{number:.1f}"


def fmt_duration(value: Any) -> str:
    """Seconds as ``42s`` / ``3m05s``; zero or unknown as the dash (nothing to wait for)."""
    number = as_number(value)
    if number is None or number <= 0:
        return NONE
    if math.isinf(number):
        return "∞"
    if number < 60:
        return f"{number:.0f}s"
    minutes, secs = divmod(round(number), 60)
    return f"{minutes}m{secs:02d}s"


def fmt_clock(wall_time: Any) -> str:
    """A wall-clock timestamp as local ``HH:MM:SS`` (scale history and the status line)."""
    number = as_number(wall_time)
    if number is None or math.isinf(number):
        return NONE
    return datetime.fromtimestamp(number).strftime("%H:%M:%S")


def clip(text: str, limit: int) -> str:
    """One line of at most ``limit`` characters: reasons can be long, and a table row must stay one line."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _natural_key(text: str) -> list[Any]:
    """``engine_2`` before ``engine_10``: engines are numbered, and a pool of ten must not sort 0, 1, 10, 2."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


# --------------------------------------------------------------------------------------------------
# Data shaping (pure)

# The server sends each condition's value and threshold; the words (CONDITION_LABELS) and the rules are the
# policy's, imported so the two never disagree.
_RULE_TITLES = {Rule.SCALE_OUT: "scale-out", Rule.SCALE_IN: "scale-in", Rule.GATE: "gate"}
_COMBINING_MODES = (Mode.ANY, Mode.ALL)
"""Modes under which a condition is one of a rule's terms (the gate's mode only suppresses)."""


@dataclass(frozen=True)
class ConditionRow:
    """One condition as the table shows it, plus the raw flags the view colours by."""

    rule: str
    name: str
    label: str
    state: str
    value: str
    threshold: str
    held: str
    note: str
    met: bool
    sustained: bool

    def cells(self) -> tuple[str, ...]:
        """The table's columns: rule, condition, now, value, threshold, held / needed, note."""
        return (self.rule, self.label, self.state, self.value, self.threshold, self.held, self.note)


def condition_rows(body: Mapping[str, Any]) -> list[ConditionRow]:
    """``GET /conditions`` as rows, grouped scale-out (ANY), scale-in (ALL), then the gate, in the server's order.

    The rule order comes from the answer's ``rules`` when present, so a condition the server adds later still
    shows (under its ``direction``) instead of disappearing.
    """
    conditions = _mapping(body.get("conditions"))
    rules = _mapping(body.get("rules")) or rules_summary()
    order: list[tuple[str, str]] = []
    for rule, spec in rules.items():
        spec = _mapping(spec)
        names = spec.get("conditions") if isinstance(spec.get("conditions"), list) else []
        for name in names:
            if name in conditions and all(name != seen for _, seen in order):
                order.append((str(rule), str(name)))
    listed = {name for _, name in order}
    for name, state in conditions.items():
        if name not in listed:
            order.append((str(_mapping(state).get("direction") or "other"), str(name)))
    modes = {str(rule): str(_mapping(spec).get("mode") or "") for rule, spec in rules.items()}

    rows = []
    for rule, name in order:
        mode = modes.get(rule, "") if name in listed else ""  # a condition outside the rule is not part of ANY/ALL
        state = _mapping(conditions[name])
        direction = str(state.get("direction") or rule)
        default_op = "<=" if direction == Rule.SCALE_IN else ">="
        label, op, kind = CONDITION_LABELS.get(name, (name.replace("_", " "), default_op, Unit.COUNT))
        met, sustained = bool(state.get("met")), bool(state.get("sustained"))
        required = as_number(state.get("required_secs")) or 0.0
        streak = as_number(state.get("streak_secs")) or 0.0
        if sustained:
            shown = "SUSTAINED"
        elif met:
            shown = "met"
        else:
            shown = "no"
        held = f"{streak:.0f}s / {required:.0f}s" if required > 0 else ("now" if met else NONE)
        title = _RULE_TITLES.get(rule, rule)
        rows.append(
            ConditionRow(
                rule=f"{title} ({mode})" if mode in _COMBINING_MODES else title,
                name=name,
                label=label,
                state=shown,
                value=fmt_value(state.get("value"), kind),
                threshold=f"{op} {fmt_value(state.get('threshold'), kind)}",
                held=held,
                note=clip(str(state.get("note") or ""), 60),
                met=met,
                sustained=sustained,
            )
        )
    return rows


def engine_rows(status: Mapping[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Per-engine load from the last metrics frame: ``(engine, token usage, queue, running, throughput)``.

    Engines that did not answer the last scrape are listed too, with why: a missing engine is what blocks
    scale-in, so it must be visible rather than silently absent.
    """
    frame = _mapping(status.get("last_frame"))
    engines = _mapping(frame.get("engines"))
    rows: list[tuple[str, str, str, str, str]] = []
    for engine in sorted(engines, key=_natural_key):
        gauges = _mapping(engines[engine])
        rows.append(
            (
                str(engine),
                fmt_value(gauges.get("token_usage"), Unit.FRACTION),
                fmt_value(gauges.get("num_queue_reqs")),
                fmt_value(gauges.get("num_running_reqs")),
                fmt_value(gauges.get("gen_throughput"), RATE),
            )
        )
    missing = _mapping(frame.get("missing"))
    for engine in sorted(missing, key=_natural_key):
        rows.append((str(engine), "no answer", clip(str(missing[engine]), 40), NONE, NONE))
    return rows


def metric_rows(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Pool-wide numbers of the last frame, as ``(label, value)``; unknown stays a dash, never a zero."""
    frame = _mapping(status.get("last_frame"))
    rl = _mapping(status.get("rl_signals"))
    trainer_wait = frame.get("trainer_wait_fraction", rl.get("trainer_wait_fraction"))
    blocked = frame.get("staleness_blocked_fraction", rl.get("staleness_blocked_fraction"))
    return [
        ("token usage", fmt_value(frame.get("token_usage"), Unit.FRACTION)),
        ("queue (total)", fmt_value(frame.get("total_queue"))),
        ("queue per engine", fmt_value(frame.get("queue_per_engine"))),
        ("running requests", fmt_value(frame.get("total_running"))),
        ("throughput", fmt_value(frame.get("total_throughput"), RATE)),
        ("throughput CV", fmt_value(frame.get("throughput_cv"), Unit.FRACTION)),
        ("queue-time P95", fmt_value(frame.get("queue_time_p95"), Unit.SECS)),
        ("TTFT P95", fmt_value(frame.get("ttft_p95"), Unit.SECS)),
        ("trainer waiting", fmt_value(trainer_wait, Unit.PERCENT)),
        ("staleness-blocked", fmt_value(blocked, Unit.PERCENT)),
    ]


def _per_direction(values: Any, totals: Mapping[str, Any] | None = None, counts: Any = None) -> str:
    """``out 40s of 60s · in —``: one timer per direction, as the policy keeps them."""
    values, counts = _mapping(values), _mapping(counts)
    parts = []
    for direction, short in ((ScaleAction.SCALE_OUT.value, "out"), (ScaleAction.SCALE_IN.value, "in")):
        text = fmt_duration(values.get(direction))
        total = as_number((totals or {}).get(direction))
        if text != NONE and total:
            text += f" of {fmt_duration(total)}"
        rejected = counts.get(direction)
        if isinstance(rejected, int) and rejected > 0:
            text += f" ({rejected} rejected)"
        parts.append(f"{short} {text}")
    return " · ".join(parts)


def overview_rows(
    status: Mapping[str, Any],
    health: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """The autoscaler at a glance, as ``(label, value)``: state, pool, bounds, decision, timers, pending request."""
    health, config = _mapping(health), _mapping(config)
    engines = _mapping(status.get("engines"))
    rows: list[tuple[str, str]] = []

    state = "enabled" if status.get("enabled") else "DISABLED (watching only)"
    if health.get("status"):
        state += f" · loop {health['status']}"
    rows.append(("autoscaler", state))

    def count(key: str) -> str:
        value = engines.get(key)
        return str(value) if isinstance(value, int) else NONE

    rows.append(("engines", f"{count('current')} live · {count('active')} active · {count('initial')} initial"))
    by_state = {s: n for s, n in _mapping(engines.get("by_state")).items() if n}  # zero counts are noise
    if by_state:
        rows.append(("by state", ", ".join(f"{s} {n}" for s, n in sorted(by_state.items()))))
    rows.append(("bounds", f"{status.get('floor', NONE)} .. {status.get('ceiling', NONE)} engines"))

    frame = _mapping(status.get("last_frame"))
    coverage = fmt_value(status.get("coverage"), Unit.PERCENT)
    if frame:
        coverage += f" ({frame.get('answered', NONE)} of {frame.get('asked', NONE)} engines answered)"
    rows.append(("coverage", coverage))

    decision = _mapping(status.get("last_decision"))
    if decision:
        action = str(decision.get("action") or ScaleAction.NONE.value)
        target = decision.get("target")
        head = f"{action} → {target}" if action != ScaleAction.NONE and target is not None else action
        rows.append(("decision", f"{head}: {clip(str(decision.get('reason') or ''), 240)}"))
    else:
        rows.append(("decision", "not evaluated yet"))

    rows.append(("pending", pending_text(status)))
    cooldowns = {
        ScaleAction.SCALE_OUT.value: config.get("scale_out_cooldown_secs"),
        ScaleAction.SCALE_IN.value: config.get("scale_in_cooldown_secs"),
    }
    rows.append(("cooldown", _per_direction(status.get("cooldown_remaining_secs"), cooldowns)))
    rows.append(("backoff", _per_direction(status.get("backoff_remaining_secs"), None, status.get("rejections"))))
    blockers = [str(b) for b in status.get("blockers") or []]
    rows.append(("blockers", "; ".join(blockers) if blockers else "none"))

    if health:
        scrape = f"last {fmt_duration(health.get('last_scrape_age_secs'))} ago" if as_number(
            health.get("last_scrape_age_secs")) else "none yet"
        scrape += f" · {health.get('scrapes', 0)} scrapes · {health.get('evaluations', 0)} evaluations"
        rows.append(("scrapes", scrape))
        if health.get("last_error"):
            rows.append(("last error", clip(str(health["last_error"]), 200)))
    return rows


def pending_text(status: Mapping[str, Any]) -> str:
    """The scale request in flight: the autoscaler's own (with its target and age), or one someone else started."""
    pending = _mapping(status.get("pending_request"))
    if pending:
        age = fmt_duration(pending.get("age_secs"))
        return (
            f"{pending.get('direction', '?')} {pending.get('request_id', '?')} {pending.get('status', '?')} "
            f"→ {pending.get('target', '?')} engines ({'just now' if age == NONE else age})"
        )
    running = status.get("scale_request_running")
    if running:
        return f"{running} (started outside the autoscaler)"
    return "none"


@cache
def _explained_outcomes() -> frozenset[str]:
    """Outcomes whose ``detail`` says why nothing (or not what was asked) happened: shown before the reason.

    The request statuses come from the scaling core, imported on first use to keep ``relax --help`` quick.
    """
    from relax.rollout.scaling import FAILED_STATUSES

    return frozenset({Outcome.REJECTED, Outcome.NOOP, Outcome.UNKNOWN}) | FAILED_STATUSES


def history_rows(entries: Iterable[Mapping[str, Any]], reason_width: int = 120) -> list[tuple[str, ...]]:
    """``GET /scale_history`` entries (newest first) as ``(time, action, from → to, outcome, reason)``."""
    rows = []
    for entry in entries:
        entry = _mapping(entry)
        outcome = str(entry.get("outcome") or NONE)
        reason = str(entry.get("reason") or "")
        if entry.get("detail") and outcome in _explained_outcomes():
            reason = f"[{entry['detail']}] {reason}"
        rows.append(
            (
                fmt_clock(entry.get("wall_time")),
                str(entry.get("action") or NONE),
                f"{entry.get('from_engines', '?')} → {entry.get('to_engines', '?')}",
                outcome,
                clip(reason, reason_width),
            )
        )
    return rows


# -- the monitor's own history ------------------------------------------------------------------------

SERIES = ("engines", "active", "token_usage", "total_queue", "throughput", "queue_time_p95", "ttft_p95")


class MetricSeries:
    """The last ``maxlen`` polls' numbers, one point per poll, for the charts.

    A point is appended even when the server has not scraped since the last poll: the x axis is the monitor's
    time, so a stalled scrape shows as a flat line rather than a compressed one.
    """

    def __init__(self, maxlen: int = HISTORY_POINTS) -> None:
        if maxlen < 2:
            raise ValueError(f"a chart needs at least 2 points, got maxlen={maxlen}")
        self.maxlen = maxlen
        self._points: deque[dict[str, float | None]] = deque(maxlen=maxlen)

    def add(self, status: Mapping[str, Any]) -> dict[str, float | None]:
        """Append one point from a ``GET /status`` answer (unknown numbers stay None: a gap, not a zero)."""
        engines = _mapping(status.get("engines"))
        frame = _mapping(status.get("last_frame"))
        point = {
            "engines": as_number(engines.get("current")),
            "active": as_number(engines.get("active")),
            "token_usage": as_number(frame.get("token_usage")),
            "total_queue": as_number(frame.get("total_queue")),
            "throughput": as_number(frame.get("total_throughput")),
            "queue_time_p95": as_number(frame.get("queue_time_p95")),
            "ttft_p95": as_number(frame.get("ttft_p95")),
        }
        self._points.append(point)
        return point

    def values(self, name: str) -> list[float | None]:
        """One series, oldest first; ``name`` is one of ``SERIES``."""
        if name not in SERIES:
            raise KeyError(f"unknown series {name!r}; one of {', '.join(SERIES)}")
        return [point[name] for point in self._points]

    def __len__(self) -> int:
        return len(self._points)


BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int = 40, lo: float | None = 0.0, hi: float | None = None) -> str:
    """The last ``width`` values as block characters between ``lo`` and ``hi``.

    ``lo`` defaults to 0 so the height means "how much", not "how much above the minimum" (a pool going 4 → 5
    must not look like it doubled); ``hi`` defaults to the largest finite value. Unknown values are a blank
    (a gap is not a zero) and ``+Inf`` is a full bar (a P95 in the overflow bucket is "too high").
    """
    shown = list(values)[-width:] if width > 0 else []
    finite = [v for v in shown if v is not None and math.isfinite(v)]
    if lo is None:
        lo = min(finite, default=0.0)
    if hi is None:
        hi = max(finite, default=lo)
    out = []
    for value in shown:
        if value is None or math.isnan(value):
            out.append(" ")
        elif math.isinf(value):
            out.append(BARS[-1] if value > 0 else BARS[0])
        elif hi <= lo:
            out.append(BARS[0])
        else:
            level = round((value - lo) / (hi - lo) * (len(BARS) - 1))
            out.append(BARS[max(0, min(len(BARS) - 1, level))])
    return "".join(out)


def chart_rows(series: MetricSeries, status: Mapping[str, Any], width: int = 40) -> list[tuple[str, str, str]]:
    """``(label, sparkline, now)`` for each chart; engines are scaled to the ceiling, usage to 1."""
    engines = _mapping(status.get("engines"))
    frame = _mapping(status.get("last_frame"))
    ceiling = as_number(status.get("ceiling"))
    counts = [v for v in series.values("engines") if v is not None]
    top = max([ceiling or 0.0, *counts]) or None
    now_engines = f"{engines.get('current', NONE)} live / {engines.get('active', NONE)} active"
    if status.get("floor") is not None and ceiling is not None:
        now_engines += f" ({status.get('floor')}..{status.get('ceiling')})"
    return [
        ("engines", sparkline(series.values("engines"), width, 0.0, top), now_engines),
        ("token usage", sparkline(series.values("token_usage"), width, 0.0, 1.0),
         fmt_value(frame.get("token_usage"), Unit.FRACTION)),
        ("queue", sparkline(series.values("total_queue"), width), fmt_value(frame.get("total_queue"))),
        ("throughput", sparkline(series.values("throughput"), width),
         fmt_value(frame.get("total_throughput"), RATE)),
        ("queue P95", sparkline(series.values("queue_time_p95"), width),
         fmt_value(frame.get("queue_time_p95"), Unit.SECS)),
        ("TTFT P95", sparkline(series.values("ttft_p95"), width), fmt_value(frame.get("ttft_p95"), Unit.SECS)),
    ]


def rows_text(rows: Iterable[tuple[str, ...]], styles: Mapping[str, str] | None = None) -> Text:
    """``(label, value, ...)`` rows as aligned lines of rich Text (what the panels display)."""
    rows = list(rows)
    width = max((len(row[0]) for row in rows), default=0)
    text = Text()
    for i, row in enumerate(rows):
        if i:
            text.append("\n")
        text.append(row[0].ljust(width + 2), style="bold")
        text.append("  ".join(row[1:]), style=(styles or {}).get(row[0], ""))
    return text


# --------------------------------------------------------------------------------------------------
# HTTP


def normalize_url(url: str) -> str:
    """The autoscaler base URL without a trailing slash; ``MonitorError`` (exit 2) when it is not an http URL."""
    text = (url or "").strip()
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise MonitorError(f"invalid --url {url!r}: {exc}", EXIT_USAGE) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise MonitorError(
            f"invalid --url {url!r}: expected http(s)://HOST:PORT/autoscaler, e.g. {DEFAULT_URL}", EXIT_USAGE
        )
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise MonitorError(f"invalid --url {url!r}: port {parsed.port} is not in 1..65535", EXIT_USAGE)
    return text.rstrip("/")


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _transport_error(exc: httpx.HTTPError, url: str, timeout: float) -> MonitorError:
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return MonitorError(f"invalid --url {url!r}: {exc}", EXIT_USAGE)
    if isinstance(exc, httpx.TimeoutException):
        return MonitorError(f"the autoscaler at {url} did not answer within {timeout:g}s")
    reason = str(exc) or type(exc).__name__
    return MonitorError(f"cannot reach the autoscaler at {url} ({reason}); is the run up, and is --url right?")


def _looks_like_status(body: Any) -> bool:
    return isinstance(body, Mapping) and _STATUS_KEYS.issubset(body)


def _answer(response: httpx.Response, url: str, token: str | None) -> Any:
    """The JSON of a 2xx answer; any other answer becomes a ``MonitorError`` worded for the operator."""
    status = response.status_code
    if status == 401:
        if token:
            raise MonitorError(f"401 unauthorized: the token (${TOKEN_ENV} or the run's file) was rejected by {url}")
        raise MonitorError(f"401 unauthorized: {url} requires the run's token; set {TOKEN_ENV}=$(cat <output dir>/"
                           "api-token) (without it, a run on this machine is found only at the exact address of its "
                           "'relax API:' line)")
    path = response.request.url.path
    if status == 404:
        raise MonitorError(f"{url} is not an autoscaler endpoint (GET {path} answered 404)")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not response.is_success:
        detail = body.get("detail") if isinstance(body, Mapping) else clip(response.text, 160)
        raise MonitorError(f"{url}: GET {path} answered HTTP {status}: {detail}")
    if body is None:
        raise MonitorError(f"{url} is not an autoscaler endpoint (GET {path} did not answer JSON)")
    return body


def check_endpoint(url: str, token: str | None = None, *, timeout: float = HTTP_TIMEOUT_S) -> dict[str, Any]:
    """Ask ``GET {url}/status`` once; return it, or raise ``MonitorError`` saying what is wrong and how to fix it.

    When the URL is a control plane's root rather than its ``/autoscaler`` prefix (the likeliest mistake), the
    message says so.
    """
    base = normalize_url(url)
    with httpx.Client(headers=_headers(token), timeout=timeout) as http:
        try:
            body = _answer(http.get(f"{base}/status"), base, token)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, base, timeout) from None
        except MonitorError as exc:
            if "not an autoscaler endpoint" in exc.message:
                raise MonitorError(exc.message + _hint(http, base, token), exc.exit_code) from None
            raise
        if not _looks_like_status(body):
            raise MonitorError(
                f"{base} is not an autoscaler endpoint (GET /status lacks {', '.join(sorted(_STATUS_KEYS))})"
                + _hint(http, base, token)
            )
    return dict(body)


def _hint(http: httpx.Client, base: str, token: str | None) -> str:
    """What to try instead: the ``/autoscaler`` prefix if it answers there, else whether the run has one."""
    if not base.endswith("/autoscaler"):
        try:
            response = http.get(f"{base}/autoscaler/status")
            if response.is_success and _looks_like_status(response.json()):
                return f"; did you mean --url {base}/autoscaler ?"
        except (httpx.HTTPError, ValueError):
            pass
        return f"; the URL should end in /autoscaler, e.g. {DEFAULT_URL}"
    return "; is the autoscaler enabled in this run (--autoscaler-config)?"


@dataclass
class Snapshot:
    """One poll of every route; ``problems`` lists the optional routes that failed (the rest still shows)."""

    status: dict[str, Any]
    conditions: dict[str, Any] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    fetched_at: float = 0.0
    problems: list[str] = field(default_factory=list)


async def fetch_snapshot(
    http: httpx.AsyncClient, url: str, token: str | None = None, *, history_limit: int = HISTORY_ROWS,
    timeout: float = HTTP_TIMEOUT_S,
) -> Snapshot:
    """GET status, conditions, health, scale_history and config concurrently.

    ``/status`` is the one that must answer (``MonitorError`` otherwise); a failure of any other route is noted
    in ``problems`` so one broken route costs one panel, not the whole screen.
    """
    base = url.rstrip("/")

    async def get(path: str, params: Mapping[str, Any] | None = None) -> Any:
        try:
            return _answer(await http.get(f"{base}{path}", params=params), base, token)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, base, timeout) from None

    results = await asyncio.gather(
        get("/status"),
        get("/conditions"),
        get("/health"),
        get("/scale_history", {"limit": history_limit}),
        get("/config"),
        return_exceptions=True,
    )
    status, conditions, health, history, config = results
    if isinstance(status, BaseException):
        if isinstance(status, MonitorError):
            raise status
        raise MonitorError(f"{type(status).__name__}: {status}")
    if not _looks_like_status(status):
        raise MonitorError(f"{base} is not an autoscaler endpoint (GET /status lacks the autoscaler's keys)")
    problems = []
    shaped: dict[str, Any] = {}
    for name, value in (("conditions", conditions), ("health", health), ("scale_history", history),
                        ("config", config)):
        if isinstance(value, BaseException):
            problems.append(f"/{name}: {value}")
        else:
            shaped[name] = value
    entries = _mapping(shaped.get("scale_history")).get("entries")
    return Snapshot(
        status=dict(status),
        conditions=dict(_mapping(shaped.get("conditions"))),
        health=dict(_mapping(shaped.get("health"))),
        history=[dict(e) for e in entries if isinstance(e, Mapping)] if isinstance(entries, list) else [],
        config=dict(_mapping(shaped.get("config"))),
        fetched_at=time.time(),
        problems=problems,
    )


# --------------------------------------------------------------------------------------------------
# The Textual app (a thin view over the functions above)


@cache
def _app_class() -> type[App[int]]:
    """Build the App class on first use, importing Textual only then (see the module docstring)."""
    from textual.app import App, ComposeResult
    from textual.binding import Binding
    from textual.containers import Horizontal, VerticalScroll
    from textual.widgets import DataTable, Footer, Header, Static
    from textual.worker import Worker

    class MonitorApp(App[int]):
        """Polls the autoscaler every ``interval`` seconds and redraws the panels from the pure row functions."""

        TITLE = "relax monitor"
        CSS = """
        #body { height: 1fr; }
        #top { height: auto; }
        #overview { width: 3fr; height: auto; border: round $accent; padding: 0 1; }
        #side { width: 2fr; height: auto; }
        #charts, #metrics { height: auto; border: round $accent; padding: 0 1; }
        #conditions { height: auto; border: round $accent; }
        #bottom { height: auto; }
        #engines { width: auto; height: auto; max-height: 20; border: round $accent; }
        #history { width: 1fr; height: auto; max-height: 24; border: round $accent; }
        #statusline { height: 1; padding: 0 1; background: $panel; }
        """
        BINDINGS = [Binding("q", "quit", "Quit"), Binding("r", "refresh_now", "Refresh now")]

        def __init__(
            self, url: str, token: str | None = None, interval: float = DEFAULT_INTERVAL_S, *,
            history_points: int = HISTORY_POINTS, timeout: float = HTTP_TIMEOUT_S,
        ) -> None:
            super().__init__()
            self.url = url.rstrip("/")
            self.token = token
            self.interval = interval
            self.timeout = timeout
            self.series = MetricSeries(history_points)
            self.snapshot: Snapshot | None = None
            self.polls = 0
            self.updates = 0
            self.last_error: str | None = None
            self._http: httpx.AsyncClient | None = None
            self._worker: Worker[None] | None = None

        def compose(self) -> ComposeResult:
            yield Header()
            with VerticalScroll(id="body"):
                with Horizontal(id="top"):
                    yield Static(id="overview")
                    with VerticalScroll(id="side"):
                        yield Static(id="charts")
                        yield Static(id="metrics")
                yield DataTable(id="conditions", cursor_type="row", zebra_stripes=True)
                with Horizontal(id="bottom"):
                    yield DataTable(id="engines", cursor_type="row", zebra_stripes=True)
                    yield DataTable(id="history", cursor_type="row", zebra_stripes=True)
            yield Static("connecting…", id="statusline")
            yield Footer()

        def on_mount(self) -> None:
            self.sub_title = self.url
            titles = {"#overview": "autoscaler", "#charts": "over time", "#metrics": "load (last scrape)",
                      "#conditions": "conditions", "#engines": "engines", "#history": "scale history"}
            for selector, title in titles.items():
                self.query_one(selector).border_title = title
            self.query_one("#conditions", DataTable).add_columns(
                "rule", "condition", "now", "value", "threshold", "held / needed", "note")
            self.query_one("#engines", DataTable).add_columns("engine", "usage", "queue", "running", "throughput")
            self.query_one("#history", DataTable).add_columns("time", "action", "from → to", "outcome", "reason")
            self._http = httpx.AsyncClient(headers=_headers(self.token), timeout=self.timeout)
            self._poll()
            self.set_interval(self.interval, self._poll)

        async def on_unmount(self) -> None:
            if self._http is not None:
                await self._http.aclose()

        def _poll(self) -> None:
            """A timer tick: skip it while a poll is still out, so a slow server is not buried in requests."""
            if self._worker is not None and self._worker.is_running:
                return
            self._worker = self.run_worker(self.refresh_data(), group="poll", exclusive=True)

        def action_refresh_now(self) -> None:
            """``r``: poll now; an older poll still out is cancelled, so what shows is newer than the key press."""
            self._worker = self.run_worker(self.refresh_data(), group="poll", exclusive=True)

        async def refresh_data(self) -> None:
            """One poll; every failure lands on the status line (a worker that raised would end the app)."""
            assert self._http is not None
            self.polls += 1
            try:
                snapshot = await fetch_snapshot(self._http, self.url, self.token, timeout=self.timeout)
            except MonitorError as exc:
                self._show_error(exc.message)
                return
            except Exception as exc:  # keep the dashboard up whatever one poll hits
                self._show_error(f"{type(exc).__name__}: {exc}")
                return
            self.snapshot = snapshot
            self.series.add(snapshot.status)
            self.last_error = None
            self._render_snapshot(snapshot)
            self.updates += 1

        def _show_error(self, message: str) -> None:
            self.last_error = message
            since = f" · showing data from {fmt_clock(self.snapshot.fetched_at)}" if self.snapshot else ""
            line = Text(f"update failed at {fmt_clock(time.time())}: {message}{since}", style="bold red")
            self.query_one("#statusline", Static).update(line)

        def _render_snapshot(self, snap: Snapshot) -> None:
            status = snap.status
            overview = overview_rows(status, snap.health, snap.config)
            styles = {"autoscaler": "green" if status.get("enabled") else "yellow",
                      "last error": "red", "blockers": "yellow" if status.get("blockers") else "green"}
            self.query_one("#overview", Static).update(rows_text(overview, styles))
            charts = self.query_one("#charts", Static)
            # label | now (padded) | sparkline: the sparkline takes whatever width the panel has left.
            rows = chart_rows(self.series, status, self.series.maxlen)
            label_w = max(len(label) for label, _, _ in rows) + 2
            now_w = max(len(now) for _, _, now in rows) + 2
            width = max(8, min(self.series.maxlen, (charts.content_region.width or 60) - label_w - now_w))
            lines = [(label, now.ljust(now_w - 2), spark) for label, spark, now in chart_rows(
                self.series, status, width)]
            charts.update(rows_text(lines, {"engines": "cyan"}))
            self.query_one("#metrics", Static).update(rows_text(metric_rows(status)))

            table = self.query_one("#conditions", DataTable)
            table.clear()
            for row in condition_rows(snap.conditions):
                style = "bold green" if row.sustained else ("yellow" if row.met else "dim")
                cells = list(row.cells())
                cells[2] = Text(cells[2], style=style)
                table.add_row(*cells)
            table = self.query_one("#engines", DataTable)
            table.clear()
            for cells in engine_rows(status):
                table.add_row(*cells)
            table = self.query_one("#history", DataTable)
            table.clear()
            for cells in history_rows(snap.history):
                table.add_row(*cells)

            line = f"updated {fmt_clock(snap.fetched_at)} · every {self.interval:g}s · r refresh · q quit"
            if snap.problems:
                line += " · " + "; ".join(snap.problems)
            self.query_one("#statusline", Static).update(Text(line, style="yellow" if snap.problems else ""))

    return MonitorApp


def make_app(
    url: str, token: str | None = None, interval: float = DEFAULT_INTERVAL_S, *,
    history_points: int = HISTORY_POINTS, timeout: float = HTTP_TIMEOUT_S,
) -> App[int]:
    """The monitor's Textual app for ``url`` (an autoscaler base URL, e.g. ``http://HOST:8000/autoscaler``)."""
    return _app_class()(url, token, interval, history_points=history_points, timeout=timeout)


# --------------------------------------------------------------------------------------------------
# The command


def _launch(app: App[int]) -> int:
    """Run the app in the terminal (a seam: tests check what would start without taking the terminal)."""
    app.run()
    return EXIT_OK


def run_monitor(args: argparse.Namespace) -> int:
    """``relax monitor``: check the URL once, then run the dashboard until ``q``; returns the exit code."""
    from relax.cluster.api_token import find_token

    try:
        access = find_token(normalize_url(args.url))
        url, token = access.url, access.token
        check_endpoint(url, token, timeout=args.http_timeout)
    except MonitorError as exc:
        print(f"relax monitor: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("relax monitor: interrupted", file=sys.stderr)
        return 130
    app = make_app(url, token, args.interval, history_points=args.history_points, timeout=args.http_timeout)
    return _launch(app)


def add_monitor_parser(subparsers: Any) -> None:
    """Register ``monitor`` on ``relax``'s sub-parsers; ``func`` returns the exit code."""
    monitor = subparsers.add_parser(
        "monitor", help="terminal dashboard of a running autoscaler",
        description="Watch the rollout pool's autoscaler: engines over time, load, each scale condition against "
        "its threshold and duration, cooldowns, the pending request and recent decisions. Keys: r refresh, q quit.",
    )
    monitor.add_argument("--url", default=DEFAULT_URL, metavar="URL",
                         help=f"the autoscaler's base URL (default {DEFAULT_URL}); the bearer token is read from "
                         f"${TOKEN_ENV}")
    monitor.add_argument("--interval", type=argtypes.positive_seconds, default=DEFAULT_INTERVAL_S, metavar="SECS",
                         help=f"seconds between polls (default {DEFAULT_INTERVAL_S:g})")
    monitor.add_argument("--http-timeout", type=argtypes.positive_seconds, default=HTTP_TIMEOUT_S, metavar="SECS",
                         help=f"timeout of each HTTP call (default {HTTP_TIMEOUT_S:g})")
    monitor.add_argument("--history-points", type=argtypes.int_at_least(2, "points in a chart"),
                         default=HISTORY_POINTS, metavar="N",
                         help=f"polls kept for the charts (default {HISTORY_POINTS})")
    monitor.set_defaults(func=run_monitor)
