"""A simulated inference engine: continuous batching as processor sharing, a KV budget, SGLang's metrics.

The world model of the autoscaler simulator (``relax.autoscaler.simulator``). The running requests share
the engine's decode throughput equally, each capped at its single-stream speed, so throughput grows with
the batch until the engine saturates. A request is admitted while the batch has a free slot and the KV
pool can *reserve* its prompt plus output tokens (``token_usage`` reports that reservation, as SGLang's
scheduler counts allocated tokens); otherwise it waits in the engine's queue (FIFO). Queue time is
observed at admission, TTFT = queue time + prefill + one decode step, e2e at completion.
``gen_throughput`` is tokens over the last few seconds, so it falls to zero when the engine idles.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from relax.autoscaler.metrics import EngineMetrics, Histogram

__all__ = ["EngineModel", "LatencyCounter", "Observer", "SimEngine", "SimRequest"]

_EPS = 1e-9


@dataclass(frozen=True)
class EngineModel:
    """One engine's serving capacity. Defaults: a 4B model on one modern GPU, in round numbers.

    Saturated, an engine generates ``max_tokens_per_sec``; that is about 4 requests/s of 1500-token
    answers, the unit the built-in traces are sized in.
    """

    max_tokens_per_sec: float = 6000.0
    tokens_per_sec_per_request: float = 80.0
    """Single-stream decode speed: a lone request is no faster than this however idle the engine."""
    max_running_requests: int = 256
    max_total_tokens: int = 300_000
    """KV pool size in tokens (``sglang:max_total_num_tokens``)."""
    prompt_tokens: int = 300
    prefill_tokens_per_sec: float = 30_000.0
    throughput_window_secs: float = 5.0
    """``gen_throughput`` is tokens generated over this trailing window, per second."""


class Observer(Protocol):
    """Where an engine reports what users felt (the simulation collects it)."""

    queue_waits: list[float]
    ttfts: list[float]

    def complete(self, request: SimRequest) -> None: ...


class SimRequest:
    __slots__ = ("arrival", "tokens", "footprint", "phase_index", "admitted_at", "finish_v")

    def __init__(self, arrival: float, tokens: int, footprint: int, phase_index: int) -> None:
        self.arrival = arrival
        self.tokens = tokens
        self.footprint = footprint
        self.phase_index = phase_index
        self.admitted_at: float | None = None
        self.finish_v = 0.0


#: The bounds the published policy comparison (benchmarks/results/autoscaler.md) was simulated with; the
#: built-in engine now exports SGLang's exact per-histogram bounds, which are coarser above 1 s.
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0,
)


class LatencyCounter:
    """A cumulative Prometheus-style histogram over LATENCY_BUCKETS."""

    BOUNDS: tuple[float, ...] = (*LATENCY_BUCKETS, math.inf)

    def __init__(self) -> None:
        self.counts = [0] * len(self.BOUNDS)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.BOUNDS, value)] += 1
        self.sum += value

    def snapshot(self) -> Histogram:
        cumulative, running = [], 0
        for count in self.counts:
            running += count
            cumulative.append(float(running))
        return Histogram(self.BOUNDS, tuple(cumulative), self.sum)


class SimEngine:
    """One simulated engine: lifecycle, queue, processor-shared batch and the metrics it exports."""

    def __init__(self, engine_id: str, number: int, model: EngineModel, *, dt: float) -> None:
        self.number = number
        self.id = engine_id
        self.model = model
        self.queue: deque[SimRequest] = deque()
        self.running: list[tuple[float, int, SimRequest]] = []  # heap by finish virtual time
        self.virtual = 0.0  # tokens each running request has received so far (processor sharing)
        self.reserved = 0
        self.seq = 0
        self.queue_time = LatencyCounter()
        self.ttft = LatencyCounter()
        self.e2e = LatencyCounter()
        window = max(1, round(model.throughput_window_secs / dt))
        self.recent_tokens: deque[float] = deque([0.0] * window, maxlen=window)
        self.gpu_secs = 0.0

    @property
    def in_flight(self) -> int:
        return len(self.queue) + len(self.running)

    def can_admit(self, request: SimRequest) -> bool:
        if not self.running:
            return True  # an empty engine always takes the head request, however large
        return (len(self.running) < self.model.max_running_requests
                and self.reserved + request.footprint <= self.model.max_total_tokens)

    def submit(self, request: SimRequest, now: float, sim: Observer) -> None:
        if not self.queue and self.can_admit(request):
            self._admit(request, now, sim)
        else:
            self.queue.append(request)

    def admit_waiting(self, now: float, sim: Observer) -> None:
        while self.queue and self.can_admit(self.queue[0]):
            self._admit(self.queue.popleft(), now, sim)

    def _admit(self, request: SimRequest, now: float, sim: Observer) -> None:
        waited = max(0.0, now - request.arrival)
        request.admitted_at = now
        request.finish_v = self.virtual + request.tokens
        self.seq += 1
        heapq.heappush(self.running, (request.finish_v, self.seq, request))
        self.reserved += request.footprint
        speed = min(self.model.tokens_per_sec_per_request, self.model.max_tokens_per_sec / len(self.running))
        ttft = waited + self.model.prompt_tokens / self.model.prefill_tokens_per_sec + 1.0 / speed
        self.queue_time.observe(waited)
        self.ttft.observe(ttft)
        sim.queue_waits.append(waited)
        sim.ttfts.append(ttft)

    def serve(self, now: float, dt: float, sim: Observer) -> None:
        """Decode for ``dt``; requests whose answer is complete leave at ``now + dt``."""
        n = len(self.running)
        if n == 0:
            self.recent_tokens.append(0.0)
            return
        share = min(self.model.tokens_per_sec_per_request, self.model.max_tokens_per_sec / n) * dt
        self.virtual += share
        generated = share * n
        while self.running and self.running[0][0] <= self.virtual + _EPS:
            finish_v, _, request = heapq.heappop(self.running)
            generated -= self.virtual - finish_v  # it needed only part of this step's share
            self.reserved -= request.footprint
            self.e2e.observe(now + dt - request.arrival)
            sim.complete(request)
        self.recent_tokens.append(generated)

    def abort_all(self) -> list[SimRequest]:
        """Drain timeout: everything in flight is aborted and handed back for a retry elsewhere."""
        leftovers = list(self.queue) + [request for _, _, request in self.running]
        self.queue.clear()
        self.running.clear()
        self.reserved = 0
        for request in leftovers:
            request.admitted_at = None
        return leftovers

    def oldest_wait(self, now: float) -> float:
        return now - self.queue[0].arrival if self.queue else 0.0

    def metrics(self) -> EngineMetrics:
        """What this engine's ``/metrics`` would say now."""
        window = self.model.throughput_window_secs
        return EngineMetrics(
            token_usage=self.reserved / self.model.max_total_tokens,
            num_queue_reqs=float(len(self.queue)),
            num_running_reqs=float(len(self.running)),
            gen_throughput=sum(self.recent_tokens) / window,
            max_total_num_tokens=float(self.model.max_total_tokens),
            num_used_tokens=float(self.reserved),
            queue_time=self.queue_time.snapshot(),
            ttft=self.ttft.snapshot(),
            e2e_latency=self.e2e.snapshot(),
        )
