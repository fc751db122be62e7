"""Metrics bookkeeping of the built-in engine, checked through a real Prometheus parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from relax.engines.builtin.metrics import EngineMetrics, LoadSnapshot, ThroughputWindow


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _samples(text: bytes) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            key = s.name + ("" if "le" not in s.labels else f"[{s.labels['le']}]")
            out[key] = s.value
    return out


def test_throughput_window_rises_then_decays_to_zero() -> None:
    clock = FakeClock()
    window = ThroughputWindow(window_s=5.0, clock=clock)
    for _ in range(10):
        window.record(16)
        clock.now += 0.5
    assert window.rate() == 16 * 10 / 5.0
    clock.now += 6.0
    assert window.rate() == 0.0


def test_gauges_reflect_snapshot_and_histograms_observe() -> None:
    clock = FakeClock()
    metrics = EngineMetrics("tiny", clock=clock)
    metrics.queue_time.observe(0.3)
    metrics.ttft.observe(500.0)  # beyond SGLang's last TTFT bound (400 s): lands in +Inf only
    text = metrics.render(LoadSnapshot(3, 5, 250, 1000), weight_version="7")
    s = _samples(text)
    assert s["sglang:num_running_reqs"] == 3
    assert s["sglang:num_queue_reqs"] == 5
    assert s["sglang:token_usage"] == 0.25
    assert s["sglang:num_used_tokens"] == 250
    assert s["sglang:max_total_num_tokens"] == 1000
    assert s["relax_engine_served_weight_version"] == 7
    assert s["sglang:queue_time_seconds_bucket[0.2]"] == 0 and s["sglang:queue_time_seconds_bucket[0.5]"] == 1
    assert s["sglang:time_to_first_token_seconds_bucket[400.0]"] == 0
    assert s["sglang:time_to_first_token_seconds_bucket[+Inf]"] == 1


def test_histogram_bounds_are_sglangs() -> None:
    """SGLang 0.5.23's default bounds (metrics_collector.py): queue 0..3000 s in 40 bounds, TTFT 0.1..400 s,
    inter-token 0.002..8 s, e2e 0.1..2400 s, so P95s read from either engine have the same resolution."""
    text = EngineMetrics("m").render(LoadSnapshot(0, 0, 0, 1), "0").decode()
    bounds: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                bounds.setdefault(sample.name.removesuffix("_bucket"), []).append(float(sample.labels["le"]))
    spans = {name: (len(b), min(b), max(b)) for name, b in bounds.items()}
    assert spans == {
        "sglang:queue_time_seconds": (40, 0.0, 3000.0),
        "sglang:time_to_first_token_seconds": (18, 0.1, 400.0),
        "sglang:inter_token_latency_seconds": (23, 0.002, 8.0),
        "sglang:e2e_request_latency_seconds": (22, 0.1, 2400.0),
    }


def test_each_engine_has_its_own_registry() -> None:
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.e2e.observe(1.0)
    assert _samples(b.render(LoadSnapshot(0, 0, 0, 1), "0"))["sglang:e2e_request_latency_seconds_count"] == 0
