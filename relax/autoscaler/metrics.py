"""What the autoscaler sees: engines' Prometheus text turned into frames (docs/architecture.md, "The autoscaler").

Pure: the fetching is ``relax.autoscaler.scrape`` (the HTTP half). The pipeline is

    scrape_all(urls) -> {engine_id: text | error}                     (relax.autoscaler.scrape)
    build_cluster_frame(now, results, previous) -> ClusterFrame      (one instant, whole pool)
    MetricsHistory.add(frame)                                        (recent frames, throughput CV)

Design choices, and why:

* Every field is individually optional. A gauge an engine does not export is ``None``, never 0:
  "no number" must not read as "idle", or the autoscaler would remove a busy engine.
* Latency P95s use Prometheus ``histogram_quantile`` semantics (linear interpolation inside the
  bucket that holds the quantile) over the *increase* of the buckets since the previous frame, so
  an hour of old history cannot hide a minute of bad latency. A quantile that lands in the ``+Inf``
  bucket is ``math.inf`` ("too high"): Prometheus would report the largest finite bound, which would
  read as "just under the limit" exactly when latency is off the scale.
* Parsing uses ``prometheus_client``'s own text parser; samples are matched by sample name so a
  server that omits ``# TYPE`` lines still parses.
* Gauges are summed over ranks, but SGLang's ``--enable-priority-scheduling`` writes the queue gauges
  twice (the total under ``priority=""``, a breakdown under ``priority="<n>"``), so where a breakdown is
  present only the total is read (``_rank_values``). Histograms need no such rule: each request is
  observed once, under its own priority, so their label sets partition the observations.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "GAUGES",
    "HISTOGRAMS",
    "REQUIRED_FOR_SCALE_IN",
    "ClusterFrame",
    "EngineMetrics",
    "Histogram",
    "MetricsHistory",
    "MetricsParseError",
    "ScrapeError",
    "build_cluster_frame",
    "histogram_quantile",
    "json_number",
    "parse_engine_metrics",
]

# EngineMetrics field -> SGLang metric name (docs/architecture.md, "Engines").
GAUGES: dict[str, str] = {
    "token_usage": "sglang:token_usage",
    "num_queue_reqs": "sglang:num_queue_reqs",
    "num_running_reqs": "sglang:num_running_reqs",
    "gen_throughput": "sglang:gen_throughput",
    "max_total_num_tokens": "sglang:max_total_num_tokens",
    "num_used_tokens": "sglang:num_used_tokens",
}
HISTOGRAMS: dict[str, str] = {
    "queue_time": "sglang:queue_time_seconds",
    "ttft": "sglang:time_to_first_token_seconds",
    "itl": "sglang:inter_token_latency_seconds",
    "e2e_latency": "sglang:e2e_request_latency_seconds",
}
# Gauges summed over label sets (one engine may export several, e.g. per data-parallel rank);
# token_usage is a ratio and is averaged instead.
_AVERAGED = frozenset({"token_usage"})
# SGLang's label for the per-priority breakdown of the queue gauges; "" (or no label) marks the total.
PRIORITY_LABEL = "priority"
# Without these an engine cannot be called idle, so scale-in waits for them (missing is not idle).
REQUIRED_FOR_SCALE_IN: tuple[str, ...] = ("token_usage", "num_queue_reqs", "gen_throughput")
P95 = 0.95


class MetricsParseError(ValueError):
    """An engine answered ``/metrics`` with text that is not Prometheus exposition format."""


class ScrapeError(RuntimeError):
    """An engine's ``/metrics`` could not be fetched (timeout, refused connection, error status)."""


# --------------------------------------------------------------------------------------------------
# Histograms


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """Quantile ``q`` of a cumulative histogram, as Prometheus' ``histogram_quantile`` computes it.

    ``bounds`` are ascending upper bounds ending with ``+Inf``; ``counts`` the cumulative counts.
    Returns ``None`` when there are no observations (no information, not "fast"), ``math.inf`` when
    the quantile falls in the ``+Inf`` bucket, else linear interpolation inside the bucket holding
    rank ``q × total`` (the first bucket starts at 0 unless its bound is not positive).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    if len(bounds) != len(counts):
        raise ValueError(f"{len(bounds)} bucket bounds but {len(counts)} counts")
    if len(bounds) < 2 or not math.isinf(bounds[-1]):
        return None  # only a +Inf bucket (or none): the shape is unknown, as in Prometheus (NaN)
    monotonic: list[float] = []
    for count in counts:  # float noise in deltas can make counts dip; Prometheus smooths the same way
        monotonic.append(max(count, monotonic[-1]) if monotonic else max(count, 0.0))
    total = monotonic[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next((i for i in range(len(bounds) - 1) if monotonic[i] >= rank), None)
    if index is None:
        return math.inf
    upper = bounds[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[index - 1], monotonic[index - 1]
    in_bucket = monotonic[index] - below
    if in_bucket <= 0:
        return lower
    return lower + (upper - lower) * (rank - below) / in_bucket


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts of one histogram: ascending ``bounds`` ending with ``+Inf``."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float | None = None

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.counts):
            raise ValueError(f"{len(self.bounds)} bucket bounds but {len(self.counts)} counts")
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"bucket bounds must ascend, got {self.bounds}")

    @property
    def total(self) -> float:
        """Number of observations (the ``+Inf`` bucket)."""
        return self.counts[-1] if self.counts else 0.0

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.bounds, self.counts)

    def delta(self, previous: Histogram | None) -> Histogram:
        """Observations made since ``previous``.

        Falls back to this (cumulative) histogram when there is no previous one, when the bucket
        layout changed, or when any count went down — a counter reset, i.e. the engine restarted,
        after which everything it reports is new anyway.
        """
        if previous is None or previous.bounds != self.bounds:
            return self
        if any(now < before for now, before in zip(self.counts, previous.counts, strict=True)):
            return self
        diff_sum = self.sum - previous.sum if self.sum is not None and previous.sum is not None else None
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, previous.counts, strict=True)), diff_sum)

    @staticmethod
    def merge(histograms: Iterable[Histogram]) -> Histogram | None:
        """Sum several histograms (engines, label sets) into one; ``None`` for an empty input.

        Identical layouts (the normal case: same server version everywhere) add exactly. Different
        layouts are merged on the union of bounds, each histogram read as a step function at bounds it
        lacks (its cumulative count at its largest bound below) — a lower estimate, never invented data.
        """
        items = list(histograms)
        if not items:
            return None
        sums = [h.sum for h in items]
        total_sum = sum(s for s in sums if s is not None) if all(s is not None for s in sums) else None
        layout = items[0].bounds
        if all(h.bounds == layout for h in items):
            counts = tuple(sum(column) for column in zip(*(h.counts for h in items), strict=True))
            return Histogram(layout, counts, total_sum)
        bounds = tuple(sorted({b for h in items for b in h.bounds}))
        counts = tuple(sum(_cumulative_at(h, bound) for h in items) for bound in bounds)
        return Histogram(bounds, counts, total_sum)


def _cumulative_at(histogram: Histogram, bound: float) -> float:
    value = 0.0
    for own_bound, count in zip(histogram.bounds, histogram.counts, strict=True):
        if own_bound > bound:
            break
        value = count
    return value


# --------------------------------------------------------------------------------------------------
# One engine


@dataclass(frozen=True)
class EngineMetrics:
    """One engine's scrape: the gauges and cumulative histograms the autoscaler reads, each optional."""

    token_usage: float | None = None
    num_queue_reqs: float | None = None
    num_running_reqs: float | None = None
    gen_throughput: float | None = None
    max_total_num_tokens: float | None = None
    num_used_tokens: float | None = None
    queue_time: Histogram | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e_latency: Histogram | None = None

    def missing(self, fields: Iterable[str] = REQUIRED_FOR_SCALE_IN) -> tuple[str, ...]:
        """Which of ``fields`` this engine did not report."""
        return tuple(name for name in fields if getattr(self, name) is None)

    def gauges(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in GAUGES}


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse one engine's ``/metrics`` text; raises ``MetricsParseError`` for malformed text."""
    gauge_samples: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in GAUGES}
    by_metric = {metric: name for name, metric in GAUGES.items()}
    series: dict[str, dict[tuple, _Series]] = {name: {} for name in HISTOGRAMS}
    suffixes = {}
    for name, metric in HISTOGRAMS.items():
        for suffix in ("_bucket", "_count", "_sum"):
            suffixes[metric + suffix] = (name, suffix)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                if sample.name in by_metric:
                    if not math.isnan(value):
                        gauge_samples[by_metric[sample.name]].append((dict(sample.labels), value))
                elif sample.name in suffixes:
                    name, suffix = suffixes[sample.name]
                    labels = {k: v for k, v in sample.labels.items() if k != "le"}
                    key = tuple(sorted(labels.items()))
                    one = series[name].setdefault(key, _Series())
                    one.add(suffix, sample.labels.get("le"), value)
    except (ValueError, TypeError, IndexError) as error:
        raise MetricsParseError(f"not Prometheus text exposition format ({error})") from None
    values: dict[str, Any] = {}
    for name, samples in gauge_samples.items():
        seen = _rank_values(samples)
        if seen:
            values[name] = sum(seen) / len(seen) if name in _AVERAGED else sum(seen)
    if "token_usage" not in values and values.get("max_total_num_tokens") and "num_used_tokens" in values:
        values["token_usage"] = values["num_used_tokens"] / values["max_total_num_tokens"]
    for name, by_labels in series.items():
        histograms = [h for h in (s.histogram() for s in by_labels.values()) if h is not None]
        merged = Histogram.merge(histograms)
        if merged is not None:
            values[name] = merged
    return EngineMetrics(**values)


def _rank_values(samples: list[tuple[dict[str, str], float]]) -> list[float]:
    """One value per rank (label set without ``priority``) of one gauge, ready to sum or average.

    Summing every series of a gauge is right across ranks (``dp_rank``...) but double counts under
    priority scheduling, where SGLang writes each rank's total under ``priority=""`` *and* its
    per-priority breakdown under ``priority="<n>"``. So a rank's value is its total series (empty or
    absent ``priority``); a rank that exports only a breakdown counts as the sum of its breakdown.
    """
    ranks: dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]] = {}
    for labels, value in samples:
        rank = tuple(sorted((k, v) for k, v in labels.items() if k != PRIORITY_LABEL))
        totals, breakdown = ranks.setdefault(rank, ([], []))
        (breakdown if labels.get(PRIORITY_LABEL) else totals).append(value)
    return [totals[-1] if totals else sum(breakdown) for totals, breakdown in ranks.values()]


@dataclass
class _Series:
    """The samples of one histogram under one label set, while parsing."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float | None = None
    sum: float | None = None

    def add(self, suffix: str, le: str | None, value: float) -> None:
        if suffix == "_bucket":
            if le is None:
                raise ValueError("a _bucket sample has no 'le' label")
            self.buckets[float(le)] = value
        elif suffix == "_count":
            self.count = value
        else:
            self.sum = value

    def histogram(self) -> Histogram | None:
        if not self.buckets:
            return None
        buckets = dict(self.buckets)
        if math.inf not in buckets:  # malformed but recoverable: _count is the +Inf bucket
            buckets[math.inf] = self.count if self.count is not None else max(buckets.values())
        bounds = tuple(sorted(buckets))
        return Histogram(bounds, tuple(buckets[b] for b in bounds), self.sum)


# --------------------------------------------------------------------------------------------------
# The whole pool at one instant


@dataclass
class ClusterFrame:
    """All ACTIVE engines at one time, with the aggregates the policy compares against thresholds.

    ``engines`` holds the cumulative frames of engines that answered and parsed; ``errors`` says why
    each other engine has none. Aggregates over a field use only the engines that report it (a
    missing gauge is not a zero); ``incomplete`` names engines lacking a field scale-in needs.
    The RL fields are set by the caller (``build_cluster_frame`` keywords or plain assignment):
    they come from the trainer and the staleness gate, not from engines. ``throughput_cv`` is set by
    ``MetricsHistory.add``.
    """

    timestamp: float
    asked: tuple[str, ...]
    engines: dict[str, EngineMetrics]
    errors: dict[str, str]
    coverage: float
    incomplete: dict[str, tuple[str, ...]]
    token_usage: float | None
    total_queue: float | None
    queue_per_engine: float | None
    total_running: float | None
    total_throughput: float | None
    queue_time_p95: float | None
    ttft_p95: float | None
    itl_p95: float | None
    e2e_latency_p95: float | None
    throughput_cv: float | None = None
    trainer_wait_fraction: float | None = None
    staleness_blocked_fraction: float | None = None
    buffer_fill: float | None = None
    # Newest cumulative frame per asked engine, including engines that missed this scrape, so the
    # next frame's histogram deltas always start from the engine's last answer.
    latest_known: dict[str, EngineMetrics] = field(default_factory=dict, repr=False)

    @property
    def missing(self) -> tuple[str, ...]:
        """Engines asked that produced no usable frame (timeout, error, unparsable text)."""
        return tuple(engine for engine in self.asked if engine not in self.engines)

    def gaps(self) -> dict[str, str]:
        """Why each unusable engine is unusable: its scrape error, or the fields it lacked."""
        out = {engine: self.errors.get(engine, "no data") for engine in self.missing}
        out.update({engine: "lacks " + ", ".join(fields) for engine, fields in self.incomplete.items()})
        return out

    @property
    def complete(self) -> bool:
        """Every engine asked answered with every field scale-in needs."""
        return bool(self.asked) and not self.missing and not self.incomplete

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary for status endpoints (``inf`` becomes the string ``"+Inf"``)."""
        return {
            "timestamp": self.timestamp,
            "asked": len(self.asked),
            "answered": len(self.engines),
            "coverage": self.coverage,
            "missing": {engine: self.errors.get(engine, "no data") for engine in self.missing},
            "incomplete": {engine: list(fields) for engine, fields in self.incomplete.items()},
            "token_usage": json_number(self.token_usage),
            "total_queue": json_number(self.total_queue),
            "queue_per_engine": json_number(self.queue_per_engine),
            "total_running": json_number(self.total_running),
            "total_throughput": json_number(self.total_throughput),
            "queue_time_p95": json_number(self.queue_time_p95),
            "ttft_p95": json_number(self.ttft_p95),
            "itl_p95": json_number(self.itl_p95),
            "e2e_latency_p95": json_number(self.e2e_latency_p95),
            "throughput_cv": json_number(self.throughput_cv),
            "trainer_wait_fraction": json_number(self.trainer_wait_fraction),
            "staleness_blocked_fraction": json_number(self.staleness_blocked_fraction),
            "buffer_fill": json_number(self.buffer_fill),
            "engines": {
                engine: {name: json_number(value) for name, value in metrics.gauges().items()}
                for engine, metrics in self.engines.items()
            },
        }


def json_number(value: float | None) -> float | str | None:
    """A float made JSON-safe: ``inf`` -> ``"+Inf"`` (Prometheus' spelling), NaN -> ``None``."""
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


def build_cluster_frame(
    timestamp: float,
    results: Mapping[str, str | Exception | EngineMetrics],
    previous: ClusterFrame | None = None,
    *,
    trainer_wait_fraction: float | None = None,
    staleness_blocked_fraction: float | None = None,
    buffer_fill: float | None = None,
) -> ClusterFrame:
    """Aggregate one scrape of the ACTIVE engines (``results`` from ``scrape_all``, keyed by engine id).

    Every key of ``results`` counts as asked. Text is parsed here; an exception or unparsable text
    makes the engine missing. ``previous`` (the last frame) turns latency histograms into deltas.
    """
    engines: dict[str, EngineMetrics] = {}
    errors: dict[str, str] = {}
    for engine, result in results.items():
        if isinstance(result, EngineMetrics):
            engines[engine] = result
        elif isinstance(result, BaseException):
            errors[engine] = str(result) or type(result).__name__
        else:
            try:
                engines[engine] = parse_engine_metrics(result)
            except MetricsParseError as error:
                errors[engine] = str(error)
    asked = tuple(results)
    known = previous.latest_known if previous is not None else {}
    latest_known = {engine: known[engine] for engine in asked if engine in known}
    latest_known.update(engines)

    def values(name: str) -> list[float]:
        return [getattr(m, name) for m in engines.values() if getattr(m, name) is not None]

    usage = values("token_usage")
    queues = values("num_queue_reqs")
    total_queue = sum(queues) if queues else None
    p95s = {}
    for name in HISTOGRAMS:
        deltas = [
            getattr(m, name).delta(getattr(known[e], name) if e in known else None)
            for e, m in engines.items()
            if getattr(m, name) is not None
        ]
        merged = Histogram.merge(deltas)
        p95s[name] = merged.quantile(P95) if merged is not None else None
    return ClusterFrame(
        timestamp=timestamp,
        asked=asked,
        engines=engines,
        errors=errors,
        coverage=len(engines) / len(asked) if asked else 0.0,
        incomplete={e: gaps for e, m in engines.items() if (gaps := m.missing())},
        token_usage=sum(usage) / len(usage) if usage else None,
        total_queue=total_queue,
        queue_per_engine=total_queue / len(queues) if queues else None,
        total_running=sum(values("num_running_reqs")) if values("num_running_reqs") else None,
        total_throughput=sum(values("gen_throughput")) if values("gen_throughput") else None,
        queue_time_p95=p95s["queue_time"],
        ttft_p95=p95s["ttft"],
        itl_p95=p95s["itl"],
        e2e_latency_p95=p95s["e2e_latency"],
        trainer_wait_fraction=trainer_wait_fraction,
        staleness_blocked_fraction=staleness_blocked_fraction,
        buffer_fill=buffer_fill,
        latest_known=latest_known,
    )


# --------------------------------------------------------------------------------------------------
# Recent history


class MetricsHistory:
    """The frames of the last ``window_secs`` (``condition_window_secs``), by frame timestamp.

    Owns the one statistic that needs more than one frame: the coefficient of variation of pool
    throughput, the "throughput stable" rule of scale-in.
    """

    def __init__(self, window_secs: float) -> None:
        if window_secs <= 0:
            raise ValueError(f"window_secs must be positive, got {window_secs}")
        self.window_secs = float(window_secs)
        self._frames: deque[ClusterFrame] = deque()

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def latest(self) -> ClusterFrame | None:
        return self._frames[-1] if self._frames else None

    def add(self, frame: ClusterFrame) -> ClusterFrame:
        """Append ``frame`` (timestamps must not go back), drop what left the window, set its throughput CV."""
        if self._frames and frame.timestamp < self._frames[-1].timestamp:
            raise ValueError(
                f"frame at {frame.timestamp} is older than the latest frame at {self._frames[-1].timestamp}"
            )
        self._frames.append(frame)
        horizon = frame.timestamp - self.window_secs
        while self._frames and self._frames[0].timestamp < horizon:
            self._frames.popleft()
        frame.throughput_cv = self.throughput_cv()
        return frame

    def record(
        self, timestamp: float, results: Mapping[str, str | Exception | EngineMetrics], **rl: Any
    ) -> ClusterFrame:
        """``build_cluster_frame`` against the latest frame, then ``add``: one scrape cycle."""
        return self.add(build_cluster_frame(timestamp, results, self.latest, **rl))

    def throughput_cv(self) -> float | None:
        """Population std / mean of pool throughput over the complete frames of the window.

        A frame where an engine did not answer (or lacked a field) is left out, not summed: a sum over part
        of the pool would look like a dip (missing is not idle). Left out rather than spoiling the window,
        because one scrape that timed out on a busy node would otherwise keep scale-in blocked for a whole
        ``condition_window_secs``; whether metrics are complete *now* is its own scale-in rule. ``None``
        with fewer than two complete frames. A pool whose throughput is zero throughout is stable (0.0).
        """
        frames = [f for f in self._frames if f.total_throughput is not None and not f.missing and not f.incomplete]
        if len(frames) < 2:
            return None
        values = [float(f.total_throughput) for f in frames]  # type: ignore[arg-type]
        mean = sum(values) / len(values)
        if mean == 0:
            return 0.0
        variance = sum((v - mean) ** 2 for v in values) / len(values)
        return math.sqrt(variance) / mean


# --------------------------------------------------------------------------------------------------
# Scraping (the only I/O in this module)


