"""The autoscaler's decision rules (docs/architecture.md, "The autoscaler"): frames in, one decision out, no I/O.

``AutoscalerPolicy.evaluate(frame, pool)`` is called every ``evaluation_interval_secs`` with the
latest ``ClusterFrame`` and a ``PoolView``; the caller carries the decision out through the scaling
API and reports back with ``record_action(action, accepted)``. Time comes from the injected clock,
the same clock that stamps the frames.

The rules, and why:

* **Streaks.** A condition counts only after holding continuously for its ``condition_duration_secs``.
  The first frame on which it holds counts zero time (one sample is not a trend). The streak
  restarts on a false frame, on a gap of more than two evaluation intervals between evaluations
  (nobody watched in between), on a missing frame (stale, or coverage below
  ``min_coverage_scale_out``), while a scale request is pending and when the live engine count
  changes (the numbers described another pool).
* **Scale-out** when ANY signal holds: token usage high, queue per engine high, queue-time P95 high,
  TTFT P95 high, or (Relax's RL signal) the trainer waiting for data. It needs only
  ``min_coverage_scale_out`` (overloaded engines are the ones that time out). It is *suppressed*
  while the staleness gate blocks the rollout loop more than its threshold: the engines are waiting
  for the trainer's weights, so more engines would only wait too.
* **Scale-in** when ALL hold: metrics complete (coverage ≥ ``min_coverage_scale_in`` and no engine
  missing a field — missing is not idle), token usage low, no queue, throughput stable, and the usage
  projected onto one engine fewer (usage × n / (n − 1)) stays under ``projected_usage_max``. Never
  while any scale-out signal is true.
* **Size.** Scale-out adds ``ceil(n × (observed / threshold − 1))`` for the most exceeded signal
  (at least 1; ``+Inf`` latency adds ``max_delta``), capped by ``max_delta`` and the ceiling.
  Scale-in removes ``min(max_delta, n − floor)``.
* **Guards.** Bounds ``[floor, ceiling]`` are hard (floor = max(min_engines, initial engines)). No
  decision while a request is pending. Cooldowns per direction run from the last accepted action in
  that direction. A rejected or failed request backs off exponentially in that direction
  (30 s doubling to 5 min by default) instead of being retried every cycle.

This module is also the autoscaler's **vocabulary**: the condition names (:class:`Condition`), the rules they
form (:class:`Rule`, :class:`Mode`, :func:`rules_summary`), how each is worded (:data:`CONDITION_LABELS`) and
the outcomes the service records beside a request's own statuses (:class:`Outcome`). The service and the
``relax monitor`` dashboard import them from here rather than repeating the strings. It imports nothing heavy
at run time (the config model only for type checking), so the monitor can use it and stay quick to start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from relax.autoscaler.metrics import json_number

if TYPE_CHECKING:
    from relax.autoscaler.config import AutoscalerConfig
    from relax.autoscaler.metrics import ClusterFrame

__all__ = [
    "CONDITION_LABELS",
    "SCALE_IN_CONDITIONS",
    "SCALE_OUT_CONDITIONS",
    "STALENESS_GATE",
    "AutoscalerPolicy",
    "Condition",
    "ConditionLabel",
    "ConditionState",
    "Decision",
    "Mode",
    "Outcome",
    "PoolView",
    "Rule",
    "ScaleAction",
    "Unit",
    "describe",
    "rules_summary",
]


class ScaleAction(str, Enum):
    """What a decision asks for."""

    NONE = "none"
    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"


class Condition(StrEnum):
    """Every condition the policy evaluates (the keys of ``Decision.conditions`` and ``GET /conditions``)."""

    TOKEN_USAGE_HIGH = "token_usage_high"
    QUEUE_PER_ENGINE_HIGH = "queue_per_engine_high"
    QUEUE_TIME_P95_HIGH = "queue_time_p95_high"
    TTFT_P95_HIGH = "ttft_p95_high"
    TRAINER_WAITING = "trainer_waiting"
    STALENESS_BLOCKED = "staleness_blocked"
    METRICS_COMPLETE = "metrics_complete"
    TOKEN_USAGE_LOW = "token_usage_low"
    NO_QUEUE = "no_queue"
    THROUGHPUT_STABLE = "throughput_stable"
    PROJECTED_USAGE_OK = "projected_usage_ok"


class Rule(StrEnum):
    """The rule a condition belongs to (``ConditionState.direction``, the keys of ``rules_summary()``)."""

    SCALE_OUT = ScaleAction.SCALE_OUT.value
    SCALE_IN = ScaleAction.SCALE_IN.value
    GATE = "gate"


class Mode(StrEnum):
    """How a rule combines its conditions."""

    ANY = "ANY"
    ALL = "ALL"
    SUPPRESSES = "suppresses scale-out"


class Unit(StrEnum):
    """How a condition's value and threshold are written (``describe`` here, the monitor's table there)."""

    COUNT = "count"
    FRACTION = "fraction"
    PERCENT = "percent"
    SECS = "secs"


class Outcome(StrEnum):
    """What became of a decision that acted, besides the request's own statuses (``ACTIVE``, ``FAILED``...).

    ``PENDING`` while its request runs; ``NOOP`` when the pool already had the target; ``REJECTED`` when
    the scaling rules refused it or the manager could not be asked; ``UNKNOWN`` when the request's record
    vanished (garbage-collected, or lost with a restarted manager) before it was seen to end.
    """

    PENDING = "PENDING"
    NOOP = "NOOP"
    REJECTED = "REJECTED"
    UNKNOWN = "UNKNOWN"


SCALE_OUT_CONDITIONS: tuple[Condition, ...] = (
    Condition.TOKEN_USAGE_HIGH,
    Condition.QUEUE_PER_ENGINE_HIGH,
    Condition.QUEUE_TIME_P95_HIGH,
    Condition.TTFT_P95_HIGH,
    Condition.TRAINER_WAITING,
)
SCALE_IN_CONDITIONS: tuple[Condition, ...] = (
    Condition.METRICS_COMPLETE,
    Condition.TOKEN_USAGE_LOW,
    Condition.NO_QUEUE,
    Condition.THROUGHPUT_STABLE,
    Condition.PROJECTED_USAGE_OK,
)
STALENESS_GATE = Condition.STALENESS_BLOCKED
RULES: dict[Rule, tuple[Mode, tuple[Condition, ...]]] = {
    Rule.SCALE_OUT: (Mode.ANY, SCALE_OUT_CONDITIONS),
    Rule.SCALE_IN: (Mode.ALL, SCALE_IN_CONDITIONS),
    Rule.GATE: (Mode.SUPPRESSES, (STALENESS_GATE,)),
}
"""Each rule's mode and conditions, in the order they are shown."""


def rules_summary() -> dict[str, dict[str, Any]]:
    """``RULES`` as JSON: ``{"scale_out": {"mode": "ANY", "conditions": [...]}, ...}`` (``GET /conditions``)."""
    return {
        rule.value: {"mode": mode.value, "conditions": [name.value for name in names]}
        for rule, (mode, names) in RULES.items()
    }


class ConditionLabel(NamedTuple):
    """How a condition is worded: ``label``, its comparison ``op`` and the ``unit`` its numbers are written in."""

    label: str
    op: str
    unit: Unit


CONDITION_LABELS: dict[str, ConditionLabel] = {
    Condition.TOKEN_USAGE_HIGH: ConditionLabel("token usage", ">=", Unit.FRACTION),
    Condition.QUEUE_PER_ENGINE_HIGH: ConditionLabel("queue per engine", ">=", Unit.COUNT),
    Condition.QUEUE_TIME_P95_HIGH: ConditionLabel("queue-time P95", ">=", Unit.SECS),
    Condition.TTFT_P95_HIGH: ConditionLabel("TTFT P95", ">=", Unit.SECS),
    Condition.TRAINER_WAITING: ConditionLabel("trainer waiting for data", ">=", Unit.PERCENT),
    Condition.STALENESS_BLOCKED: ConditionLabel("rollout blocked by the staleness gate", ">=", Unit.PERCENT),
    Condition.METRICS_COMPLETE: ConditionLabel("metrics coverage", ">=", Unit.PERCENT),
    Condition.TOKEN_USAGE_LOW: ConditionLabel("token usage", "<=", Unit.FRACTION),
    Condition.NO_QUEUE: ConditionLabel("total queue", "<=", Unit.COUNT),
    Condition.THROUGHPUT_STABLE: ConditionLabel("throughput CV", "<=", Unit.FRACTION),
    Condition.PROJECTED_USAGE_OK: ConditionLabel("projected usage on one engine fewer", "<=", Unit.FRACTION),
}
"""name -> how it is worded: the policy's reasons and the monitor's table use the same words."""
_DELTA_EPSILON = 1e-9  # so float noise in observed/threshold cannot add a whole engine


@dataclass(frozen=True)
class PoolView:
    """What the policy needs to know about the pool: live engine count, initial count, pending request."""

    current_engines: int
    initial_engines: int
    scale_pending: bool = False


@dataclass(frozen=True)
class ConditionState:
    """One condition at one evaluation.

    ``met`` is this frame's comparison; ``streak_secs`` how long it has held without a break;
    ``sustained`` whether that reaches ``required_secs``. ``value`` is ``None`` when the metric is
    unknown (then ``met`` is false and ``note`` says why).
    """

    value: float | None
    threshold: float
    met: bool
    streak_secs: float
    required_secs: float = 0.0
    direction: str = ""
    note: str = ""

    @property
    def sustained(self) -> bool:
        return self.met and self.streak_secs >= self.required_secs

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": json_number(self.value),
            "threshold": json_number(self.threshold),
            "met": self.met,
            "streak_secs": self.streak_secs,
            "required_secs": self.required_secs,
            "sustained": self.sustained,
            "direction": self.direction,
            "note": self.note,
        }


@dataclass(frozen=True)
class Decision:
    """The policy's answer: an action, the absolute target engine count, and why."""

    action: ScaleAction
    target: int | None
    delta: int
    reason: str
    conditions: dict[str, ConditionState]
    metrics: dict[str, Any]
    timestamp: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "target": self.target,
            "delta": self.delta,
            "reason": self.reason,
            "timestamp": self.timestamp,
            "conditions": {name: state.to_dict() for name, state in self.conditions.items()},
            "metrics": self.metrics,
        }


@dataclass
class _Streak:
    since: float | None = None
    last_seen: float | None = None


@dataclass(frozen=True)
class _Reading:
    """A condition before streak bookkeeping: its value, threshold and whether it holds now."""

    value: float | None
    threshold: float
    met: bool
    required_secs: float
    direction: str
    note: str = ""


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "unknown"
    if math.isinf(value):
        return "+Inf"
    if kind == Unit.SECS:
        return f"{value:.2f}s"
    if kind == Unit.FRACTION:
        return f"{value:.2f}"
    if kind == Unit.PERCENT:
        return f"{value:.0%}"
    return f"{value:g}"


def describe(name: str, state: ConditionState) -> str:
    """The words a reason is made of.

    ``"queue per engine 20 >= 10 (held 30s of 30s)"`` for a condition that holds,
    ``"token usage 0.50 (needs <= 0.30)"`` for one that does not.
    """
    label, op, kind = CONDITION_LABELS[name]
    note = f" [{state.note}]" if state.note else ""
    value, threshold = _fmt(state.value, kind), _fmt(state.threshold, kind)
    if not state.met:
        return f"{label} {value} (needs {op} {threshold}){note}"
    held = f" (held {state.streak_secs:.0f}s of {state.required_secs:.0f}s)" if state.required_secs > 0 else ""
    return f"{label} {value} {op} {threshold}{held}{note}"


class AutoscalerPolicy:
    """Streak bookkeeping, guards and sizing around the rules in the module docstring."""

    def __init__(
        self,
        config: AutoscalerConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        backoff_base_secs: float = 30.0,
        backoff_max_secs: float = 300.0,
    ) -> None:
        if backoff_base_secs <= 0 or backoff_max_secs < backoff_base_secs:
            raise ValueError("need 0 < backoff_base_secs <= backoff_max_secs")
        self.config = config
        self._clock = clock
        self.backoff_base_secs = backoff_base_secs
        self.backoff_max_secs = backoff_max_secs
        self._streaks: dict[str, _Streak] = {}
        self._last_action_at: dict[ScaleAction, float] = {}
        self._rejections: dict[ScaleAction, int] = {ScaleAction.SCALE_OUT: 0, ScaleAction.SCALE_IN: 0}
        self._backoff_until: dict[ScaleAction, float] = {}
        self._last_engines: int | None = None
        self._last_pool: PoolView | None = None
        self._last_evaluated_at: float | None = None
        self.last_decision: Decision | None = None

    # -- configuration ----------------------------------------------------------------------------

    def update_config(self, config: AutoscalerConfig) -> None:
        """Swap the config (``PATCH /config``, ``POST /enable``); streaks are kept, new durations apply."""
        self.config = config

    def bounds(self, pool: PoolView) -> tuple[int, int]:
        """Hard ``(floor, ceiling)``: initial engines are never scaled in; the ceiling never below the floor."""
        floor = max(self.config.min_engines, pool.initial_engines)
        return floor, max(self.config.max_engines, floor)

    # -- the decision -----------------------------------------------------------------------------

    def evaluate(self, frame: ClusterFrame, state: PoolView) -> Decision:
        """One evaluation cycle: update every streak from ``frame``, then decide."""
        now = self._clock()
        cfg = self.config
        n = state.current_engines
        floor, ceiling = self.bounds(state)
        unusable = self._unusable(frame, now)
        if unusable or state.scale_pending or (self._last_engines is not None and n != self._last_engines):
            self._streaks.clear()
        readings = self._readings(frame, n)
        if unusable:
            readings = {
                name: _Reading(r.value, r.threshold, False, r.required_secs, r.direction, unusable)
                for name, r in readings.items()
            }
        conditions = {
            name: self._track(name, reading, now, hold=not state.scale_pending) for name, reading in readings.items()
        }
        self._last_engines = n
        self._last_pool = state
        self._last_evaluated_at = now
        metrics = {
            **{k: v for k, v in frame.to_dict().items() if k != "engines"},
            "current_engines": n,
            "floor": floor,
            "ceiling": ceiling,
        }

        def decide(action: ScaleAction, reason: str, target: int | None = None) -> Decision:
            delta = abs(target - n) if target is not None else 0
            decision = Decision(action, target, delta, reason, conditions, metrics, now)
            self.last_decision = decision
            return decision

        if not cfg.enabled:
            return decide(ScaleAction.NONE, "autoscaler is disabled (POST /autoscaler/enable turns it on)")
        if unusable:
            return decide(ScaleAction.NONE, f"no decision: {unusable}")
        if state.scale_pending:
            return decide(ScaleAction.NONE, "no decision: a scale request is pending")

        out = [name for name in SCALE_OUT_CONDITIONS if name in conditions and conditions[name].sustained]
        out_now = [name for name in SCALE_OUT_CONDITIONS if name in conditions and conditions[name].met]
        if out:
            return self._scale_out(out, conditions, n, ceiling, now, decide)
        scale_in = [conditions[name] for name in SCALE_IN_CONDITIONS]
        if all(c.sustained for c in scale_in) and not out_now:
            return self._scale_in(conditions, n, floor, now, decide)
        return decide(ScaleAction.NONE, self._waiting_reason(conditions, out_now))

    def _scale_out(
        self,
        signals: list[str],
        conditions: dict[str, ConditionState],
        n: int,
        ceiling: int,
        now: float,
        decide: Callable[..., Decision],
    ) -> Decision:
        drivers = "; ".join(describe(name, conditions[name]) for name in signals)
        gate = conditions.get(STALENESS_GATE)
        if gate is not None and gate.met:
            return decide(
                ScaleAction.NONE,
                f"scale-out suppressed: {describe(STALENESS_GATE, gate)}, so more engines would only wait "
                f"for weights (signals: {drivers})",
            )
        if n >= ceiling:
            return decide(
                ScaleAction.NONE, f"scale-out wanted but already at the ceiling of {ceiling} engines ({drivers})"
            )
        blocked = self._guard(ScaleAction.SCALE_OUT, self.config.scale_out_cooldown_secs, now)
        if blocked:
            return decide(ScaleAction.NONE, f"scale-out wanted but {blocked} ({drivers})")
        ratios = {name: _ratio(conditions[name]) for name in signals}
        top = max(signals, key=lambda name: ratios[name])
        delta = self.scale_out_delta(n, ratios[top], ceiling)
        others = [describe(name, conditions[name]) for name in signals if name != top]
        also = f"; also {'; '.join(others)}" if others else ""
        reason = (
            f"scale out {n} -> {n + delta} (+{delta}): {describe(top, conditions[top])}, "
            f"×{_fmt(ratios[top], Unit.FRACTION)} the threshold{also}"
        )
        return decide(ScaleAction.SCALE_OUT, reason, n + delta)

    def _scale_in(
        self,
        conditions: dict[str, ConditionState],
        n: int,
        floor: int,
        now: float,
        decide: Callable[..., Decision],
    ) -> Decision:
        drivers = "; ".join(describe(name, conditions[name]) for name in SCALE_IN_CONDITIONS)
        if n <= floor:
            return decide(ScaleAction.NONE, f"pool is idle but already at the floor of {floor} engines")
        blocked = self._guard(ScaleAction.SCALE_IN, self.config.scale_in_cooldown_secs, now)
        if blocked:
            return decide(ScaleAction.NONE, f"scale-in wanted but {blocked}")
        delta = self.scale_in_delta(n, floor)
        return decide(ScaleAction.SCALE_IN, f"scale in {n} -> {n - delta} (-{delta}): {drivers}", n - delta)

    def scale_out_delta(self, n: int, ratio: float, ceiling: int) -> int:
        """``ceil(n × (ratio − 1))``, at least 1, capped by ``max_delta`` and the room under the ceiling."""
        cap = self.config.scale_out_policy.max_delta
        wanted = cap if math.isinf(ratio) else math.ceil(n * (ratio - 1.0) - _DELTA_EPSILON)
        return max(0, min(max(1, wanted), cap, ceiling - n))

    def scale_in_delta(self, n: int, floor: int) -> int:
        """``min(max_delta, n − floor)``: never below the floor."""
        return max(0, min(self.config.scale_in_policy.max_delta, n - floor))

    # -- actions and their consequences -----------------------------------------------------------

    def record_action(self, action: ScaleAction, accepted: bool) -> None:
        """Tell the policy what became of a decision.

        ``accepted=True`` when the scaling API took the request: starts that direction's cooldown,
        clears its backoff and restarts every streak (the pool is about to change). ``accepted=False``
        when it was refused (a scaling rule, another request running, a NOOP) or the request ended FAILED
        or CANCELLED: that direction backs off for ``backoff_base_secs × 2^(rejections − 1)``, at most
        ``backoff_max_secs``.
        """
        if action is ScaleAction.NONE:
            raise ValueError("record_action needs SCALE_OUT or SCALE_IN")
        now = self._clock()
        if accepted:
            self._last_action_at[action] = now
            self._rejections[action] = 0
            self._backoff_until.pop(action, None)
            self._streaks.clear()
            return
        self._rejections[action] += 1
        wait = min(self.backoff_max_secs, self.backoff_base_secs * 2 ** (self._rejections[action] - 1))
        self._backoff_until[action] = now + wait

    def cooldown_remaining(self, action: ScaleAction, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        cooldown = (
            self.config.scale_out_cooldown_secs
            if action is ScaleAction.SCALE_OUT
            else self.config.scale_in_cooldown_secs
        )
        last = self._last_action_at.get(action)
        return 0.0 if last is None else max(0.0, cooldown - (now - last))

    def backoff_remaining(self, action: ScaleAction, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        until = self._backoff_until.get(action)
        return 0.0 if until is None else max(0.0, until - now)

    def _guard(self, action: ScaleAction, cooldown: float, now: float) -> str | None:
        remaining = self.cooldown_remaining(action, now)
        if remaining > 0:
            return f"cooling down ({remaining:.0f}s of {cooldown:.0f}s left)"
        backoff = self.backoff_remaining(action, now)
        if backoff > 0:
            count = self._rejections[action]
            return f"backing off after {count} rejected request(s) ({backoff:.0f}s left)"
        return None

    # -- status -----------------------------------------------------------------------------------

    def conditions(self) -> dict[str, dict[str, Any]]:
        """``GET /autoscaler/conditions``: every condition of the last evaluation."""
        if self.last_decision is None:
            return {}
        return {name: state.to_dict() for name, state in self.last_decision.conditions.items()}

    def status(self) -> dict[str, Any]:
        """``GET /autoscaler/status``: JSON-safe state of the policy."""
        now = self._clock()
        pool = self._last_pool
        floor, ceiling = self.bounds(pool) if pool is not None else (self.config.min_engines, self.config.max_engines)
        directions = {}
        for action in (ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN):
            directions[action.value] = {
                "last_action_at": self._last_action_at.get(action),
                "cooldown_remaining_secs": self.cooldown_remaining(action, now),
                "rejections": self._rejections[action],
                "backoff_remaining_secs": self.backoff_remaining(action, now),
            }
        return {
            "enabled": self.config.enabled,
            "now": now,
            "engines": pool.current_engines if pool is not None else None,
            "initial_engines": pool.initial_engines if pool is not None else None,
            "scale_pending": pool.scale_pending if pool is not None else None,
            "floor": floor,
            "ceiling": ceiling,
            "last_evaluated_at": self._last_evaluated_at,
            "last_decision": self.last_decision.to_dict() if self.last_decision is not None else None,
            "conditions": self.conditions(),
            "directions": directions,
        }

    # -- internals --------------------------------------------------------------------------------

    def _unusable(self, frame: ClusterFrame, now: float) -> str:
        """Why ``frame`` cannot drive a decision (a "missing frame"); empty when it can."""
        cfg = self.config
        age = now - frame.timestamp
        if age > 2 * cfg.metrics_interval_secs:
            return f"metrics are stale ({age:.0f}s old, more than two metrics intervals)"
        if not frame.asked:
            return "no ACTIVE engines to read metrics from"
        if frame.coverage < cfg.min_coverage_scale_out:
            return (
                f"only {len(frame.engines)} of {len(frame.asked)} engines answered (coverage {frame.coverage:.0%} "
                f"< min_coverage_scale_out {cfg.min_coverage_scale_out:.0%})"
            )
        return ""

    def _readings(self, frame: ClusterFrame, n: int) -> dict[str, _Reading]:
        cfg = self.config
        so, si, rl = cfg.scale_out_policy, cfg.scale_in_policy, cfg.rl_signals
        out_secs, in_secs = so.condition_duration_secs, si.condition_duration_secs

        def at_least(value: float | None, threshold: float, secs: float, direction: str = Rule.SCALE_OUT) -> _Reading:
            met = value is not None and value >= threshold
            return _Reading(value, threshold, met, secs, direction, "" if value is not None else "no data")

        def at_most(value: float | None, threshold: float, note: str = "") -> _Reading:
            met = value is not None and value <= threshold
            return _Reading(
                value, threshold, met, in_secs, Rule.SCALE_IN, note or ("" if value is not None else "no data")
            )

        readings: dict[str, _Reading] = {
            Condition.TOKEN_USAGE_HIGH: at_least(frame.token_usage, so.token_usage_threshold, out_secs),
            Condition.QUEUE_PER_ENGINE_HIGH: at_least(frame.queue_per_engine, so.queue_depth_per_engine, out_secs),
            Condition.QUEUE_TIME_P95_HIGH: at_least(frame.queue_time_p95, so.queue_time_p95_threshold, out_secs),
            Condition.TTFT_P95_HIGH: at_least(frame.ttft_p95, so.ttft_p95_threshold, out_secs),
        }
        if rl.trainer_wait_enabled:
            readings[Condition.TRAINER_WAITING] = at_least(
                frame.trainer_wait_fraction, rl.trainer_wait_fraction_threshold, out_secs
            )
        if rl.staleness_blocked_enabled:
            readings[STALENESS_GATE] = at_least(
                frame.staleness_blocked_fraction, rl.staleness_blocked_fraction_threshold, 0.0, Rule.GATE
            )
        gaps = [
            *(f"{e} did not answer" for e in frame.missing),
            *(f"{e} lacks {', '.join(f)}" for e, f in frame.incomplete.items()),
        ]
        complete = frame.coverage >= cfg.min_coverage_scale_in and not gaps
        readings[Condition.METRICS_COMPLETE] = _Reading(
            frame.coverage, cfg.min_coverage_scale_in, complete, in_secs, Rule.SCALE_IN, "; ".join(gaps)
        )
        readings[Condition.TOKEN_USAGE_LOW] = at_most(frame.token_usage, si.token_usage_threshold)
        readings[Condition.NO_QUEUE] = at_most(frame.total_queue, si.queue_depth_threshold)
        readings[Condition.THROUGHPUT_STABLE] = at_most(
            frame.throughput_cv,
            si.throughput_variance_threshold,
            "" if frame.throughput_cv is not None else "not enough history",
        )
        projected = None
        if frame.token_usage is not None and n > 1:
            projected = frame.token_usage * n / (n - 1)
        readings[Condition.PROJECTED_USAGE_OK] = at_most(
            projected, si.projected_usage_max, "" if n > 1 else "one engine cannot lose one"
        )
        return readings

    def _track(self, name: str, reading: _Reading, now: float, *, hold: bool) -> ConditionState:
        """Advance ``name``'s streak; ``hold=False`` reports the reading without starting a streak."""
        streak = self._streaks.setdefault(name, _Streak())
        gap_limit = 2 * self.config.evaluation_interval_secs
        if reading.met and hold:
            if streak.since is None or streak.last_seen is None or now - streak.last_seen > gap_limit:
                streak.since = now
            streak.last_seen = now
            held = now - streak.since
        else:
            streak.since = streak.last_seen = None
            held = 0.0
        return ConditionState(
            reading.value, reading.threshold, reading.met, held, reading.required_secs, reading.direction, reading.note
        )

    def _waiting_reason(self, conditions: dict[str, ConditionState], out_now: list[str]) -> str:
        if out_now:
            building = "; ".join(describe(name, conditions[name]) for name in out_now)
            return f"no scaling yet: scale-out signal not held long enough ({building})"
        failing = [describe(name, conditions[name]) for name in SCALE_IN_CONDITIONS if not conditions[name].met]
        if failing:
            return f"no scaling: load is within bounds (scale-in blocked by: {'; '.join(failing)})"
        holding = "; ".join(describe(name, conditions[name]) for name in SCALE_IN_CONDITIONS)
        return f"no scaling yet: scale-in conditions not held long enough ({holding})"


def _ratio(state: ConditionState) -> float:
    """How far a scale-out signal exceeds its threshold (``observed / threshold``)."""
    if state.value is None:
        return 0.0
    if math.isinf(state.value):
        return math.inf
    return state.value / state.threshold if state.threshold > 0 else math.inf
