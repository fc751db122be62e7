"""A discrete-time simulator of an elastic engine pool driven by the real autoscaler policy.

``simulate(trace, policy)`` replays a request-rate trace (``relax.autoscaler.traces``) against a pool of
simulated engines and reports what the policy cost (engine-seconds) and what users felt (queue wait).
It exists so a policy or a config can be judged in seconds, on a laptop, before it moves real GPUs.

Nothing of the autoscaler is re-implemented here: each engine produces the metrics a real engine exports
(``EngineMetrics`` with SGLang-named gauges and cumulative latency histograms on the built-in engine's
SGLang-like buckets), every ``metrics_interval_secs`` they go through the real ``build_cluster_frame`` and
``MetricsHistory``, and every ``evaluation_interval_secs`` the real ``AutoscalerPolicy.evaluate`` decides,
with a ``PoolView`` and ``record_action`` exactly as the service calls them. Only the world is modelled:

* **Engines** (``EngineModel``). Continuous batching as processor sharing: the running requests share
  the engine's decode throughput equally, each capped at its single-stream speed, so throughput grows
  with the batch until the engine saturates. A request is admitted while the batch has a free slot and
  the KV pool can *reserve* its prompt plus output tokens (``token_usage`` reports that reservation, as
  SGLang's scheduler counts allocated tokens); otherwise it waits in the engine's queue (FIFO). Queue time
  is observed at admission, TTFT = queue time + prefill + one decode step, e2e at completion.
  ``gen_throughput`` is tokens over the last few seconds, so it falls to zero when the engine idles.
* **Router** (DESIGN 3.5). Each arriving request goes to the ACTIVE engine with the fewest requests in
  flight (ties: the lowest engine number); with no ACTIVE engine it waits in the router.
* **Scale-out** (DESIGN 4): every new engine waits for placement (a node being provisioned), starts and
  syncs weights (``StartupDelays``, seeded jitter) before it is ACTIVE and routable. The request is pending
  until all its engines are ACTIVE; past ``scale_out_request_timeout_secs`` the rest are rolled back and an
  all-failed request is reported to the policy as rejected.
* **Scale-in** removes elastic engines only, newest first. A victim leaves the router, finishes what it
  has in flight (a real drain) or, after ``drain_timeout_secs``, aborts it and the leftovers are retried on
  other engines; then it shuts down. One scale request at a time.
* **Arrivals** are Poisson with the trace's rate, in GRPO groups of ``group_size`` samples of one prompt
  that the router keeps on one engine (DESIGN 3.5); output lengths are uniform around the trace's mean.
  Everything random comes from ``numpy`` generators seeded by ``SimulationSettings.seed`` (arrivals and
  start-up jitter on separate streams, so every policy sees the same requests), and time is the
  simulation's own clock (injected into the policy), so a run is exactly reproducible.
* **RL signal.** When the trace marks ``rollout``/``train`` phases, the trainer is *waiting for data*
  while it is in a ``train`` phase but requests of an earlier rollout phase are still unfinished: its
  batch is late. ``trainer_wait_fraction`` is the share of the last ``trainer_wait_window_secs`` spent so
  (a 60 s window, so the natural tail of one long answer does not read as starvation). Without phases it
  is ``None`` (no trainer). The staleness gate's signal is not modelled (``None``).

Cost is **engine-seconds while an engine holds a GPU**: from the end of its placement wait (the GPU is
granted) until it is removed; the placement wait itself is the provisioner's time, not a held GPU.

The ``relax`` policy (``RELAX_TUNED``) is the documented defaults with the changes below, chosen by running
``benchmarks/autoscaler_policies.py`` and a grid around it over every built-in trace and 2-3 seeds (engine
start-up about 140 s, which dominates everything a reactive policy can do):

* ``metrics_interval_secs: 5``, ``evaluation_interval_secs: 10`` -- with a 30 s evaluation a condition
  needs two evaluations 30 s apart, so an overload waited up to a minute before a 140 s boot began.
* ``scale_out_policy.condition_duration_secs: 20`` -- three consecutive readings 10 s apart. 10 s
  reacted a few seconds sooner for the same time above the objective; 20 s keeps one more reading
  between a GRPO group burst and a GPU bought.
* ``scale_out_policy.token_usage_threshold: 1.0`` -- token usage jumps to ~1.0 the moment an engine is
  overloaded, before the queue builds, and its ratio can never exceed 1 / threshold (1.18 at 0.85), so
  it asks for +1 engine; being first, it makes the scale request that then blocks the queue signals'
  right-sized step (+4) for a whole start-up (one request at a time). Left to the queue-time and
  queue-depth signals, a step or ramp is met with one right-sized action: over three seeds the P95 queue
  wait fell from 25 s (0.85) to 9 s on ``ramp`` and from 104 s to 57 s on ``step``, for about 0.1-0.15
  more engines on average. Usage still counts when the KV pool is completely full.
* ``scale_in_policy.throughput_variance_threshold: 0.25`` -- prompt groups arrive together, and the
  default 0.1 is tighter than the noise of a half-idle pool's throughput, so the defaults almost never
  scaled in (they ended ``step`` and ``spike`` at 8 engines); 0.4 started to flap.
* ``scale_in_cooldown_secs: 120`` -- surplus engines leave one every 2 min (plus the drain) rather than
  one every 5 min; no reversals on any trace, because scale-in still needs 120 s of an idle, stable pool.

Kept: ``max_delta`` 4 (with 2 or 3, ``step`` needed a second scale-out a whole start-up later: 590-720 s
above the objective instead of 450 s), the scale-out cooldown (the pending-request rule already spaces
actions by a whole start-up) and the RL signals (on ``rl-phases`` the queue signals fire before the
trainer starves, so the trainer-wait rule is a backstop here, not a driver: switching it off changes
nothing there).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from relax.autoscaler.config import AutoscalerConfig, AutoscalerConfigError
from relax.autoscaler.metrics import EngineMetrics, Histogram, MetricsHistory
from relax.autoscaler.policy import AutoscalerPolicy, Decision, PoolView, ScaleAction
from relax.autoscaler.traces import Phase, Trace
from relax.engines.builtin.metrics import LATENCY_BUCKETS

__all__ = [
    "RECIPE_BOUNDS",
    "RELAX_TUNED",
    "EngineModel",
    "EngineState",
    "PolicyError",
    "PolicyKind",
    "PolicySpec",
    "ScaleRecord",
    "SimulationResult",
    "SimulationSettings",
    "StartupDelays",
    "count_reversals",
    "parse_policy",
    "relax_defaults_config",
    "relax_tuned_config",
    "simulate",
]

RECIPE_BOUNDS = (4, 8)
"""The seed recipe's pool bounds (``examples/elastic_rollout/autoscaler.yaml``): the simulator's default."""

RELAX_TUNED: dict[str, Any] = {
    "metrics_interval_secs": 5.0,
    "evaluation_interval_secs": 10.0,
    "scale_in_cooldown_secs": 120.0,
    "scale_out_policy": {"condition_duration_secs": 20.0, "token_usage_threshold": 1.0},
    "scale_in_policy": {"throughput_variance_threshold": 0.25},
}
"""The ``relax`` policy: a patch over ``AutoscalerConfig`` defaults (why: see the module docstring)."""

_EPS = 1e-9


class PolicyError(ValueError):
    """A ``--policy`` that cannot be understood; the message is one line."""


class PolicyKind(str, Enum):
    """``--policy`` families: the tuned autoscaler, the documented defaults, or a fixed pool (no autoscaler)."""

    RELAX = "relax"
    RELAX_DEFAULTS = "relax-defaults"
    STATIC = "static"


@dataclass(frozen=True)
class PolicySpec:
    """What drives the pool: the autoscaler with ``config``, or ``static_engines`` fixed engines."""

    kind: PolicyKind
    config: AutoscalerConfig
    static_engines: int | None = None

    @property
    def label(self) -> str:
        return f"static:{self.static_engines}" if self.kind is PolicyKind.STATIC else self.kind.value


def relax_defaults_config(bounds: tuple[int, int] = RECIPE_BOUNDS) -> AutoscalerConfig:
    """``AutoscalerConfig``'s documented defaults, enabled, with the recipe's bounds."""
    return AutoscalerConfig(enabled=True, min_engines=bounds[0], max_engines=bounds[1])


def relax_tuned_config(bounds: tuple[int, int] = RECIPE_BOUNDS) -> AutoscalerConfig:
    """The ``relax`` policy's config: the defaults patched with ``RELAX_TUNED``."""
    return relax_defaults_config(bounds).patch(RELAX_TUNED)


def parse_policy(text: str, user_config: AutoscalerConfig | None = None) -> PolicySpec:
    """``relax`` | ``relax-defaults`` | ``static:N`` | ``static:min`` | ``static:max`` -> a ``PolicySpec``.

    ``user_config`` (``--config YAML``) is what the real autoscaler would run from that file, so for
    ``relax-defaults`` it is used as is; for ``relax`` only the keys the file sets are laid over the tuned
    settings; for ``static:min|max`` it gives the bounds. The simulator always enables the autoscaler:
    ``static:N`` is how to simulate it switched off.
    """
    spec = text.strip().lower()
    if spec == PolicyKind.RELAX.value:
        config = relax_tuned_config()
        if user_config is not None:
            try:
                config = config.patch(user_config.model_dump(exclude_unset=True))
            except AutoscalerConfigError as error:
                reason = str(error).removeprefix("config patch: ")
                raise PolicyError(
                    f"--config laid over the relax policy's tuned settings gives a bad config: {reason} "
                    "(set the related key too, or use --policy relax-defaults to run the file as is)"
                ) from None
        return PolicySpec(PolicyKind.RELAX, config.patch({"enabled": True}))
    if spec == PolicyKind.RELAX_DEFAULTS.value:
        config = user_config if user_config is not None else relax_defaults_config()
        return PolicySpec(PolicyKind.RELAX_DEFAULTS, config.patch({"enabled": True}))
    if spec.startswith("static:"):
        bounds_from = user_config if user_config is not None else relax_defaults_config()
        value = spec.split(":", 1)[1].strip()
        if value == "min":
            engines = bounds_from.min_engines
        elif value == "max":
            engines = bounds_from.max_engines
        else:
            try:
                engines = int(value)
            except ValueError:
                raise PolicyError(f"--policy {text}: N in static:N must be a whole number of engines") from None
            if engines < 1:
                raise PolicyError(f"--policy {text}: static:N needs at least 1 engine")
        return PolicySpec(PolicyKind.STATIC, bounds_from, engines)
    raise PolicyError(f"unknown --policy {text!r}; choose relax, relax-defaults, static:N, static:min or static:max")


# --------------------------------------------------------------------------------------------------
# The modelled world


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

    def requests_per_sec(self, tokens_per_request: float) -> float:
        """Saturated capacity in requests/s for answers of ``tokens_per_request`` tokens."""
        return self.max_tokens_per_sec / tokens_per_request


@dataclass(frozen=True)
class StartupDelays:
    """From the scale-out request to ACTIVE: placement wait + start + weight sync (each ± ``jitter``)."""

    placement_wait_secs: float = 60.0
    """Pending placement group: the provisioner adds a node."""
    start_secs: float = 60.0
    """Engine process start, model load, health check."""
    weight_sync_secs: float = 20.0
    """Pull and load the current weight version before joining the router."""
    jitter: float = 0.2
    """Each phase is scaled by a seeded uniform factor in ``[1 - jitter, 1 + jitter]``."""

    @property
    def total_secs(self) -> float:
        return self.placement_wait_secs + self.start_secs + self.weight_sync_secs


@dataclass(frozen=True)
class SimulationSettings:
    """Everything about a run except the trace and the policy."""

    dt_secs: float = 1.0
    seed: int = 0
    engine: EngineModel = field(default_factory=EngineModel)
    startup: StartupDelays = field(default_factory=StartupDelays)
    tokens_per_request: float = 1500.0
    """Mean output tokens where the trace does not say."""
    token_spread: float = 0.5
    """Output lengths are uniform in ``mean × [1 - spread, 1 + spread]``."""
    group_size: int = 8
    """Requests arrive in GRPO groups (``--n-samples-per-prompt`` samples of one prompt) that the router
    keeps on one engine, so arrivals are burstier than independent requests; 1 = independent requests."""
    drain_timeout_secs: float = 300.0
    shutdown_secs: float = 10.0
    queue_wait_objective_secs: float = 5.0
    """The queue-wait objective: time with the oldest waiting request older than this is "above objective"."""
    flap_window_secs: float = 600.0
    """Two accepted actions of opposite direction at most this far apart count as one reversal (flapping)."""
    timeline_interval_secs: float = 60.0
    trainer_wait_window_secs: float = 60.0
    initial_engines: int | None = None
    """Engines at t=0 for the autoscaler policies; ``None`` = ``min_engines``."""
    duration_secs: float | None = None
    """Simulate this long instead of the trace's duration (the trace holds its last rate)."""

    def __post_init__(self) -> None:
        if self.dt_secs <= 0:
            raise ValueError(f"dt_secs must be positive, got {self.dt_secs}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.token_spread < 1:
            raise ValueError(f"token_spread must be in [0, 1), got {self.token_spread}")


class EngineState(str, Enum):
    """The engine lifecycle of DESIGN 3.4 (health checking is folded into starting)."""

    PENDING = "PENDING"
    STARTING = "STARTING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    STOPPING = "STOPPING"
    REMOVED = "REMOVED"


_HOLDS_GPU = frozenset({EngineState.STARTING, EngineState.WEIGHT_SYNCING, EngineState.ACTIVE,
                        EngineState.DRAINING, EngineState.STOPPING})
_SERVING = frozenset({EngineState.ACTIVE, EngineState.DRAINING})
_NEXT_BOOT_STATE = {EngineState.PENDING: EngineState.STARTING, EngineState.STARTING: EngineState.WEIGHT_SYNCING,
                    EngineState.WEIGHT_SYNCING: EngineState.ACTIVE}


class _Request:
    __slots__ = ("arrival", "tokens", "footprint", "phase_index", "admitted_at", "finish_v")

    def __init__(self, arrival: float, tokens: int, footprint: int, phase_index: int) -> None:
        self.arrival = arrival
        self.tokens = tokens
        self.footprint = footprint
        self.phase_index = phase_index
        self.admitted_at: float | None = None
        self.finish_v = 0.0


class _LatencyCounter:
    """A cumulative Prometheus-style histogram on the built-in engine's SGLang-like buckets."""

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


class _Engine:
    """One simulated engine: lifecycle, queue, processor-shared batch and the metrics it exports."""

    def __init__(self, number: int, model: EngineModel, *, elastic: bool, dt: float) -> None:
        self.number = number
        self.id = f"engine_{number}"
        self.elastic = elastic
        self.model = model
        self.state = EngineState.ACTIVE
        self.boot_plan: list[tuple[EngineState, float]] = []  # (state, when it ends)
        self.drain_deadline = math.inf
        self.stop_at = math.inf
        self.queue: deque[_Request] = deque()
        self.running: list[tuple[float, int, _Request]] = []  # heap by finish virtual time
        self.virtual = 0.0  # tokens each running request has received so far (processor sharing)
        self.reserved = 0
        self.seq = 0
        self.queue_time = _LatencyCounter()
        self.ttft = _LatencyCounter()
        self.e2e = _LatencyCounter()
        window = max(1, round(model.throughput_window_secs / dt))
        self.recent_tokens: deque[float] = deque([0.0] * window, maxlen=window)
        self.gpu_secs = 0.0

    @property
    def in_flight(self) -> int:
        return len(self.queue) + len(self.running)

    def can_admit(self, request: _Request) -> bool:
        if not self.running:
            return True  # an empty engine always takes the head request, however large
        return (len(self.running) < self.model.max_running_requests
                and self.reserved + request.footprint <= self.model.max_total_tokens)

    def submit(self, request: _Request, now: float, sim: _Simulation) -> None:
        if not self.queue and self.can_admit(request):
            self._admit(request, now, sim)
        else:
            self.queue.append(request)

    def admit_waiting(self, now: float, sim: _Simulation) -> None:
        while self.queue and self.can_admit(self.queue[0]):
            self._admit(self.queue.popleft(), now, sim)

    def _admit(self, request: _Request, now: float, sim: _Simulation) -> None:
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

    def serve(self, now: float, dt: float, sim: _Simulation) -> None:
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

    def abort_all(self) -> list[_Request]:
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


@dataclass(frozen=True)
class ScaleRecord:
    """One accepted or rejected scale action, as the JSON report shows it."""

    t: float
    action: str
    from_engines: int
    to_engines: int
    accepted: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"t": round(self.t, 3), "action": self.action, "from": self.from_engines, "to": self.to_engines,
                "accepted": self.accepted, "reason": self.reason}


@dataclass
class _ScaleOp:
    action: ScaleAction
    engines: list[_Engine]
    deadline: float


# --------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class SimulationResult:
    """The report of one run. ``summary()`` is the flat dict the table and the benchmark show."""

    trace: str
    policy: str
    seed: int
    duration_secs: float
    requests: int
    completed: int
    engine_seconds: float
    queue_wait_p50: float
    queue_wait_p95: float
    queue_wait_p99: float
    queue_wait_max: float
    ttft_p95: float | None
    secs_above_objective: float
    queue_wait_objective_secs: float
    scale_outs: int
    scale_ins: int
    rejected: int
    reversals: int
    final_engines: int
    peak_engines: int
    trainer_wait_secs: float | None
    timeline: list[dict[str, Any]]
    actions: list[ScaleRecord]
    config: dict[str, Any] | None

    @property
    def scale_actions(self) -> int:
        return self.scale_outs + self.scale_ins

    @property
    def mean_engines(self) -> float:
        return self.engine_seconds / self.duration_secs if self.duration_secs else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "policy": self.policy,
            "engine_seconds": round(self.engine_seconds, 1),
            "mean_engines": round(self.mean_engines, 3),
            "queue_wait_p50_s": round(self.queue_wait_p50, 3),
            "queue_wait_p95_s": round(self.queue_wait_p95, 3),
            "queue_wait_p99_s": round(self.queue_wait_p99, 3),
            "queue_wait_max_s": round(self.queue_wait_max, 3),
            "ttft_p95_s": None if self.ttft_p95 is None else round(self.ttft_p95, 3),
            "secs_above_objective": round(self.secs_above_objective, 1),
            "scale_actions": self.scale_actions,
            "scale_outs": self.scale_outs,
            "scale_ins": self.scale_ins,
            "rejected": self.rejected,
            "reversals": self.reversals,
            "final_engines": self.final_engines,
            "peak_engines": self.peak_engines,
            "requests": self.requests,
            "completed": self.completed,
            "trainer_wait_secs": None if self.trainer_wait_secs is None else round(self.trainer_wait_secs, 1),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "seed": self.seed,
            "duration_secs": self.duration_secs,
            "queue_wait_objective_secs": self.queue_wait_objective_secs,
            "config": self.config,
            "actions": [record.to_dict() for record in self.actions],
            "timeline": self.timeline,
        }


def count_reversals(actions: Iterable[ScaleRecord], window_secs: float) -> int:
    """Accepted actions that undo the previous accepted one (out then in, or in then out) within ``window_secs``."""
    accepted = [a for a in actions if a.accepted]
    return sum(
        1 for before, after in zip(accepted, accepted[1:], strict=False)
        if before.action != after.action and after.t - before.t <= window_secs
    )


# --------------------------------------------------------------------------------------------------
# The simulation


class _Simulation:
    def __init__(self, trace: Trace, policy: PolicySpec, settings: SimulationSettings) -> None:
        self.trace = trace
        self.spec = policy
        self.settings = settings
        self.dt = settings.dt_secs
        # Two streams from one seed: arrivals never depend on how many engines a policy started, so every
        # policy sees exactly the same requests (common random numbers make their comparison fair).
        arrivals_seed, startup_seed = np.random.SeedSequence(settings.seed).spawn(2)
        self.rng = np.random.default_rng(arrivals_seed)
        self.startup_rng = np.random.default_rng(startup_seed)
        self.now = 0.0
        self.engines: list[_Engine] = []
        self.removed_gpu_secs = 0.0
        self.next_number = 0
        self.router_backlog: deque[_Request] = deque()
        self.queue_waits: list[float] = []
        self.ttfts: list[float] = []
        self.requests = 0
        self.completed = 0
        self.outstanding: dict[int, int] = {}  # rollout phase index -> unfinished requests
        wait_window = max(1, round(settings.trainer_wait_window_secs / self.dt))
        self.trainer_waiting: deque[bool] = deque(maxlen=wait_window)
        self.trainer_wait_secs = 0.0
        self.secs_above = 0.0
        self.op: _ScaleOp | None = None
        self.actions: list[ScaleRecord] = []
        self.timeline: list[dict[str, Any]] = []
        self.peak = 0

        self.policy: AutoscalerPolicy | None = None
        self.history: MetricsHistory | None = None
        if policy.kind is PolicyKind.STATIC:
            assert policy.static_engines is not None
            self.initial = policy.static_engines
        else:
            config = policy.config
            self.initial = settings.initial_engines if settings.initial_engines is not None else config.min_engines
            if not 1 <= self.initial <= config.max_engines:
                raise PolicyError(
                    f"initial engines ({self.initial}) must be between 1 and max_engines ({config.max_engines})"
                )
            self.policy = AutoscalerPolicy(config, clock=lambda: self.now)
            self.history = MetricsHistory(config.condition_window_secs)
        for _ in range(self.initial):
            self._new_engine(elastic=False)

    # -- engines --------------------------------------------------------------------------------

    def _new_engine(self, *, elastic: bool) -> _Engine:
        engine = _Engine(self.next_number, self.settings.engine, elastic=elastic, dt=self.dt)
        self.next_number += 1
        self.engines.append(engine)
        if elastic:
            startup = self.settings.startup
            ends, t = [], self.now
            for state, secs in ((EngineState.PENDING, startup.placement_wait_secs),
                                (EngineState.STARTING, startup.start_secs),
                                (EngineState.WEIGHT_SYNCING, startup.weight_sync_secs)):
                factor = 1.0 + startup.jitter * (2.0 * self.startup_rng.random() - 1.0) if startup.jitter else 1.0
                t += secs * factor
                ends.append((state, t))
            engine.state = EngineState.PENDING
            engine.boot_plan = ends
        return engine

    def active(self) -> list[_Engine]:
        return [e for e in self.engines if e.state is EngineState.ACTIVE]

    def _route(self, *requests: _Request) -> None:
        """Send ``requests`` (one prompt group, or one retried request) to the least-loaded ACTIVE engine."""
        candidates = self.active()
        if not candidates:
            self.router_backlog.extend(requests)
            return
        target = min(candidates, key=lambda e: (e.in_flight, e.number))
        for request in requests:
            target.submit(request, self.now, self)

    def complete(self, request: _Request) -> None:
        self.completed += 1
        if request.phase_index >= 0:
            left = self.outstanding[request.phase_index] - 1
            if left:
                self.outstanding[request.phase_index] = left
            else:
                del self.outstanding[request.phase_index]

    # -- one step ---------------------------------------------------------------------------------

    def _lifecycle(self) -> None:
        now = self.now
        for engine in self.engines:
            while engine.boot_plan and now + _EPS >= engine.boot_plan[0][1]:
                engine.state = _NEXT_BOOT_STATE[engine.boot_plan.pop(0)[0]]
            if engine.state is EngineState.DRAINING:
                if engine.in_flight == 0:
                    engine.state, engine.stop_at = EngineState.STOPPING, now + self.settings.shutdown_secs
                elif now + _EPS >= engine.drain_deadline:
                    leftovers = engine.abort_all()
                    engine.state, engine.stop_at = EngineState.STOPPING, now + self.settings.shutdown_secs
                    for request in leftovers:
                        self._route(request)
            if engine.state is EngineState.STOPPING and now + _EPS >= engine.stop_at:
                engine.state = EngineState.REMOVED
        kept = []
        for engine in self.engines:
            if engine.state is EngineState.REMOVED:
                self.removed_gpu_secs += engine.gpu_secs
            else:
                kept.append(engine)
        self.engines = kept
        while self.router_backlog and self.active():
            self._route(self.router_backlog.popleft())
        self._check_op()

    def _check_op(self) -> None:
        op = self.op
        if op is None:
            return
        if op.action is ScaleAction.SCALE_IN:
            if all(e.state is EngineState.REMOVED for e in op.engines):
                self.op = None
            return
        if all(e.state is EngineState.ACTIVE for e in op.engines):
            self.op = None
        elif self.now + _EPS >= op.deadline:  # scale_out_request_timeout_secs: roll back the rest
            late = [e for e in op.engines if e.state is not EngineState.ACTIVE]
            for engine in late:
                engine.state = EngineState.REMOVED
                self.removed_gpu_secs += engine.gpu_secs
            self.engines = [e for e in self.engines if e.state is not EngineState.REMOVED]
            if len(late) == len(op.engines):
                assert self.policy is not None
                self.policy.record_action(ScaleAction.SCALE_OUT, accepted=False)
            self.op = None

    def _arrivals(self) -> None:
        t, dt = self.now, self.dt
        group = self.settings.group_size
        rate = self.trace.rate_at(min(t + dt / 2, self.trace.duration_secs))
        groups = int(self.rng.poisson(rate * dt / group)) if rate > 0 else 0
        if groups == 0:
            return
        mean_tokens = self.trace.tokens_at(t) or self.settings.tokens_per_request
        spread = self.settings.token_spread
        offsets = np.sort(self.rng.random(groups)) * dt
        factors = 1.0 - spread + 2.0 * spread * self.rng.random((groups, group))
        phase, phase_index = self.trace.phase_at(t)
        index = phase_index if phase is Phase.ROLLOUT else -1
        prompt = self.settings.engine.prompt_tokens
        for offset, samples in zip(offsets, factors, strict=True):
            requests = []
            for factor in samples:
                tokens = max(1, round(mean_tokens * factor))
                requests.append(_Request(t + float(offset), tokens, prompt + tokens, index))
            self.requests += group
            if index >= 0:
                self.outstanding[index] = self.outstanding.get(index, 0) + group
            self._route(*requests)

    def _serve(self) -> None:
        for engine in self.engines:
            if engine.state in _HOLDS_GPU:
                engine.gpu_secs += self.dt
            if engine.state in _SERVING:
                engine.serve(self.now, self.dt, self)

    def _account(self) -> None:
        """After the step (``self.now`` is its end): admissions, queue-wait objective, trainer wait."""
        now = self.now
        for engine in self.engines:
            if engine.state in _SERVING:
                engine.admit_waiting(now, self)
        oldest = max((e.oldest_wait(now) for e in self.engines), default=0.0)
        if self.router_backlog:
            oldest = max(oldest, now - self.router_backlog[0].arrival)
        if oldest > self.settings.queue_wait_objective_secs:
            self.secs_above += self.dt
        if self.trace.has_phases:
            phase, index = self.trace.phase_at(now - self.dt / 2)
            waiting = phase is Phase.TRAIN and any(i < index for i in self.outstanding)
            self.trainer_waiting.append(waiting)
            if waiting:
                self.trainer_wait_secs += self.dt
        self.peak = max(self.peak, len(self.active()))

    def _scrape(self) -> None:
        assert self.history is not None
        wait = None
        if self.trace.has_phases and self.trainer_waiting:
            wait = sum(self.trainer_waiting) / len(self.trainer_waiting)
        results = {engine.id: engine.metrics() for engine in self.active()}
        self.history.record(self.now, results, trainer_wait_fraction=wait)

    def _evaluate(self) -> None:
        assert self.policy is not None and self.history is not None
        frame = self.history.latest
        if frame is None:
            return
        active = self.active()
        pool = PoolView(current_engines=len(active), initial_engines=self.initial, scale_pending=self.op is not None)
        decision = self.policy.evaluate(frame, pool)
        if decision.action is ScaleAction.SCALE_OUT:
            self._scale_out(decision, len(active))
        elif decision.action is ScaleAction.SCALE_IN:
            self._scale_in(decision, active)

    def _scale_out(self, decision: Decision, n: int) -> None:
        assert self.policy is not None and decision.target is not None
        _, ceiling = self.policy.bounds(PoolView(n, self.initial))
        target = min(decision.target, ceiling)
        if target <= n:
            self.policy.record_action(ScaleAction.SCALE_OUT, accepted=False)
            self.actions.append(ScaleRecord(self.now, "scale_out", n, target, False, decision.reason))
            return
        created = [self._new_engine(elastic=True) for _ in range(target - n)]
        deadline = self.now + self.policy.config.scale_out_request_timeout_secs
        self.op = _ScaleOp(ScaleAction.SCALE_OUT, created, deadline)
        self.policy.record_action(ScaleAction.SCALE_OUT, accepted=True)
        self.actions.append(ScaleRecord(self.now, "scale_out", n, target, True, decision.reason))

    def _scale_in(self, decision: Decision, active: list[_Engine]) -> None:
        assert self.policy is not None and decision.target is not None
        n = len(active)
        floor, _ = self.policy.bounds(PoolView(n, self.initial))
        target = max(decision.target, floor)
        victims = sorted((e for e in active if e.elastic), key=lambda e: e.number, reverse=True)[: n - target]
        if not victims:
            self.policy.record_action(ScaleAction.SCALE_IN, accepted=False)
            self.actions.append(ScaleRecord(self.now, "scale_in", n, target, False, decision.reason))
            return
        for engine in victims:  # leave the router now; finish in-flight work before stopping
            engine.state = EngineState.DRAINING
            engine.drain_deadline = self.now + self.settings.drain_timeout_secs
        self.op = _ScaleOp(ScaleAction.SCALE_IN, victims, math.inf)
        self.policy.record_action(ScaleAction.SCALE_IN, accepted=True)
        self.actions.append(ScaleRecord(self.now, "scale_in", n, n - len(victims), True, decision.reason))

    def _snapshot(self) -> None:
        self.timeline.append({
            "t": round(self.now, 3),
            "rate": round(self.trace.rate_at(min(self.now, self.trace.duration_secs)), 3),
            "active": len(self.active()),
            "engines": len(self.engines),
            "queued": sum(len(e.queue) for e in self.engines) + len(self.router_backlog),
        })

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> SimulationResult:
        settings = self.settings
        duration = settings.duration_secs if settings.duration_secs is not None else self.trace.duration_secs
        steps = max(1, math.ceil(duration / self.dt - _EPS))
        config = self.spec.config if self.policy is not None else None
        metrics_every = config.metrics_interval_secs if config else math.inf
        evaluate_every = config.evaluation_interval_secs if config else math.inf
        next_scrape, next_eval, next_snapshot = 0.0, evaluate_every, 0.0
        self.peak = len(self.active())
        for step in range(steps + 1):
            self.now = step * self.dt
            if step > 0:
                self._account()
            if self.policy is not None:
                if self.now + _EPS >= next_scrape:
                    self._scrape()
                    next_scrape += metrics_every
                if self.now + _EPS >= next_eval:
                    self._evaluate()
                    next_eval += evaluate_every
            if self.now + _EPS >= next_snapshot:
                self._snapshot()
                next_snapshot += settings.timeline_interval_secs
            if step == steps:
                break
            self._lifecycle()
            self._arrivals()
            self._serve()
        return self._result(steps * self.dt)

    def _result(self, duration: float) -> SimulationResult:
        now = self.now
        waits = list(self.queue_waits)
        waits += [now - r.arrival for e in self.engines for r in e.queue]  # still waiting: count their wait so far
        waits += [now - r.arrival for r in self.router_backlog]
        if waits:
            p50, p95, p99 = (float(v) for v in np.percentile(np.asarray(waits), [50, 95, 99]))
            worst = max(waits)
        else:
            p50 = p95 = p99 = worst = 0.0
        ttft = float(np.percentile(np.asarray(self.ttfts), 95)) if self.ttfts else None
        outs = sum(1 for a in self.actions if a.accepted and a.action == "scale_out")
        ins = sum(1 for a in self.actions if a.accepted and a.action == "scale_in")
        return SimulationResult(
            trace=self.trace.name,
            policy=self.spec.label,
            seed=self.settings.seed,
            duration_secs=duration,
            requests=self.requests,
            completed=self.completed,
            engine_seconds=self.removed_gpu_secs + sum(e.gpu_secs for e in self.engines),
            queue_wait_p50=p50,
            queue_wait_p95=p95,
            queue_wait_p99=p99,
            queue_wait_max=worst,
            ttft_p95=ttft,
            secs_above_objective=self.secs_above,
            queue_wait_objective_secs=self.settings.queue_wait_objective_secs,
            scale_outs=outs,
            scale_ins=ins,
            rejected=sum(1 for a in self.actions if not a.accepted),
            reversals=count_reversals(self.actions, self.settings.flap_window_secs),
            final_engines=len(self.active()),
            peak_engines=self.peak,
            trainer_wait_secs=self.trainer_wait_secs if self.trace.has_phases else None,
            timeline=self.timeline,
            actions=self.actions,
            config=self.spec.config.model_dump(mode="json") if self.policy is not None else None,
        )


def simulate(trace: Trace, policy: PolicySpec, settings: SimulationSettings | None = None) -> SimulationResult:
    """Run ``trace`` against a pool driven by ``policy``; deterministic for a given ``settings.seed``."""
    return _Simulation(trace, policy, settings or SimulationSettings()).run()
