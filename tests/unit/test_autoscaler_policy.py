"""Every rule of the autoscaler policy (docs/architecture.md, "The autoscaler") on an injected clock."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from relax.autoscaler.config import AutoscalerConfig
from relax.autoscaler.metrics import ClusterFrame, EngineMetrics, Histogram, ScrapeError, build_cluster_frame
from relax.autoscaler.policy import (
    SCALE_IN_CONDITIONS,
    AutoscalerPolicy,
    Decision,
    PoolView,
    ScaleAction,
)

OUT, IN, NONE = ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN, ScaleAction.NONE


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def config(**overrides: Any) -> AutoscalerConfig:
    """Evaluation every 10 s (gap limit 20 s), scale-out held 30 s, scale-in held 120 s."""
    base = AutoscalerConfig(enabled=True, min_engines=1, max_engines=8, evaluation_interval_secs=10)
    return base.patch(overrides)


def frame(
    t: float,
    n: int = 4,
    *,
    usage: float | None = 0.5,
    queue: float = 0.0,
    throughput: float = 100.0,
    cv: float | None = 0.0,
    down: int = 0,
    **fields: Any,
) -> ClusterFrame:
    """A frame of ``n`` asked engines, the last ``down`` of which did not answer."""
    results: dict[str, Any] = {}
    for i in range(n):
        if i >= n - down:
            results[f"engine_{i}"] = ScrapeError("timed out")
        else:
            results[f"engine_{i}"] = EngineMetrics(token_usage=usage, num_queue_reqs=queue, gen_throughput=throughput)
    built = build_cluster_frame(t, results)
    built.throughput_cv = cv
    for name, value in fields.items():
        setattr(built, name, value)
    return built


class Harness:
    """A policy, its clock and a pool; ``step`` advances time and evaluates one frame."""

    def __init__(self, cfg: AutoscalerConfig | None = None, engines: int = 4, initial: int = 4) -> None:
        self.clock = Clock()
        self.policy = AutoscalerPolicy(cfg or config(), self.clock)
        self.pool = PoolView(engines, initial)

    def step(self, advance: float = 10.0, *, pending: bool = False, **kwargs: Any) -> Decision:
        self.clock.now += advance
        n = kwargs.pop("n", self.pool.current_engines)
        view = PoolView(self.pool.current_engines, self.pool.initial_engines, pending)
        return self.policy.evaluate(frame(self.clock.now, n, **kwargs), view)

    def run(self, steps: int, **kwargs: Any) -> list[Decision]:
        return [self.step(**kwargs) for _ in range(steps)]


HOT = {"usage": 0.9}  # token usage above 0.85
IDLE = {"usage": 0.05, "queue": 0.0, "cv": 0.0}


# -- streaks --------------------------------------------------------------------------------------------


def test_first_true_frame_counts_zero_time() -> None:
    h = Harness()
    first = h.step(**HOT)
    state = first.conditions["token_usage_high"]
    assert state.met and state.streak_secs == 0 and not state.sustained
    assert first.action is NONE and "not held long enough" in first.reason
    assert [d.action for d in h.run(2, **HOT)] == [NONE, NONE]  # 10 s, 20 s
    decision = h.step(**HOT)  # 30 s
    assert decision.conditions["token_usage_high"].streak_secs == 30
    assert decision.action is OUT


def test_zero_duration_acts_on_the_first_true_frame() -> None:
    h = Harness(config(scale_out_policy={"condition_duration_secs": 0}))
    assert h.step(**HOT).action is OUT


def test_a_false_frame_restarts_the_streak() -> None:
    h = Harness()
    h.run(3, **HOT)  # streak 20 s
    assert not h.step(usage=0.5).conditions["token_usage_high"].met
    assert h.step(**HOT).conditions["token_usage_high"].streak_secs == 0


def test_gap_over_two_evaluation_intervals_restarts_the_streak() -> None:
    h = Harness()
    h.run(2, **HOT)  # streak 10 s
    assert h.step(20.0, **HOT).conditions["token_usage_high"].streak_secs == 30  # exactly two intervals: kept
    late = h.step(21.0, **HOT)  # more than two intervals: nobody watched in between
    assert late.conditions["token_usage_high"].streak_secs == 0
    assert late.action is NONE


def test_a_missing_frame_restarts_every_streak() -> None:
    h = Harness()
    h.run(3, **HOT)
    h.clock.now += 10
    stale = h.policy.evaluate(frame(h.clock.now - 25, **HOT), h.pool)  # older than two metrics intervals
    assert stale.action is NONE and "stale" in stale.reason
    assert not stale.conditions["token_usage_high"].met
    assert h.step(**HOT).conditions["token_usage_high"].streak_secs == 0


def test_coverage_below_the_scale_out_minimum_is_a_missing_frame() -> None:
    h = Harness()
    h.run(3, **HOT)
    blind = h.step(down=3, **HOT)  # 1 of 4 answered: 25% < 50%
    assert blind.action is NONE and "only 1 of 4 engines answered" in blind.reason
    assert h.step(**HOT).conditions["token_usage_high"].streak_secs == 0


def test_engine_count_change_restarts_streaks() -> None:
    h = Harness()
    h.run(3, **HOT)
    h.pool = PoolView(3, 3)  # an engine was evicted
    assert h.step(**HOT).conditions["token_usage_high"].streak_secs == 0


# -- scale-out signals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "condition"),
    [
        ({"usage": 0.9}, "token_usage_high"),
        ({"queue": 12.0}, "queue_per_engine_high"),
        ({"queue_time_p95": 6.0}, "queue_time_p95_high"),
        ({"ttft_p95": 11.0}, "ttft_p95_high"),
        ({"trainer_wait_fraction": 0.8}, "trainer_waiting"),
    ],
)
def test_any_signal_scales_out(fields: dict, condition: str) -> None:
    h = Harness()
    decisions = h.run(4, **fields)
    assert decisions[-1].action is OUT
    assert decisions[-1].conditions[condition].sustained
    others = [name for name, c in decisions[-1].conditions.items() if c.met and c.direction == "scale_out"]
    assert others == [condition]


def test_inf_latency_counts_as_too_high_and_adds_max_delta() -> None:
    h = Harness(config(max_engines=6))
    decision = h.run(4, ttft_p95=math.inf)[-1]
    assert decision.action is OUT
    assert decision.conditions["ttft_p95_high"].value == math.inf
    assert (decision.target, decision.delta) == (6, 2)  # max_delta 4, capped by the ceiling
    assert "TTFT P95 +Inf" in decision.reason


def test_inf_from_real_histograms_triggers_queue_time() -> None:
    slow = Histogram((1.0, 5.0, math.inf), (0, 0, 10))  # every request beyond the largest bucket
    engines = {f"engine_{i}": EngineMetrics(0.5, 0, gen_throughput=1.0, queue_time=slow) for i in range(4)}
    h = Harness()
    decisions = []
    for _ in range(4):
        h.clock.now += 10
        decisions.append(h.policy.evaluate(build_cluster_frame(h.clock.now, engines), h.pool))
    assert decisions[0].conditions["queue_time_p95_high"].value == math.inf
    assert decisions[-1].action is OUT and decisions[-1].delta == 4


def test_unknown_values_are_not_met() -> None:
    h = Harness()
    decision = h.step(usage=None)
    assert not decision.conditions["token_usage_high"].met
    assert decision.conditions["token_usage_high"].note == "no data"
    assert not decision.conditions["token_usage_low"].met


# -- sizing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "n", "expected"),
    [
        ({"usage": 0.9}, 4, 1),  # ceil(4 × (0.9/0.85 − 1)) = ceil(0.235) = 1
        ({"queue": 15.0}, 4, 2),  # ceil(4 × 0.5) = 2, no float overshoot
        ({"queue": 12.5}, 4, 1),  # ceil(4 × 0.25) = 1
        ({"queue": 10.0}, 4, 1),  # at the threshold: at least 1
        ({"queue": 20.0}, 4, 4),  # ceil(4 × 1) = 4 = max_delta
        ({"queue": 40.0}, 4, 4),  # ceil(4 × 3) = 12, capped by max_delta 4
        ({"queue": 15.0, "ttft_p95": 25.0}, 2, 3),  # most exceeded: TTFT ×2.5 -> ceil(2 × 1.5) = 3
        ({"trainer_wait_fraction": 0.8}, 4, 3),  # ceil(4 × 0.6) = 3
    ],
)
def test_proportional_scale_out_delta(fields: dict, n: int, expected: int) -> None:
    h = Harness(engines=n, initial=n)
    decision = h.run(4, n=n, **fields)[-1]
    assert decision.action is OUT
    assert (decision.delta, decision.target) == (expected, n + expected)


def test_reason_names_the_most_exceeded_signal_first() -> None:
    decision = Harness(engines=2, initial=2).run(4, n=2, queue=15.0, ttft_p95=25.0)[-1]
    assert decision.reason.startswith("scale out 2 -> 5 (+3): TTFT P95 25.00s >= 10.00s")
    assert "also queue per engine 15 >= 10" in decision.reason


def test_scale_out_delta_formula_directly() -> None:
    policy = AutoscalerPolicy(config(), Clock())
    assert policy.scale_out_delta(4, 1.5, ceiling=8) == 2
    assert policy.scale_out_delta(4, 1.5, ceiling=5) == 1
    assert policy.scale_out_delta(4, math.inf, ceiling=8) == 4
    assert policy.scale_out_delta(0, 3.0, ceiling=8) == 1
    assert policy.scale_out_delta(8, 3.0, ceiling=8) == 0


def test_scale_in_delta_formula() -> None:
    policy = AutoscalerPolicy(config(scale_in_policy={"max_delta": 2}), Clock())
    assert policy.scale_in_delta(8, 4) == 2
    assert policy.scale_in_delta(5, 4) == 1
    assert policy.scale_in_delta(4, 4) == 0


# -- scale-in ----------------------------------------------------------------------------------------------


def test_idle_pool_scales_in_after_the_duration() -> None:
    h = Harness(engines=6, initial=4)
    decisions = h.run(13, **IDLE)  # 0 .. 120 s
    assert [d.action for d in decisions[:12]] == [NONE] * 12
    last = decisions[-1]
    assert last.action is IN and (last.target, last.delta) == (5, 1)
    for name in ("token usage 0.05 <= 0.30", "total queue 0 <= 0", "throughput CV 0.00 <= 0.10", "projected usage"):
        assert name in last.reason
    assert all(last.conditions[name].sustained for name in SCALE_IN_CONDITIONS)


def test_scale_in_needs_all_conditions() -> None:
    for blocker in ({"queue": 1.0}, {"cv": 0.5}, {"cv": None}, {"usage": 0.35}):
        h = Harness(engines=6, initial=4)
        decision = h.run(14, **{**IDLE, **blocker})[-1]
        assert decision.action is NONE, blocker


def test_projected_usage_blocks_scale_in() -> None:
    h = Harness(engines=2, initial=1)
    decision = h.run(14, n=2, usage=0.28, queue=0.0, cv=0.0)[-1]  # 0.28 × 2 / 1 = 0.56 > 0.5
    assert decision.action is NONE
    state = decision.conditions["projected_usage_ok"]
    assert state.value == pytest.approx(0.56) and not state.met


def test_partial_coverage_blocks_scale_in_but_not_scale_out() -> None:
    idle = Harness(engines=6, initial=4)
    decision = idle.run(20, n=6, down=1, **IDLE)[-1]  # 5 of 6 answered, for 190 s
    assert decision.action is NONE
    complete = decision.conditions["metrics_complete"]
    assert not complete.met and "engine_5 did not answer" in complete.note
    assert "metrics coverage 83%" in decision.reason
    busy = Harness(engines=6, initial=4)
    assert busy.run(4, n=6, down=2, **HOT)[-1].action is OUT  # 4 of 6 ≥ 50%


def test_engine_missing_a_field_blocks_scale_in() -> None:
    h = Harness(engines=5, initial=4)
    decisions = []
    for _ in range(14):
        h.clock.now += 10
        results: dict[str, Any] = {f"engine_{i}": EngineMetrics(0.05, 0, gen_throughput=1.0) for i in range(4)}
        results["engine_4"] = EngineMetrics(num_queue_reqs=0)  # answered, but no usage or throughput
        built = build_cluster_frame(h.clock.now, results)
        built.throughput_cv = 0.0
        decisions.append(h.policy.evaluate(built, PoolView(5, 4)))
    assert decisions[-1].action is NONE
    assert "engine_4 lacks token_usage, gen_throughput" in decisions[-1].conditions["metrics_complete"].note


def test_scale_out_signal_blocks_scale_in() -> None:
    h = Harness(engines=6, initial=4, cfg=config(scale_out_policy={"condition_duration_secs": 600}))
    decision = h.run(14, **IDLE, ttft_p95=30.0)[-1]  # idle by usage, but latency is bad
    assert decision.action is NONE and "scale-out signal" in decision.reason


# -- guards: bounds, pending, cooldowns, backoff ---------------------------------------------------------------


def test_no_scale_out_at_the_ceiling() -> None:
    h = Harness(config(max_engines=4))
    decision = h.run(4, **HOT)[-1]
    assert decision.action is NONE and "ceiling of 4" in decision.reason


def test_no_scale_in_at_the_floor_which_is_the_initial_count() -> None:
    h = Harness(config(min_engines=2), engines=4, initial=4)
    decision = h.run(14, **IDLE)[-1]
    assert decision.action is NONE and "floor of 4" in decision.reason
    assert h.policy.bounds(PoolView(4, 4)) == (4, 8)


def test_scale_in_never_goes_below_the_floor() -> None:
    h = Harness(config(min_engines=4, scale_in_policy={"max_delta": 3}), engines=6, initial=4)
    decision = h.run(13, n=6, **IDLE)[-1]
    assert decision.action is IN and (decision.target, decision.delta) == (4, 2)


def test_no_decision_while_a_request_is_pending() -> None:
    h = Harness()
    h.run(3, **HOT)
    pending = h.run(5, pending=True, **HOT)
    assert all(d.action is NONE and "pending" in d.reason for d in pending)
    assert all(d.conditions["token_usage_high"].streak_secs == 0 for d in pending)
    after = h.run(4, **HOT)  # the streak starts again once the request is done
    assert [d.action for d in after] == [NONE, NONE, NONE, OUT]


def test_scale_out_cooldown() -> None:
    h = Harness()
    assert h.run(4, **HOT)[-1].action is OUT
    h.policy.record_action(OUT, accepted=True)
    decisions = h.run(7, **HOT)  # 10 .. 70 s after the action
    assert decisions[3].action is NONE and "cooling down (20s of 60s left)" in decisions[3].reason
    assert decisions[5].action is OUT  # 60 s after the action, streak 50 s


def test_cooldowns_are_per_direction() -> None:
    h = Harness(config(scale_out_cooldown_secs=1000, scale_in_cooldown_secs=150), engines=6, initial=4)
    h.policy.record_action(IN, accepted=True)  # a scale-in just happened ...
    assert h.run(4, **HOT)[-1].action is OUT  # ... and does not delay a scale-out
    h.policy.record_action(OUT, accepted=True)  # a long scale-out cooldown starts ...
    assert h.run(13, **IDLE)[-1].action is IN  # ... and does not delay a scale-in (170 s after the last one)
    h.policy.record_action(IN, accepted=True)
    blocked = h.run(13, **IDLE)[-1]  # 130 s after the last scale-in
    assert blocked.action is NONE and "scale-in wanted but cooling down (20s of 150s left)" in blocked.reason


def test_rejected_requests_back_off_exponentially() -> None:
    h = Harness()
    assert h.run(4, **HOT)[-1].action is OUT
    for wait in (30, 60, 120, 240, 300, 300):
        h.policy.record_action(OUT, accepted=False)
        assert h.policy.backoff_remaining(OUT) == wait
        decisions = h.run(wait // 10, **HOT)
        assert all(d.action is NONE and "backing off" in d.reason for d in decisions[:-1])
        assert decisions[-1].action is OUT  # retried once the backoff is over, not before
    h.policy.record_action(OUT, accepted=True)
    assert h.policy.backoff_remaining(OUT) == 0
    h.policy.record_action(OUT, accepted=False)
    assert h.policy.backoff_remaining(OUT) == 30  # accepting reset the count


def test_backoff_is_per_direction() -> None:
    h = Harness()
    h.policy.record_action(IN, accepted=False)
    assert h.policy.backoff_remaining(IN) == 30 and h.policy.backoff_remaining(OUT) == 0
    assert h.run(4, **HOT)[-1].action is OUT


def test_record_action_rejects_none() -> None:
    with pytest.raises(ValueError, match="SCALE_OUT or SCALE_IN"):
        AutoscalerPolicy(config(), Clock()).record_action(NONE, accepted=True)


# -- RL signals -----------------------------------------------------------------------------------------------


def test_trainer_waiting_can_be_disabled() -> None:
    h = Harness(config(rl_signals={"trainer_wait_enabled": False}))
    decision = h.run(4, trainer_wait_fraction=0.9)[-1]
    assert decision.action is NONE and "trainer_waiting" not in decision.conditions


def test_staleness_gate_suppresses_scale_out() -> None:
    h = Harness()
    decision = h.run(4, staleness_blocked_fraction=0.7, **HOT)[-1]
    assert decision.action is NONE
    assert decision.reason.startswith("scale-out suppressed: rollout blocked by the staleness gate 70% >= 50%")
    assert decision.conditions["token_usage_high"].sustained  # the signal is still tracked ...
    assert h.step(staleness_blocked_fraction=0.2, **HOT).action is OUT  # ... so it acts once the gate opens


def test_staleness_gate_can_be_disabled() -> None:
    h = Harness(config(rl_signals={"staleness_blocked_enabled": False}))
    assert h.run(4, staleness_blocked_fraction=0.9, **HOT)[-1].action is OUT


def test_staleness_gate_does_not_block_scale_in() -> None:
    h = Harness(engines=6, initial=4)
    assert h.run(13, staleness_blocked_fraction=0.9, **IDLE)[-1].action is IN


def test_starving_trainer_and_blocked_rollout_do_not_scale_out() -> None:
    h = Harness()
    decision = h.run(4, trainer_wait_fraction=0.9, staleness_blocked_fraction=0.9)[-1]
    assert decision.action is NONE and "trainer waiting for data 90%" in decision.reason


# -- enable switch, config swap, status -------------------------------------------------------------------------


def test_disabled_policy_reports_conditions_but_never_acts() -> None:
    h = Harness(config(enabled=False))
    decision = h.run(4, **HOT)[-1]
    assert decision.action is NONE and "disabled" in decision.reason
    assert decision.conditions["token_usage_high"].sustained
    h.policy.update_config(h.policy.config.patch({"enabled": True}))
    assert h.step(**HOT).action is OUT


def test_status_and_conditions_are_json() -> None:
    h = Harness(engines=5, initial=4)
    assert h.policy.conditions() == {}
    assert h.policy.status()["last_decision"] is None
    h.run(4, ttft_p95=math.inf)
    h.policy.record_action(OUT, accepted=True)
    h.policy.record_action(IN, accepted=False)
    status = h.policy.status()
    json.dumps(status, allow_nan=False)
    assert status["enabled"] is True and (status["floor"], status["ceiling"]) == (4, 8)
    assert status["last_decision"]["action"] == "scale_out"
    assert status["last_decision"]["metrics"]["ttft_p95"] == "+Inf"
    assert status["conditions"]["ttft_p95_high"]["value"] == "+Inf"
    assert status["directions"]["scale_out"]["cooldown_remaining_secs"] == 60
    assert status["directions"]["scale_in"]["rejections"] == 1
    assert status["directions"]["scale_in"]["backoff_remaining_secs"] == 30
    assert set(h.policy.conditions()) >= {"token_usage_high", "metrics_complete", "staleness_blocked"}


def test_decision_metrics_describe_the_pool() -> None:
    decision = Harness().step(queue=3.0)
    assert decision.metrics["current_engines"] == 4
    assert decision.metrics["total_queue"] == 12 and decision.metrics["queue_per_engine"] == 3
    assert decision.to_dict()["action"] == "none"


def test_backoff_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="backoff"):
        AutoscalerPolicy(config(), Clock(), backoff_base_secs=10, backoff_max_secs=5)
