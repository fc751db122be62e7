"""``relax monitor``: the pure data shaping, the pre-flight check, and the Textual app against a real server.

The server is the real stack on 127.0.0.1: the control plane app (``create_app``, bearer token on) over the
in-process ``LocalRollout``, with the real ``autoscaler_router`` over a real ``AutoscalerService`` mounted under
``/autoscaler``. The same app serves each fake engine's ``/engines/<id>/metrics`` as Prometheus text from
``prometheus_client``, so the numbers the monitor shows went through scrape, parse, aggregate, policy, JSON and
HTTP exactly as in a run. The service is stepped by hand with a fake clock, so what it serves is deterministic;
the test compares the widgets with what the routes serve.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from textual.widgets import DataTable, Static

from relax.autoscaler import monitor
from relax.autoscaler.config import AutoscalerConfig
from relax.autoscaler.monitor import (
    NONE,
    MetricSeries,
    MonitorError,
    add_monitor_parser,
    chart_rows,
    condition_rows,
    engine_rows,
    fmt_clock,
    fmt_duration,
    fmt_value,
    history_rows,
    make_app,
    metric_rows,
    normalize_url,
    overview_rows,
    sparkline,
)
from relax.autoscaler.policy import CONDITION_LABELS, SCALE_IN_CONDITIONS, SCALE_OUT_CONDITIONS, STALENESS_GATE
from relax.autoscaler.routes import autoscaler_router
from relax.autoscaler.service import AutoscalerService
from relax.cluster.network import free_port
from relax.rollout.control.api import create_app
from tests.local_manager import LocalManager
from tests.loopback import LoopbackServer

T = TypeVar("T")
TOKEN = "monitor-test-token"
WALL = 1_700_000_000.0

# -- the real server -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What every fake engine reports; each scrape also records ``ttft`` / ``queue_time`` observations."""

    usage: float
    queue: float
    running: float
    throughput: float
    ttft: tuple[float, ...] = ()
    queue_time: tuple[float, ...] = ()


BUSY = Load(usage=0.6, queue=30.0, running=16.0, throughput=400.0, ttft=(0.4, 0.8, 1.5), queue_time=(2.0, 3.0))
IDLE = Load(usage=0.1, queue=0.0, running=1.0, throughput=50.0, ttft=(0.2,), queue_time=(0.05,))


class FakeEngine:
    """One engine's Prometheus registry: SGLang-named gauges and cumulative latency histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge(name, name, ["model_name"], registry=self.registry).labels("default")
            for name in ("sglang:token_usage", "sglang:num_queue_reqs", "sglang:num_running_reqs",
                         "sglang:gen_throughput")
        }
        buckets = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "ttft", ["model_name"], buckets=buckets,
                              registry=self.registry).labels("default")
        self.queue_time = Histogram("sglang:queue_time_seconds", "queue", ["model_name"], buckets=buckets,
                                    registry=self.registry).labels("default")

    def scrape(self, load: Load) -> str:
        for name, value in (("sglang:token_usage", load.usage), ("sglang:num_queue_reqs", load.queue),
                            ("sglang:num_running_reqs", load.running), ("sglang:gen_throughput", load.throughput)):
            self.gauges[name].set(value)
        for value in load.ttft:
            self.ttft.observe(value)
        for value in load.queue_time:
            self.queue_time.observe(value)
        return generate_latest(self.registry).decode()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Served:
    """The control plane on its own thread and event loop (LocalRollout and the service live on that loop)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/autoscaler"
        self.load = BUSY
        self.engines: dict[str, FakeEngine] = {}
        self.clock = FakeClock()
        from relax.testing.local_rollout import LocalRollout  # here: the pure-shaping tests run without it

        self.local = LocalRollout(2)
        config = AutoscalerConfig.model_validate({
            "enabled": True, "min_engines": 2, "max_engines": 6,
            "metrics_interval_secs": 10.0, "evaluation_interval_secs": 10.0, "condition_window_secs": 60.0,
            "scale_out_cooldown_secs": 60.0, "scale_in_cooldown_secs": 120.0,
            "scale_out_policy": {"condition_duration_secs": 20.0, "max_delta": 2},
            "scale_in_policy": {"condition_duration_secs": 30.0},
        })
        manager = LocalManager(self.local, lambda engine_id: f"{self.root}/engines/{engine_id}")
        self.service = AutoscalerService(config, manager, clock=self.clock,
                                         wall_clock=lambda: WALL, scrape_timeout=30.0, engine_token=TOKEN)
        app = create_app(self.local, token=TOKEN, autoscaler=autoscaler_router(self.service))

        @app.get("/engines/{engine_id}/metrics")
        async def metrics(engine_id: str) -> PlainTextResponse:
            text = self.engines.setdefault(engine_id, FakeEngine()).scrape(self.load)
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        self.loop = asyncio.new_event_loop()
        self.http = LoopbackServer(app, port=self.port, loop=self.loop, lifespan="off", name="control-plane")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the server's loop and wait for it (the only loop LocalRollout may be used on)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=20)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    async def steps(self, count: int) -> None:
        for _ in range(count):
            await self.service.step()
            self.clock.now += 10.0

    def get(self, path: str) -> Any:
        """What the route serves right now, as any client would read it."""
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=5).json()

    def __enter__(self) -> Served:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.run(self.local.aclose())
        self.http.stop()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """Scale out 2 -> 4 under a queue backlog, let it finish, then one more cycle on the 4 engines."""
    with Served() as server:
        server.run(server.steps(3))  # the backlog holds 20 s at the third step: scale out (+2, max_delta)
        server.run(server.local.wait_idle())
        server.run(server.service.poll_pending())
        server.run(server.steps(1))
        yield server


# -- the app against the real server ---------------------------------------------------------------------


def plain(app: Any, selector: str) -> str:
    content = app.query_one(selector, Static).content
    return content.plain if hasattr(content, "plain") else str(content)


def table(app: Any, selector: str) -> list[list[str]]:
    widget = app.query_one(selector, DataTable)
    return [[str(cell) for cell in widget.get_row_at(i)] for i in range(widget.row_count)]


async def wait_for(pilot: Any, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the monitor did not update in time")
        await pilot.pause(0.02)


async def test_the_app_shows_what_the_autoscaler_serves_and_r_refreshes(served: Served) -> None:
    status = served.get("/status")
    assert status["engines"]["current"] == 4  # the fixture's scale-out landed
    history = served.get("/scale_history")["entries"]
    app = make_app(served.url, TOKEN, interval=60.0)  # the timer never fires in the test: only start-up and `r`
    async with app.run_test(size=(180, 70)) as pilot:
        await wait_for(pilot, lambda: app.updates >= 1)

        overview = plain(app, "#overview")
        assert "4 live · 4 active · 2 initial" in overview
        assert "2 .. 6 engines" in overview
        assert "ACTIVE 4" in overview
        cooldown = fmt_duration(status["cooldown_remaining_secs"]["scale_out"])
        assert cooldown != NONE and f"out {cooldown} of 1m00s" in overview
        assert "pending" in overview and "none" in overview

        charts = plain(app, "#charts")
        assert "4 live / 4 active (2..6)" in charts
        metrics = plain(app, "#metrics")
        frame = status["last_frame"]
        assert "0.60" in metrics and "120" in metrics and "1600 tok/s" in metrics
        assert fmt_value(frame["ttft_p95"], "secs") in metrics and frame["ttft_p95"] is not None
        assert fmt_value(frame["queue_time_p95"], "secs") in metrics and frame["queue_time_p95"] is not None

        engines = table(app, "#engines")
        assert [row[0] for row in engines] == sorted(served.engines, key=lambda e: int(e.rsplit("_", 1)[-1]))
        assert all(row[1:] == ["0.60", "30", "16", "400 tok/s"] for row in engines) and len(engines) == 4

        conditions = {(row[0].split()[0], row[1]): row for row in table(app, "#conditions")}
        queue = conditions["scale-out", "queue per engine"]
        assert queue[2:6] == ["met", "30", ">= 10", "0s / 20s"]  # the pool changed size: the streak restarted
        assert conditions["scale-out", "token usage"][2:5] == ["no", "0.60", ">= 0.85"]
        assert conditions["scale-in", "token usage"][2:5] == ["no", "0.60", "<= 0.30"]
        assert len(conditions) == len(served.get("/conditions")["conditions"])

        rows = table(app, "#history")
        assert rows[0][:4] == [fmt_clock(WALL), "scale_out", "2 → 4", history[0]["outcome"]]
        assert "queue per engine 30 >= 10" in rows[0][4]
        assert "updated" in plain(app, "#statusline")

        # The load drops; the service runs one more cycle; `r` shows it without waiting for the timer.
        served.load = IDLE
        served.run(served.steps(1))
        assert plain(app, "#metrics").count("120") == 1  # nothing changes on screen before `r`
        await pilot.press("r")
        await wait_for(pilot, lambda: app.updates >= 2)
        metrics = plain(app, "#metrics")
        assert "0.10" in metrics and "200 tok/s" in metrics
        assert all(row[2] == "0" for row in table(app, "#engines"))
        low = next(row for row in table(app, "#conditions") if row[1] == "token usage" and "in" in row[0])
        assert low[2] == "met" and low[3] == "0.10" and low[4] == "<= 0.30"
        assert len(app.series) == 2 and app.series.values("engines") == [4.0, 4.0]

        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


async def test_a_failed_poll_stays_on_screen_instead_of_ending_the_app() -> None:
    url = f"http://127.0.0.1:{free_port()}/autoscaler"  # nothing listens there
    app = make_app(url, None, interval=60.0, timeout=2.0)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: app.polls >= 1 and app.last_error is not None)
        assert "cannot reach the autoscaler" in plain(app, "#statusline")
        assert app.updates == 0 and app.is_running
        await pilot.press("q")
        await pilot.pause()


# -- the command: check once, then the TUI ----------------------------------------------------------------


@pytest.fixture
def command(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[int, list[Any]]]:
    """``command(*argv)`` -> ``(exit code, apps that would have started)``; the terminal is never taken."""
    launched: list[Any] = []

    def launch(app: Any) -> int:
        launched.append(app)
        return 0

    monkeypatch.setattr(monitor, "_launch", launch)
    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)
    parser = argparse.ArgumentParser(prog="relax")
    add_monitor_parser(parser.add_subparsers())

    def run(*argv: str) -> tuple[int, list[Any]]:
        args = parser.parse_args(["monitor", *argv])
        return args.func(args), launched

    return run


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("relax monitor: ")
    return lines[0]


def test_unreachable_url_is_one_line_and_exit_1(command: Any, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/autoscaler"
    code, launched = command("--url", url, "--http-timeout", "2")
    line = one_line_error(capsys)
    assert code == 1 and launched == []
    assert f"cannot reach the autoscaler at {url}" in line and "--url" in line


@pytest.mark.parametrize("url", ["not a url", "ftp://127.0.0.1/autoscaler", "http://", "127.0.0.1:8000",
                                 "http://127.0.0.1:99999/autoscaler"])
def test_malformed_url_is_exit_2(command: Any, capsys: pytest.CaptureFixture[str], url: str) -> None:
    code, launched = command("--url", url)
    line = one_line_error(capsys)
    assert code == 2 and launched == [] and "invalid --url" in line


def test_missing_or_wrong_token_is_exit_1(
    served: Served, command: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, launched = command("--url", served.url)
    assert code == 1 and launched == []
    assert "401 unauthorized" in (line := one_line_error(capsys)) and "RELAX_API_TOKEN" in line
    monkeypatch.setenv("RELAX_API_TOKEN", "wrong")
    code, _ = command("--url", served.url)
    assert code == 1 and "was rejected" in one_line_error(capsys)


def test_not_an_autoscaler_endpoint_is_exit_1_with_a_hint(
    served: Served, command: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    code, launched = command("--url", served.root)  # the control plane's root, not its /autoscaler prefix
    line = one_line_error(capsys)
    assert code == 1 and launched == []
    assert "is not an autoscaler endpoint" in line and f"did you mean --url {served.root}/autoscaler" in line
    code, _ = command("--url", f"{served.root}/rollout/engines")  # JSON, but not the autoscaler's
    assert code == 1 and "not an autoscaler endpoint" in one_line_error(capsys)


def test_a_good_url_starts_the_app_with_the_token(
    served: Served, command: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    code, (app,) = command("--url", served.url + "/", "--interval", "0.5")
    assert code == 0 and capsys.readouterr().err == ""
    assert (app.url, app.token, app.interval) == (served.url, TOKEN, 0.5)


def test_parser_defaults_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="relax")
    add_monitor_parser(parser.add_subparsers())
    args = parser.parse_args(["monitor"])
    assert (args.url, args.interval, args.func) == ("http://127.0.0.1:8000/autoscaler", 2.0, monitor.run_monitor)
    for bad in (["--interval", "0"], ["--interval", "x"], ["--history-points", "1"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["monitor", *bad])
        assert exc.value.code == 2
    capsys.readouterr()


def test_normalize_url() -> None:
    assert normalize_url(" http://h:8000/autoscaler/ ") == "http://h:8000/autoscaler"
    with pytest.raises(MonitorError) as exc:
        normalize_url("")
    assert exc.value.exit_code == 2


# -- pure shaping ---------------------------------------------------------------------------------------

CONDITIONS = {
    "reason": "no scaling yet",
    "rules": {
        "scale_out": {"mode": "ANY", "conditions": ["token_usage_high", "ttft_p95_high", "future_signal"]},
        "scale_in": {"mode": "ALL", "conditions": ["metrics_complete", "no_queue"]},
        "gate": {"mode": "suppresses scale-out", "conditions": ["staleness_blocked"]},
    },
    "conditions": {
        "no_queue": {"value": 3.0, "threshold": 0.0, "met": False, "streak_secs": 0.0, "required_secs": 120.0,
                     "sustained": False, "direction": "scale_in", "note": ""},
        "token_usage_high": {"value": 0.9, "threshold": 0.85, "met": True, "streak_secs": 12.0,
                             "required_secs": 30.0, "sustained": False, "direction": "scale_out", "note": ""},
        "ttft_p95_high": {"value": "+Inf", "threshold": 10.0, "met": True, "streak_secs": 40.0,
                          "required_secs": 30.0, "sustained": True, "direction": "scale_out", "note": ""},
        "metrics_complete": {"value": 0.5, "threshold": 1.0, "met": False, "streak_secs": 0.0,
                             "required_secs": 120.0, "sustained": False, "direction": "scale_in",
                             "note": "engine_3 did not answer"},
        "staleness_blocked": {"value": None, "threshold": 0.5, "met": False, "streak_secs": 0.0,
                              "required_secs": 0.0, "sustained": False, "direction": "gate", "note": "no data"},
        "brand_new": {"value": 2, "threshold": 1, "met": True, "streak_secs": 0.0, "required_secs": 0.0,
                      "sustained": True, "direction": "scale_in", "note": ""},
    },
}


def test_condition_rows_group_by_rule_and_show_value_threshold_and_streak() -> None:
    rows = condition_rows(CONDITIONS)
    assert [r.name for r in rows] == ["token_usage_high", "ttft_p95_high", "metrics_complete", "no_queue",
                                      "staleness_blocked", "brand_new"]
    usage, ttft, complete, queue, gate, new = rows
    assert usage.cells() == ("scale-out (ANY)", "token usage", "met", "0.90", ">= 0.85", "12s / 30s", "")
    assert (ttft.state, ttft.value, ttft.threshold, ttft.held) == ("SUSTAINED", "+Inf", ">= 10.00s", "40s / 30s")
    assert complete.cells() == ("scale-in (ALL)", "metrics coverage", "no", "50%", ">= 100%", "0s / 120s",
                                "engine_3 did not answer")
    assert (queue.value, queue.threshold) == ("3", "<= 0")
    assert (gate.rule, gate.value, gate.held, gate.note) == ("gate", NONE, NONE, "no data")
    assert (new.rule, new.label, new.threshold, new.held) == ("scale-in", "brand new", "<= 1", "now")
    assert condition_rows({}) == [] and condition_rows({"conditions": None}) == []


def test_condition_rows_speak_the_policys_vocabulary() -> None:
    """Without ``rules`` in the answer, the policy's own rules order the rows, worded as the policy words them."""
    state = {"value": 0.5, "threshold": 0.4, "met": True, "streak_secs": 0.0, "required_secs": 0.0,
             "sustained": True, "note": ""}
    names = [*SCALE_OUT_CONDITIONS, *SCALE_IN_CONDITIONS, STALENESS_GATE]
    rows = condition_rows({"conditions": {str(name): dict(state) for name in reversed(names)}})
    assert [row.name for row in rows] == [str(name) for name in names]
    assert [row.rule for row in rows] == ["scale-out (ANY)"] * 5 + ["scale-in (ALL)"] * 5 + ["gate"]
    for row in rows:
        label, op, _ = CONDITION_LABELS[row.name]
        assert row.label == label and row.threshold.startswith(op), row


STATUS = {
    "enabled": True, "floor": 4, "ceiling": 8, "coverage": 0.75,
    "engines": {"current": 5, "active": 3, "initial": 4, "by_state": {"ACTIVE": 3, "STARTING": 2}},
    "last_decision": {"action": "scale_out", "target": 7, "reason": "scale out 5 -> 7 (+2): queue per engine 25"},
    "pending_request": {"direction": "scale_out", "request_id": "so-3", "status": "CREATING", "age_secs": 12.4,
                        "target": 7},
    "scale_request_running": "so-3",
    "cooldown_remaining_secs": {"scale_out": 48.0, "scale_in": 0.0},
    "backoff_remaining_secs": {"scale_out": 0.0, "scale_in": 95.0},
    "rejections": {"scale_out": 0, "scale_in": 2},
    "blockers": ["scale_out request so-3 is pending (CREATING)"],
    "rl_signals": {"trainer_wait_fraction": 0.4},
    "last_frame": {
        "asked": 4, "answered": 3, "token_usage": 0.7, "total_queue": 75.0, "queue_per_engine": 25.0,
        "total_running": 30.0, "total_throughput": 1234.5, "queue_time_p95": 1.5, "ttft_p95": "+Inf",
        "throughput_cv": None, "trainer_wait_fraction": 0.4, "staleness_blocked_fraction": None,
        "missing": {"engine_3": "ReadTimeout"},
        "engines": {
            "engine_10": {"token_usage": 0.5, "num_queue_reqs": 5.0, "num_running_reqs": 10.0, "gen_throughput": 400},
            "engine_2": {"token_usage": 0.9, "num_queue_reqs": 40.0, "num_running_reqs": 10.0,
                         "gen_throughput": 434.5},
            "engine_0": {"token_usage": 0.7, "num_queue_reqs": 30.0, "num_running_reqs": None, "gen_throughput": 400},
        },
    },
}


def test_overview_rows() -> None:
    health = {"status": "ok", "last_scrape_age_secs": 3.2, "scrapes": 40, "evaluations": 13,
              "last_error": "relax_status: TimeoutError"}
    rows = dict(overview_rows(STATUS, health, {"scale_out_cooldown_secs": 60.0, "scale_in_cooldown_secs": 300.0}))
    assert rows["autoscaler"] == "enabled · loop ok"
    assert rows["engines"] == "5 live · 3 active · 4 initial"
    assert rows["by state"] == "ACTIVE 3, STARTING 2"
    assert rows["bounds"] == "4 .. 8 engines"
    assert rows["coverage"] == "75% (3 of 4 engines answered)"
    assert rows["decision"] == "scale_out → 7: scale out 5 -> 7 (+2): queue per engine 25"
    assert rows["pending"] == "scale_out so-3 CREATING → 7 engines (12s)"
    assert rows["cooldown"] == f"out 48s of 1m00s · in {NONE}"
    assert rows["backoff"] == f"out {NONE} · in 1m35s (2 rejected)"
    assert rows["blockers"] == "scale_out request so-3 is pending (CREATING)"
    assert rows["scrapes"] == "last 3s ago · 40 scrapes · 13 evaluations"
    assert rows["last error"] == "relax_status: TimeoutError"

    bare = dict(overview_rows({"enabled": False, "scale_request_running": "si-9", "engines": {}}))
    assert bare["autoscaler"].startswith("DISABLED")
    assert bare["pending"] == "si-9 (started outside the autoscaler)"
    assert bare["engines"] == f"{NONE} live · {NONE} active · {NONE} initial"
    assert bare["decision"] == "not evaluated yet" and bare["blockers"] == "none"


def test_metric_and_engine_rows() -> None:
    metrics = dict(metric_rows(STATUS))
    assert metrics["token usage"] == "0.70" and metrics["queue (total)"] == "75"
    assert metrics["queue per engine"] == "25" and metrics["throughput"] == "1234 tok/s"
    assert metrics["queue-time P95"] == "1.50s" and metrics["TTFT P95"] == "+Inf"
    assert metrics["throughput CV"] == NONE and metrics["staleness-blocked"] == NONE
    assert metrics["trainer waiting"] == "40%"
    assert engine_rows(STATUS) == [
        ("engine_0", "0.70", "30", NONE, "400 tok/s"),
        ("engine_2", "0.90", "40", "10", "434 tok/s"),
        ("engine_10", "0.50", "5", "10", "400 tok/s"),
        ("engine_3", "no answer", "ReadTimeout", NONE, NONE),
    ]
    assert engine_rows({}) == [] and all(value == NONE for _, value in metric_rows({}))


def test_history_rows() -> None:
    entries = [
        {"wall_time": WALL, "action": "scale_in", "from_engines": 6, "to_engines": 5, "outcome": "REJECTED",
         "detail": "another scale operation is running", "reason": "scale in 6 -> 5 (-1): token usage 0.10"},
        {"wall_time": WALL - 90, "action": "scale_out", "from_engines": 4, "to_engines": 6, "outcome": "ACTIVE",
         "detail": None, "reason": "x" * 300},
    ]
    rejected, grown = history_rows(entries, reason_width=80)
    assert rejected[:4] == (fmt_clock(WALL), "scale_in", "6 → 5", "REJECTED")
    assert rejected[4].startswith("[another scale operation is running] scale in 6 -> 5")
    assert grown[2] == "4 → 6" and len(grown[4]) == 80 and grown[4].endswith("…")


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], lo=0, hi=7) == "▁▂▃▄▅▆▇█"
    assert sparkline([2.0, None, float("inf"), 4.0]) == "▅ ██"  # lo 0, hi the largest finite value
    assert sparkline([3.0, 3.0], lo=3.0) == "▁▁"  # flat: no scale to speak of
    assert sparkline(list(range(100)), width=10) == sparkline(list(range(90, 100)), width=10, hi=99)
    assert sparkline([], width=10) == "" and sparkline([1.0], width=0) == ""


def test_metric_series_keeps_the_last_points_and_charts_them() -> None:
    series = MetricSeries(maxlen=3)
    for current in (4, 5, 6, 7):
        series.add({**STATUS, "engines": {"current": current, "active": current}})
    assert len(series) == 3 and series.values("engines") == [5.0, 6.0, 7.0]
    assert series.values("ttft_p95") == [float("inf")] * 3
    charts = {label: (spark, now) for label, spark, now in chart_rows(series, STATUS, width=3)}
    assert charts["engines"] == ("▅▆▇", "5 live / 3 active (4..8)")  # scaled to the ceiling of 8
    assert charts["token usage"] == ("▆▆▆", "0.70")  # 0.7 of 1.0
    assert charts["TTFT P95"] == ("███", "+Inf")
    with pytest.raises(KeyError):
        series.values("nope")
    with pytest.raises(ValueError):
        MetricSeries(maxlen=1)


def test_formatting() -> None:
    assert fmt_value(None) == NONE and fmt_value("junk") == NONE and fmt_value(True) == NONE
    assert fmt_value("+Inf", "secs") == "+Inf" and fmt_value(2.5) == "2.5" and fmt_value(3.0) == "3"
    assert fmt_value(0.256, "percent") == "26%" and fmt_value(4.0, "rate") == "4.00 tok/s"
    assert fmt_duration(0) == NONE and fmt_duration(59.4) == "59s" and fmt_duration(125) == "2m05s"
    assert fmt_clock(None) == NONE
