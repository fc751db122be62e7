"""Prometheus metrics of the built-in engine, under the names SGLang exports (docs/architecture.md, "Engines").

The autoscaler reads these names from real SGLang servers and from the built-in engine alike, so
the built-in engine must report what really happens: gauges are refreshed from the scheduler's
state at scrape time, and latency histograms are observed when the events occur.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

# SGLang 0.5.23's default bucket bounds (srt/observability/metrics_collector.py), so a P95 read from the
# built-in engine's histograms has the same resolution as one read from a real server.
QUEUE_TIME_BUCKETS = (
    0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100,
    200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
INTER_TOKEN_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200,
    0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)


class ThroughputWindow:
    """Generated tokens per second over a sliding window, with an injected clock.

    A window (rather than a lifetime average) makes the gauge fall to zero when the engine goes
    idle, which is what the autoscaler's "throughput stable" and "idle" rules need to see.
    """

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] | None = None) -> None:
        import time

        self._window_s = window_s
        self._clock = clock or time.monotonic
        self._events: deque[tuple[float, int]] = deque()

    def record(self, tokens: int) -> None:
        self._events.append((self._clock(), tokens))
        self._evict(self._clock())

    def rate(self) -> float:
        now = self._clock()
        self._evict(now)
        return sum(n for _, n in self._events) / self._window_s

    def _evict(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window_s:
            self._events.popleft()


@dataclass(frozen=True)
class LoadSnapshot:
    """The scheduler's state at one instant; what the gauges show."""

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0


class EngineMetrics:
    """One registry per server so several engines in one process never share counters."""

    def __init__(self, model_name: str, clock: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self._running = gauge("sglang:num_running_reqs", "Requests in the running batch")
        self._queue = gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled")
        self._used = gauge("sglang:num_used_tokens", "Tokens held by running requests")
        self._max_tokens = gauge("sglang:max_total_num_tokens", "Token capacity of the engine")
        self._usage = gauge("sglang:token_usage", "Fraction of token capacity in use (0-1)")
        self._throughput = gauge("sglang:gen_throughput", "Generated tokens per second (5 s window)")
        # Relax's own series: Prometheus naming (no colon; the control plane's relax_engine_weight_version is the
        # oldest version over the ACTIVE engines, a different number, hence a different name).
        self._weight_version = gauge("relax_engine_served_weight_version", "Weight version this engine serves")
        self.queue_time = histogram(
            "sglang:queue_time_seconds", "Time from arrival to first scheduling", QUEUE_TIME_BUCKETS
        ).labels(**self._labels)
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time from arrival to the first output token", TTFT_BUCKETS
        ).labels(**self._labels)
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Time between consecutive output tokens", INTER_TOKEN_BUCKETS
        ).labels(**self._labels)
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "Time from arrival to completion", E2E_BUCKETS
        ).labels(**self._labels)
        self.throughput = ThroughputWindow(clock=clock)

    def render(self, snapshot: LoadSnapshot, weight_version: str) -> bytes:
        """Refresh the gauges from `snapshot` and return the Prometheus text exposition."""
        lab = self._labels
        self._running.labels(**lab).set(snapshot.num_running_reqs)
        self._queue.labels(**lab).set(snapshot.num_queue_reqs)
        self._used.labels(**lab).set(snapshot.num_used_tokens)
        self._max_tokens.labels(**lab).set(snapshot.max_total_num_tokens)
        self._usage.labels(**lab).set(snapshot.token_usage)
        self._throughput.labels(**lab).set(self.throughput.rate())
        # SGLang versions are free-form strings; Relax publishes integers. -1 = not numeric.
        self._weight_version.labels(**lab).set(int(weight_version) if weight_version.isdigit() else -1)
        return generate_latest(self.registry)
