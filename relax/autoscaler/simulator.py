"""A discrete-time simulator of an elastic engine pool driven by the real autoscaler policy.

``simulate(trace, policy)`` replays a request-rate trace (``relax.autoscaler.traces``) against a pool of
simulated engines and reports what the policy cost (engine-seconds) and what users felt (queue wait).
It exists so a policy or a config can be judged in seconds, on a laptop, before it moves real GPUs.

Nothing of the autoscaler is re-implemented here: each engine produces the metrics a real engine exports
(``EngineMetrics`` with SGLang-named gauges and cumulative latency histograms on the built-in engine's
SGLang-like buckets), every ``metrics_interval_secs`` they go through the real ``build_cluster_frame`` and
``MetricsHistory``, and every ``evaluation_interval_secs`` the real ``AutoscalerPolicy.evaluate`` decides,
with a ``PoolView`` and ``record_action`` exactly as the service calls them. Only the world is modelled:

* **Engines** (``relax.autoscaler.sim_engine``): continuous batching as processor sharing, a KV
  budget reserved per request, FIFO queues, and the metrics SGLang exports (``EngineMetrics``).
* **Router** (docs/architecture.md, "Router"). Each arriving request goes to the ACTIVE engine with the
  fewest requests in flight (ties: the lowest engine number); with no ACTIVE engine it waits in the router.
* **Scale requests are not modelled: they are carried out by the real executor.** A decision becomes a
  ``ScaleOutSpec`` / ``ScaleInSpec`` handed to :class:`~relax.rollout.fleet.executor.ScaleExecutor` -- the class
  the Ray rollout manager runs -- over a :class:`SimulatedFleet`, on an event loop whose clock is the
  simulation's (``virtual_clock``). So the planners (absolute targets, the initial-engine floor, victims
  newest-elastic-first), one request at a time, the request timeout and the partial-success policy
  (``SimulationSettings.partial_success_policy``, ``rollback_all`` by default as in a run) are the real
  ones. Only the engines' work is modelled: every new engine waits for placement (a node being
  provisioned), starts and syncs weights (``StartupDelays``, seeded jitter) before it is ACTIVE and
  routable; a victim leaves the router, finishes what it has in flight (a real drain) or, after
  ``drain_timeout_secs``, aborts it and the leftovers are retried on other engines; then it shuts down. A
  request that ends FAILED or CANCELLED is reported to the policy as rejected, as the service does.
* **Arrivals** are Poisson with the trace's rate, in GRPO groups of ``group_size`` samples of one prompt
  that the router keeps on one engine; output lengths are uniform around the trace's mean.
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

import asyncio
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax.autoscaler.metrics import MetricsHistory
from relax.autoscaler.policy import AutoscalerPolicy, Decision, PoolView, ScaleAction
from relax.autoscaler.sim_engine import EngineModel, SimEngine, SimRequest
from relax.autoscaler.sim_policies import (
    RECIPE_BOUNDS,
    RELAX_TUNED,
    PolicyError,
    PolicyKind,
    PolicySpec,
    parse_policy,
    relax_defaults_config,
    relax_tuned_config,
)
from relax.autoscaler.traces import Phase, Trace
from relax.autoscaler.virtual_clock import run_virtual
from relax.config.flags import PartialSuccessPolicy
from relax.rollout.fleet.executor import ScaleExecutor
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventLog
from relax.rollout.scaling import (
    FAILED_STATUSES,
    ScaleInSpec,
    ScaleOutSpec,
    ScalingError,
)
from relax.rollout.settings import ScalingSettings

__all__ = [
    "RECIPE_BOUNDS",
    "RELAX_TUNED",
    "EngineModel",
    "PolicyError",
    "PolicyKind",
    "PolicySpec",
    "ScaleRecord",
    "SimulationResult",
    "SimulatedFleet",
    "SimulationSettings",
    "StartupDelays",
    "count_reversals",
    "parse_policy",
    "relax_defaults_config",
    "relax_tuned_config",
    "simulate",
]

_EPS = 1e-9


# --------------------------------------------------------------------------------------------------
# The modelled world


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
    partial_success_policy: PartialSuccessPolicy = PartialSuccessPolicy.ROLLBACK_ALL
    """What a scale-out whose engines did not all come up in time keeps (``--scale-out-partial-success-policy``)."""

    def __post_init__(self) -> None:
        if self.dt_secs <= 0:
            raise ValueError(f"dt_secs must be positive, got {self.dt_secs}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.token_spread < 1:
            raise ValueError(f"token_spread must be in [0, 1), got {self.token_spread}")


_HOLDS_GPU = frozenset({EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING,
                        EngineState.ACTIVE, EngineState.DRAINING})
_SERVING = frozenset({EngineState.ACTIVE, EngineState.DRAINING})


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
    request_outcomes: dict[str, str] = field(default_factory=dict)
    """How each scale request the executor accepted ended (``so-1: ACTIVE``...), oldest first."""

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
            "request_outcomes": dict(self.request_outcomes),
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


class SimulatedFleet:
    """The executor's fleet port over simulated engines: start-up phases and drains take simulated time.

    Engine states live in the real :class:`~relax.rollout.pool.engines.EnginePool` (the executor plans against
    it); the queues and batches live in the simulation's ``SimEngine`` world model.
    """

    def __init__(self, sim: _Simulation) -> None:
        self.sim = sim
        self._cancelled: set[str] = set()

    async def bring_up_elastic(self, engine_id: str, *, timeout_s: float, cancelled: Callable[[], bool]) -> None:
        sim = self.sim
        engine = sim.world_engine(engine_id)
        startup = sim.settings.startup
        # After each phase's (jittered) time the engine moves on: placed -> STARTING, started -> health
        # checked -> WEIGHT_SYNCING (health is folded into the start), synced -> ACTIVE.
        phases = ((startup.placement_wait_secs, (EngineState.STARTING,)),
                  (startup.start_secs, (EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING)),
                  (startup.weight_sync_secs, (EngineState.ACTIVE,)))
        plan = [(secs * sim.jitter(), states) for secs, states in phases]

        async def boot() -> None:
            for secs, states in plan:
                await asyncio.sleep(secs)
                if cancelled() or engine_id in self._cancelled:
                    sim.pool.transition(engine_id, EngineState.REMOVED)
                    return
                for state in states:
                    if state is EngineState.ACTIVE:
                        sim.pool.set_weight_version(engine_id, 0)
                    sim.pool.transition(engine_id, state)

        try:
            await asyncio.wait_for(boot(), timeout=timeout_s)
        except asyncio.TimeoutError:
            state = sim.pool.get(engine_id).state
            sim.pool.transition(engine_id, EngineState.FAILED, error=f"timed out while {state.value}")
        sim.forget_if_gone(engine)

    async def attach_external(self, engine_id: str, url: str, *, timeout_s: float) -> None:
        raise NotImplementedError("the simulator only creates engines")

    def cancel(self, engine_ids: Iterable[str]) -> None:
        self._cancelled.update(engine_ids)

    async def retire(self, engine_id: str, *, force: bool, drain_timeout_s: float, reason: str,
                     on_drained: Callable[[int], None] | None = None) -> int:
        """Leave the router, finish in-flight work (or abort it after the drain timeout), shut down."""
        sim = self.sim
        record = sim.pool.get(engine_id)
        if record.state.terminal:
            return 0
        engine = sim.world_engine(engine_id)
        if record.state is EngineState.ACTIVE:
            sim.pool.transition(engine_id, EngineState.DRAINING)
        deadline = sim.now_() + (0.0 if force else drain_timeout_s)
        while engine.in_flight and sim.now_() + _EPS < deadline:
            await asyncio.sleep(sim.dt)
        aborted = 0
        if engine.in_flight:
            leftovers = engine.abort_all()
            aborted = len(leftovers)
            for request in leftovers:
                sim.route(request)
        if on_drained is not None:
            on_drained(aborted)
        await asyncio.sleep(sim.settings.shutdown_secs)
        if not sim.pool.get(engine_id).state.terminal:
            sim.pool.transition(engine_id, EngineState.REMOVED)
        sim.forget_if_gone(engine)
        return aborted

    async def settle_weights(self) -> None:
        return None


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
        self.pool = EnginePool(self.now_)
        self.engines: dict[str, SimEngine] = {}  # engines that hold or wait for a GPU, by id
        self.removed_gpu_secs = 0.0
        self.router_backlog: deque[SimRequest] = deque()
        self.queue_waits: list[float] = []
        self.ttfts: list[float] = []
        self.requests = 0
        self.completed = 0
        self.outstanding: dict[int, int] = {}  # rollout phase index -> unfinished requests
        wait_window = max(1, round(settings.trainer_wait_window_secs / self.dt))
        self.trainer_waiting: deque[bool] = deque(maxlen=wait_window)
        self.trainer_wait_secs = 0.0
        self.secs_above = 0.0
        self.pending_request: str | None = None  # the scale-out whose end the policy has not heard yet
        self.actions: list[ScaleRecord] = []
        self.timeline: list[dict[str, Any]] = []
        self.peak = 0

        self.policy: AutoscalerPolicy | None = None
        self.history: MetricsHistory | None = None
        max_engines = None
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
            max_engines = config.max_engines
        self.executor = ScaleExecutor(
            self.pool, SimulatedFleet(self), EventLog(self.now_),
            ScalingSettings(initial_engines=self.initial, max_engines=max_engines,
                            scale_out_timeout_s=policy.config.scale_out_request_timeout_secs,
                            partial_success_policy=settings.partial_success_policy),
            drain_timeout_s=settings.drain_timeout_secs, clock=self.now_, timer=self.now_,
        )
        for _ in range(self.initial):
            record = self.pool.add(EngineKind.INITIAL, bundle="initial")
            for state in (EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING):
                self.pool.transition(record.engine_id, state)
            self.pool.set_weight_version(record.engine_id, 0)
            self.pool.transition(record.engine_id, EngineState.ACTIVE)
            self.world_engine(record.engine_id)

    # -- engines --------------------------------------------------------------------------------

    def now_(self) -> float:
        """The simulation's clock (the virtual loop's time while it runs)."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return self.now

    def jitter(self) -> float:
        jitter = self.settings.startup.jitter
        return 1.0 + jitter * (2.0 * self.startup_rng.random() - 1.0) if jitter else 1.0

    def world_engine(self, engine_id: str) -> SimEngine:
        engine = self.engines.get(engine_id)
        if engine is None:
            number = self.pool.get(engine_id).number
            engine = self.engines[engine_id] = SimEngine(engine_id, number, self.settings.engine, dt=self.dt)
        return engine

    def forget_if_gone(self, engine: SimEngine) -> None:
        """A removed or failed engine gives its GPU back: its held time moves to the removed total."""
        if engine.id in self.engines and self.pool.get(engine.id).state.terminal:
            self.removed_gpu_secs += engine.gpu_secs
            del self.engines[engine.id]

    def state(self, engine: SimEngine) -> EngineState:
        return self.pool.get(engine.id).state

    def active(self) -> list[SimEngine]:
        return [e for e in self.engines.values() if self.state(e) is EngineState.ACTIVE]

    def route(self, *requests: SimRequest) -> None:
        """Send ``requests`` (one prompt group, or one retried request) to the least-loaded ACTIVE engine."""
        candidates = self.active()
        if not candidates:
            self.router_backlog.extend(requests)
            return
        target = min(candidates, key=lambda e: (e.in_flight, e.number))
        for request in requests:
            target.submit(request, self.now, self)

    def complete(self, request: SimRequest) -> None:
        self.completed += 1
        if request.phase_index >= 0:
            left = self.outstanding[request.phase_index] - 1
            if left:
                self.outstanding[request.phase_index] = left
            else:
                del self.outstanding[request.phase_index]

    # -- one step ---------------------------------------------------------------------------------

    def _lifecycle(self) -> None:
        while self.router_backlog and self.active():
            self.route(self.router_backlog.popleft())
        self._check_request()

    def _check_request(self) -> None:
        """Tell the policy when a scale-out it started ended without growing the pool (FAILED / CANCELLED)."""
        if self.pending_request is None:
            return
        record = self.executor.registry.get(self.pending_request)
        if record.terminal:
            self.pending_request = None
            if record.status.value in FAILED_STATUSES:
                assert self.policy is not None
                self.policy.record_action(ScaleAction.SCALE_OUT, accepted=False)

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
                requests.append(SimRequest(t + float(offset), tokens, prompt + tokens, index))
            self.requests += group
            if index >= 0:
                self.outstanding[index] = self.outstanding.get(index, 0) + group
            self.route(*requests)

    def _serve(self) -> None:
        for engine in list(self.engines.values()):
            state = self.state(engine)
            if state in _HOLDS_GPU:
                engine.gpu_secs += self.dt
            if state in _SERVING:
                engine.serve(self.now, self.dt, self)

    def _account(self) -> None:
        """After the step (``self.now`` is its end): admissions, queue-wait objective, trainer wait."""
        now = self.now
        for engine in self.engines.values():
            if self.state(engine) in _SERVING:
                engine.admit_waiting(now, self)
        oldest = max((e.oldest_wait(now) for e in self.engines.values()), default=0.0)
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
        running = self.executor.running_request_id() is not None
        pool = PoolView(current_engines=len(active), initial_engines=self.initial, scale_pending=running)
        decision = self.policy.evaluate(frame, pool)
        if decision.action is ScaleAction.SCALE_OUT:
            self._scale_out(decision, len(active))
        elif decision.action is ScaleAction.SCALE_IN:
            self._scale_in(decision, len(active))

    def _scale_out(self, decision: Decision, n: int) -> None:
        assert self.policy is not None and decision.target is not None
        _, ceiling = self.policy.bounds(PoolView(n, self.initial))
        target = min(decision.target, ceiling)
        timeout = self.policy.config.scale_out_request_timeout_secs
        self._submit("scale_out", n, target, decision,
                     lambda: self.executor.scale_out(ScaleOutSpec(num_replicas=target, timeout_secs=timeout)))

    def _scale_in(self, decision: Decision, n: int) -> None:
        assert self.policy is not None and decision.target is not None
        floor, _ = self.policy.bounds(PoolView(n, self.initial))
        target = max(decision.target, floor)
        self._submit("scale_in", n, target, decision,
                     lambda: self.executor.scale_in(ScaleInSpec(num_replicas=target)))

    def _submit(self, action: str, n: int, target: int, decision: Decision,
                call: Callable[[], dict[str, Any]]) -> None:
        """File the decision with the executor as the service would; a refusal or NOOP is a rejected action."""
        assert self.policy is not None
        kind = ScaleAction(action)
        try:
            request_id = call().get("request_id")  # None: a NOOP answer
        except ScalingError:  # refused by a rule (e.g. no elastic engine to remove)
            request_id = None
        accepted = request_id is not None
        self.policy.record_action(kind, accepted=accepted)
        self.actions.append(ScaleRecord(self.now, action, n, target, accepted, decision.reason))
        if accepted and kind is ScaleAction.SCALE_OUT:
            self.pending_request = request_id

    def _snapshot(self) -> None:
        self.timeline.append({
            "t": round(self.now, 3),
            "rate": round(self.trace.rate_at(min(self.now, self.trace.duration_secs)), 3),
            "active": len(self.active()),
            "engines": len(self.engines),
            "queued": sum(len(e.queue) for e in self.engines.values()) + len(self.router_backlog),
        })

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> SimulationResult:
        return run_virtual(self._run())

    async def _run(self) -> SimulationResult:
        settings = self.settings
        duration = settings.duration_secs if settings.duration_secs is not None else self.trace.duration_secs
        steps = max(1, math.ceil(duration / self.dt - _EPS))
        config = self.spec.config if self.policy is not None else None
        metrics_every = config.metrics_interval_secs if config else math.inf
        evaluate_every = config.evaluation_interval_secs if config else math.inf
        next_scrape, next_eval, next_snapshot = 0.0, evaluate_every, 0.0
        self.peak = len(self.active())
        loop = asyncio.get_running_loop()
        for step in range(steps + 1):
            self.now = step * self.dt
            if self.now > loop.time():
                await asyncio.sleep(self.now - loop.time())  # simulated engines' work up to now runs first
            await asyncio.sleep(0)
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
        await self.executor.aclose()
        return self._result(steps * self.dt)

    def _result(self, duration: float) -> SimulationResult:
        now = self.now
        waits = list(self.queue_waits)
        waits += [now - r.arrival for e in self.engines.values() for r in e.queue]  # still waiting: count it so far
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
            engine_seconds=self.removed_gpu_secs + sum(e.gpu_secs for e in self.engines.values()),
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
            request_outcomes={r.request_id: r.status.value for r in reversed(self.executor.registry.list_requests())},
        )


def simulate(trace: Trace, policy: PolicySpec, settings: SimulationSettings | None = None) -> SimulationResult:
    """Run ``trace`` against a pool driven by ``policy``; deterministic for a given ``settings.seed``."""
    return _Simulation(trace, policy, settings or SimulationSettings()).run()
