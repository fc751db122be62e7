"""Prometheus parsing, P95 interpolation, delta-based P95, cluster frames, history and scraping."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from relax.autoscaler.metrics import (
    ClusterFrame,
    EngineMetrics,
    Histogram,
    MetricsHistory,
    MetricsParseError,
    ScrapeError,
    build_cluster_frame,
    histogram_quantile,
    parse_engine_metrics,
)
from relax.autoscaler.scrape import metrics_url, scrape_all
from relax.cluster.network import free_port
from relax.engines.builtin.metrics import EngineMetrics as BuiltinEngineMetrics
from relax.engines.builtin.metrics import LoadSnapshot
from tests.loopback import LoopbackServer

INF = math.inf


def text_histogram(name: str, buckets: dict[str, float], labels: str = 'model_name="m"') -> str:
    lines = [f"# TYPE {name} histogram"]
    for le, count in buckets.items():
        lines.append(f'{name}_bucket{{le="{le}",{labels}}} {count}')
    lines.append(f"{name}_count{{{labels}}} {buckets['+Inf']}")
    lines.append(f"{name}_sum{{{labels}}} 1.0")
    return "\n".join(lines) + "\n"


def ttft_text(counts: tuple[float, float, float, float]) -> str:
    """TTFT histogram with bounds 0.1, 0.5, 1.0, +Inf and the given cumulative counts."""
    return text_histogram(
        "sglang:time_to_first_token_seconds", dict(zip(("0.1", "0.5", "1.0", "+Inf"), counts, strict=True))
    )


# -- histogram_quantile against hand-computed values -----------------------------------------------------

BOUNDS = (0.1, 0.5, 1.0, INF)


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        # rank 47.5 lies in (0.5, 1.0]: 30 below, 18 inside -> 0.5 + 0.5 * 17.5 / 18
        (0.95, (10, 30, 48, 50), 0.5 + 0.5 * 17.5 / 18),
        # rank 25 lies in (0.1, 0.5]: 10 below, 20 inside -> 0.1 + 0.4 * 15 / 20 = 0.4
        (0.5, (10, 30, 48, 50), 0.4),
        # rank 2.5 lies in the first bucket, which starts at 0 -> 0.1 * 2.5 / 10
        (0.05, (10, 30, 48, 50), 0.025),
        # rank exactly at a bucket's cumulative count -> that bucket's upper bound
        (0.2, (10, 30, 48, 50), 0.1),
        # empty buckets below are skipped: rank 95 in (0.5, 1.0] with nothing below 0.5
        (0.95, (0, 0, 100, 100), 0.5 + 0.5 * 95 / 100),
    ],
)
def test_p95_interpolation_by_hand(q: float, counts: tuple, expected: float) -> None:
    assert histogram_quantile(q, BOUNDS, counts) == pytest.approx(expected)


def test_quantile_in_the_inf_bucket_is_inf() -> None:
    # rank 47.5 > 45 finite observations: the quantile is beyond the largest finite bound
    assert histogram_quantile(0.95, BOUNDS, (10, 30, 45, 50)) == INF
    assert histogram_quantile(0.95, BOUNDS, (0, 0, 0, 3)) == INF


def test_quantile_without_observations_is_unknown() -> None:
    assert histogram_quantile(0.95, BOUNDS, (0, 0, 0, 0)) is None
    assert histogram_quantile(0.95, (INF,), (7,)) is None  # only +Inf: the shape is unknown


def test_non_positive_first_bound_returns_the_bound() -> None:
    assert histogram_quantile(0.25, (0.0, 1.0, INF), (5, 10, 10)) == 0.0


def test_quantile_rejects_bad_q() -> None:
    with pytest.raises(ValueError, match="within"):
        histogram_quantile(1.5, BOUNDS, (1, 1, 1, 1))


def test_quantile_smooths_non_monotonic_counts() -> None:
    # float noise in a delta can make a cumulative count dip; treat it as flat, like Prometheus
    assert histogram_quantile(0.55, BOUNDS, (10, 12, 11.999, 20)) == pytest.approx(0.1 + 0.4 * 1 / 2)
    assert histogram_quantile(0.95, BOUNDS, (10, 12, 11.999, 20)) == INF


def test_p95_of_real_prometheus_client_observations() -> None:
    """End-to-end against prometheus_client's own exposition (the built-in engine's metrics).

    The built-in engine uses SGLang 0.5.23's TTFT bounds (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, ...).
    """
    engine = BuiltinEngineMetrics("m")
    for _ in range(90):
        engine.ttft.observe(0.3)  # bucket (0.2, 0.4]
    for _ in range(10):
        engine.ttft.observe(3.0)  # bucket (2, 4]
    text = engine.render(LoadSnapshot(2, 3, 400, 1000), "7").decode()
    parsed = parse_engine_metrics(text)
    assert parsed.ttft is not None and parsed.ttft.total == 100
    assert {0.2, 0.4, 2.0, 4.0} <= set(parsed.ttft.bounds)
    # rank 95: 90 at or below 2, 10 inside (2, 4] -> 2 + 2 * 5 / 10
    assert parsed.ttft.quantile(0.95) == pytest.approx(3.0)
    assert (parsed.num_running_reqs, parsed.num_queue_reqs) == (2, 3)
    assert (parsed.num_used_tokens, parsed.max_total_num_tokens) == (400, 1000)
    assert parsed.token_usage == pytest.approx(0.4)
    assert parsed.gen_throughput == 0
    assert parsed.queue_time is not None and parsed.queue_time.total == 0


# -- delta and merge -------------------------------------------------------------------------------------


def test_delta_p95_ignores_old_history() -> None:
    old = Histogram(BOUNDS, (1000, 1000, 1000, 1000))  # an hour of fast requests
    new = Histogram(BOUNDS, (1000, 1000, 1020, 1020))  # then 20 slow ones in (0.5, 1.0]
    assert new.quantile(0.95) == pytest.approx(0.1 * 969 / 1000)  # cumulative: still looks fast
    recent = new.delta(old)
    assert recent.counts == (0, 0, 20, 20)
    assert recent.quantile(0.95) == pytest.approx(0.5 + 0.5 * 19 / 20)


def test_delta_falls_back_on_counter_reset_or_new_layout() -> None:
    before = Histogram(BOUNDS, (10, 20, 30, 40))
    restarted = Histogram(BOUNDS, (1, 2, 3, 4))
    assert restarted.delta(before) is restarted
    relaid = Histogram((0.2, INF), (50, 60))
    assert relaid.delta(before) is relaid
    assert before.delta(None) is before


def test_merge_identical_layouts_adds_counts() -> None:
    merged = Histogram.merge([Histogram(BOUNDS, (1, 2, 3, 4), 1.0), Histogram(BOUNDS, (10, 20, 30, 40), 2.0)])
    assert merged == Histogram(BOUNDS, (11, 22, 33, 44), 3.0)
    assert Histogram.merge([]) is None


def test_merge_different_layouts_uses_step_functions() -> None:
    a = Histogram((0.1, 1.0, INF), (5, 10, 10))
    b = Histogram((0.5, INF), (4, 6))
    merged = Histogram.merge([a, b])
    assert merged is not None
    assert merged.bounds == (0.1, 0.5, 1.0, INF)
    assert merged.counts == (5 + 0, 5 + 4, 10 + 4, 10 + 6)


def test_histogram_validates_its_shape() -> None:
    with pytest.raises(ValueError, match="counts"):
        Histogram(BOUNDS, (1, 2))
    with pytest.raises(ValueError, match="ascend"):
        Histogram((1.0, 0.5, INF), (1, 2, 3))


# -- parsing ---------------------------------------------------------------------------------------------


def test_missing_gauges_are_none_not_zero() -> None:
    parsed = parse_engine_metrics("# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 4\n")
    assert parsed.num_queue_reqs == 4
    assert parsed.token_usage is None and parsed.gen_throughput is None and parsed.ttft is None
    assert parsed.missing() == ("token_usage", "gen_throughput")


def test_empty_text_is_an_engine_with_no_fields() -> None:
    assert parse_engine_metrics("") == EngineMetrics()


def test_token_usage_falls_back_to_used_over_max() -> None:
    text = "sglang:num_used_tokens 250\nsglang:max_total_num_tokens 1000\n"
    assert parse_engine_metrics(text).token_usage == pytest.approx(0.25)


def test_nan_gauge_is_missing() -> None:
    assert parse_engine_metrics("sglang:token_usage NaN\n").token_usage is None


def test_several_label_sets_are_summed_and_usage_averaged() -> None:
    text = (
        'sglang:num_queue_reqs{dp_rank="0"} 3\nsglang:num_queue_reqs{dp_rank="1"} 5\n'
        'sglang:token_usage{dp_rank="0"} 0.2\nsglang:token_usage{dp_rank="1"} 0.6\n'
        + text_histogram("sglang:queue_time_seconds", {"1.0": 1, "+Inf": 2}, 'dp_rank="0"')
        + text_histogram("sglang:queue_time_seconds", {"1.0": 3, "+Inf": 3}, 'dp_rank="1"').split("\n", 1)[1]
    )
    parsed = parse_engine_metrics(text)
    assert parsed.num_queue_reqs == 8
    assert parsed.token_usage == pytest.approx(0.4)
    assert parsed.queue_time == Histogram((1.0, INF), (4, 5), 2.0)


def test_histogram_without_type_lines_or_inf_bucket() -> None:
    text = 'sglang:queue_time_seconds_bucket{le="1.0"} 3\nsglang:queue_time_seconds_count 5\n'
    parsed = parse_engine_metrics(text)
    assert parsed.queue_time == Histogram((1.0, INF), (3, 5))
    assert parsed.queue_time.quantile(0.95) == INF


def test_malformed_text_raises() -> None:
    with pytest.raises(MetricsParseError, match="Prometheus"):
        parse_engine_metrics('sglang:token_usage{model_name="m" 0.5\n')


# -- SGLang 0.5.23 exposition (fixtures built from its metrics_collector; see tests/fixtures/sglang/) -------

# Copied from the shared SGLang contract fixtures so the tests run on a clean checkout (CI has only the repo).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"
EXPECTED = json.loads((FIXTURES / "sglang-0.5.23-metrics.expected.json").read_text())
VARIANTS = ["sglang-0.5.23-metrics.txt", "sglang-0.5.23-metrics-priority.txt"]
GAUGE_NAMES = (
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "gen_throughput",
    "max_total_num_tokens",
    "num_used_tokens",
)
P95_NAMES = {"queue_time": "queue_time_p95", "ttft": "ttft_p95", "itl": "itl_p95", "e2e_latency": "e2e_latency_p95"}


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("name", VARIANTS)
def test_sglang_fixture_parses_to_the_expected_values(name: str) -> None:
    parsed = parse_engine_metrics(fixture_text(name))
    for gauge in GAUGE_NAMES:
        assert getattr(parsed, gauge) == pytest.approx(EXPECTED[gauge]), gauge
    for histogram, key in P95_NAMES.items():
        assert getattr(parsed, histogram).quantile(0.95) == pytest.approx(EXPECTED[key]), histogram
    assert parsed.missing() == ()


@pytest.mark.parametrize("name", VARIANTS)
def test_sglang_fixture_cluster_frame(name: str) -> None:
    frame = build_cluster_frame(1.0, {"engine_0": fixture_text(name)})
    assert frame.complete
    assert (frame.total_queue, frame.total_running) == (EXPECTED["num_queue_reqs"], EXPECTED["num_running_reqs"])
    assert frame.token_usage == pytest.approx(EXPECTED["token_usage"])
    for key in P95_NAMES.values():
        assert getattr(frame, key) == pytest.approx(EXPECTED[key]), key


def test_priority_totals_are_summed_over_engines() -> None:
    # Two priority-scheduling engines: 12 + 12 queued, not (12 + 9 + 3) * 2.
    text = fixture_text("sglang-0.5.23-metrics-priority.txt")
    frame = build_cluster_frame(1.0, {"engine_0": text, "engine_1": text})
    assert (frame.total_queue, frame.queue_per_engine, frame.total_running) == (24, 12, 96)


def test_priority_totals_are_summed_over_ranks() -> None:
    text = (
        'sglang:num_queue_reqs{dp_rank="0",priority=""} 5\n'
        'sglang:num_queue_reqs{dp_rank="0",priority="0"} 2\n'
        'sglang:num_queue_reqs{dp_rank="0",priority="1"} 3\n'
        'sglang:num_queue_reqs{dp_rank="1",priority=""} 7\n'
        'sglang:num_queue_reqs{dp_rank="1",priority="None"} 7\n'  # requests without a priority value
        'sglang:token_usage{dp_rank="0",priority=""} 0.2\n'
        'sglang:token_usage{dp_rank="1",priority=""} 0.6\n'
    )
    parsed = parse_engine_metrics(text)
    assert parsed.num_queue_reqs == 12
    assert parsed.token_usage == pytest.approx(0.4)


def test_a_rank_with_only_a_breakdown_counts_its_breakdown_once() -> None:
    text = 'sglang:num_running_reqs{priority="0"} 4\nsglang:num_running_reqs{priority="2"} 6\n'
    assert parse_engine_metrics(text).num_running_reqs == 10


def test_histograms_split_by_priority_are_summed() -> None:
    # Each request is observed once, under its own priority: these label sets partition the observations.
    text = (
        text_histogram("sglang:time_to_first_token_seconds", {"1.0": 1, "+Inf": 2}, 'priority="0"')
        + text_histogram("sglang:time_to_first_token_seconds", {"1.0": 3, "+Inf": 3}, 'priority="1"').split("\n", 1)[1]
    )
    assert parse_engine_metrics(text).ttft == Histogram((1.0, INF), (4, 5), 2.0)


# -- cluster frames --------------------------------------------------------------------------------------


def gauges(usage: float, queue: float, running: float = 1, throughput: float = 100.0) -> str:
    return (
        f"sglang:token_usage {usage}\nsglang:num_queue_reqs {queue}\n"
        f"sglang:num_running_reqs {running}\nsglang:gen_throughput {throughput}\n"
    )


def test_cluster_frame_aggregates_and_coverage() -> None:
    frame = build_cluster_frame(
        100.0,
        {
            "engine_0": gauges(0.2, 4),
            "engine_1": gauges(0.6, 8, throughput=50),
            "engine_2": ScrapeError("GET http://x/metrics timed out after 2s"),
            "engine_3": "garbage{",
        },
        trainer_wait_fraction=0.7,
    )
    assert frame.asked == ("engine_0", "engine_1", "engine_2", "engine_3")
    assert frame.coverage == 0.5
    assert frame.missing == ("engine_2", "engine_3")
    assert "timed out" in frame.errors["engine_2"] and "Prometheus" in frame.errors["engine_3"]
    assert frame.token_usage == pytest.approx(0.4)
    assert (frame.total_queue, frame.queue_per_engine) == (12, 6)
    assert (frame.total_running, frame.total_throughput) == (2, 150)
    assert frame.ttft_p95 is None
    assert frame.trainer_wait_fraction == 0.7
    assert not frame.complete


def test_cluster_frame_marks_engines_lacking_required_fields() -> None:
    frame = build_cluster_frame(1.0, {"engine_0": gauges(0.1, 0), "engine_1": "sglang:num_queue_reqs 0\n"})
    assert frame.coverage == 1.0
    assert frame.incomplete == {"engine_1": ("token_usage", "gen_throughput")}
    assert frame.token_usage == pytest.approx(0.1)  # the average is over engines that report it
    assert not frame.complete


def test_cluster_frame_without_engines() -> None:
    frame = build_cluster_frame(1.0, {})
    assert frame.coverage == 0.0 and frame.token_usage is None and not frame.complete


def test_cluster_p95_uses_deltas_and_merges_engines() -> None:
    first = build_cluster_frame(
        0.0, {"engine_0": ttft_text((1000, 1000, 1000, 1000)), "engine_1": ttft_text((0, 0, 0, 0))}
    )
    assert first.ttft_p95 == pytest.approx(0.1 * 950 / 1000)
    second = build_cluster_frame(
        10.0, {"engine_0": ttft_text((1000, 1000, 1010, 1010)), "engine_1": ttft_text((0, 0, 5, 10))}, first
    )
    # delta: engine_0 +10 in (0.5, 1.0]; engine_1 +5 in (0.5, 1.0] and +5 in +Inf -> merged (0, 0, 15, 20)
    assert second.ttft_p95 == INF
    third = build_cluster_frame(
        20.0, {"engine_0": ttft_text((1000, 1000, 1030, 1030)), "engine_1": ttft_text((0, 0, 5, 10))}, second
    )
    # only engine_0 moved: 20 in (0.5, 1.0] -> 0.5 + 0.5 * 19 / 20
    assert third.ttft_p95 == pytest.approx(0.975)


def test_delta_starts_from_the_engines_last_answer_after_a_missed_scrape() -> None:
    first = build_cluster_frame(0.0, {"engine_0": ttft_text((1000, 1000, 1000, 1000))})
    missed = build_cluster_frame(10.0, {"engine_0": ScrapeError("timeout")}, first)
    back = build_cluster_frame(20.0, {"engine_0": ttft_text((1000, 1000, 1020, 1020))}, missed)
    assert back.ttft_p95 == pytest.approx(0.975)


def test_no_new_observations_means_unknown_p95() -> None:
    first = build_cluster_frame(0.0, {"engine_0": ttft_text((0, 0, 5, 10))})
    same = build_cluster_frame(10.0, {"engine_0": ttft_text((0, 0, 5, 10))}, first)
    assert first.ttft_p95 == INF and same.ttft_p95 is None


def test_frame_to_dict_is_strict_json() -> None:
    frame = build_cluster_frame(0.0, {"engine_0": gauges(0.5, 1) + ttft_text((0, 0, 0, 3)), "engine_1": OSError()})
    data = frame.to_dict()
    json.dumps(data, allow_nan=False)
    assert data["ttft_p95"] == "+Inf"
    assert data["missing"] == {"engine_1": "OSError"}
    assert data["engines"]["engine_0"]["token_usage"] == 0.5


# -- history ---------------------------------------------------------------------------------------------


def frame_at(t: float, throughput: float | None, *, missing: bool = False) -> ClusterFrame:
    engine = EngineMetrics(token_usage=0.1, num_queue_reqs=0, gen_throughput=throughput)
    return build_cluster_frame(t, {"engine_0": ScrapeError("down") if missing else engine})


def test_history_window_and_cv() -> None:
    history = MetricsHistory(window_secs=60)
    assert history.add(frame_at(0, 90)).throughput_cv is None  # one frame is no variation
    assert history.add(frame_at(10, 110)).throughput_cv == pytest.approx(0.1)  # mean 100, std 10
    for t in (20, 30, 40, 50, 60, 70):
        history.add(frame_at(t, 100))
    assert len(history) == 7  # 10..70: the frame at 0 left the 60 s window
    assert history.latest is not None and history.latest.timestamp == 70
    history.add(frame_at(80, 100))
    assert history.throughput_cv() == 0.0  # the 110 left the window


def test_history_cv_leaves_out_frames_with_a_missing_engine() -> None:
    history = MetricsHistory(window_secs=30)
    history.add(frame_at(0, 100))
    assert history.add(frame_at(10, None, missing=True)).throughput_cv is None  # one complete frame so far
    assert history.add(frame_at(20, 100)).throughput_cv == 0.0  # the gap is left out, not read as a dip
    history.add(frame_at(30, 50))
    assert history.throughput_cv() == pytest.approx(50 / 3 / (250 / 3) * 2**0.5)  # 100, 100, 50
    history.add(frame_at(45, None, missing=True))
    history.add(frame_at(55, None, missing=True))
    assert history.throughput_cv() is None  # only the 50 at t=30 is complete in the window (25..55)


def test_history_cv_never_sums_part_of_the_pool() -> None:
    history = MetricsHistory(window_secs=60)
    both = {"engine_0": EngineMetrics(token_usage=0.1, num_queue_reqs=0, gen_throughput=100),
            "engine_1": EngineMetrics(token_usage=0.1, num_queue_reqs=0, gen_throughput=100)}
    history.add(build_cluster_frame(0, both))
    partial = history.add(build_cluster_frame(10, {**both, "engine_1": ScrapeError("timed out")}))
    assert partial.total_throughput == 100 and partial.throughput_cv is None  # 100 of a 200 pool: not a dip
    assert history.add(build_cluster_frame(20, both)).throughput_cv == 0.0


def test_idle_pool_is_stable() -> None:
    history = MetricsHistory(window_secs=60)
    history.add(frame_at(0, 0))
    assert history.add(frame_at(10, 0)).throughput_cv == 0.0


def test_history_rejects_time_going_back() -> None:
    history = MetricsHistory(window_secs=60)
    history.add(frame_at(10, 1))
    with pytest.raises(ValueError, match="older"):
        history.add(frame_at(5, 1))
    with pytest.raises(ValueError, match="positive"):
        MetricsHistory(0)


def test_history_record_uses_the_previous_frame_for_deltas() -> None:
    history = MetricsHistory(window_secs=60)
    history.record(0.0, {"engine_0": ttft_text((1000, 1000, 1000, 1000))})
    frame = history.record(10.0, {"engine_0": ttft_text((1000, 1000, 1020, 1020))}, staleness_blocked_fraction=0.2)
    assert frame.ttft_p95 == pytest.approx(0.975)
    assert frame.staleness_blocked_fraction == 0.2
    assert len(history) == 2


# -- scraping over real HTTP -------------------------------------------------------------------------------

FIXED_TEXT = gauges(0.42, 3) + ttft_text((1, 2, 3, 4))


class MetricsServer:
    """A tiny uvicorn app on 127.0.0.1 serving a fixed metrics text, an error and a slow endpoint."""

    def __init__(self) -> None:
        self.auth: list[str | None] = []
        app = FastAPI()

        @app.get("/metrics")
        async def metrics(request: Request) -> PlainTextResponse:
            self.auth.append(request.headers.get("authorization"))
            return PlainTextResponse(FIXED_TEXT)

        @app.get("/broken/metrics")
        async def broken() -> PlainTextResponse:
            return PlainTextResponse("overloaded", status_code=503)

        @app.get("/slow/metrics")
        async def slow() -> PlainTextResponse:
            await asyncio.Event().wait()  # never answers: only the scrape timeout ends it
            return PlainTextResponse(FIXED_TEXT)

        self.http = LoopbackServer(app, name="metrics-server")
        self.url = self.http.url

    def __enter__(self) -> MetricsServer:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[MetricsServer]:
    with MetricsServer() as running:
        yield running


async def test_scrape_all_over_http(server: MetricsServer) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    timeout = 5.0  # generous: the answering engines must make it on a loaded machine
    started = time.monotonic()
    results = await scrape_all(
        {
            "engine_0": server.url,
            "engine_1": f"{server.url}/metrics",
            "engine_2": f"{server.url}/broken",
            "engine_3": f"{server.url}/slow",
            "engine_4": closed,
            "engine_5": f"{server.url}/slow",
        },
        timeout=timeout,
        token="s3cret",
    )
    elapsed = time.monotonic() - started
    assert results["engine_0"] == FIXED_TEXT and results["engine_1"] == FIXED_TEXT
    assert isinstance(results["engine_2"], ScrapeError) and "503" in str(results["engine_2"])
    assert isinstance(results["engine_3"], ScrapeError) and "timed out" in str(results["engine_3"])
    assert isinstance(results["engine_5"], ScrapeError) and "timed out" in str(results["engine_5"])
    assert isinstance(results["engine_4"], ScrapeError) and "failed" in str(results["engine_4"])
    assert elapsed < 2 * timeout  # concurrent: the two silent engines cost one timeout, not two
    assert server.auth[-1] == "Bearer s3cret"
    frame = build_cluster_frame(0.0, results)
    assert frame.coverage == pytest.approx(2 / 6)
    assert frame.token_usage == pytest.approx(0.42)


async def test_scrape_all_closed_port_only() -> None:
    results = await scrape_all({"engine_9": f"http://127.0.0.1:{free_port()}"}, timeout=1.0)
    assert isinstance(results["engine_9"], ScrapeError)


async def test_scrape_all_edge_cases() -> None:
    assert await scrape_all({}, timeout=1.0) == {}
    with pytest.raises(ValueError, match="positive"):
        await scrape_all({"e": "http://127.0.0.1:1"}, timeout=0)


def test_metrics_url() -> None:
    assert metrics_url("http://h:1") == "http://h:1/metrics"
    assert metrics_url("http://h:1/") == "http://h:1/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"


def test_frame_gaps_name_each_unusable_engine() -> None:
    frame = build_cluster_frame(0.0, {
        "engine_0": EngineMetrics(token_usage=0.1, num_queue_reqs=0, gen_throughput=5),
        "engine_1": ScrapeError("timed out after 1.8s"),
        "engine_2": EngineMetrics(token_usage=0.1, num_queue_reqs=None, gen_throughput=5),
    })
    assert frame.gaps() == {"engine_1": "timed out after 1.8s", "engine_2": "lacks num_queue_reqs"}
    assert not frame.complete
