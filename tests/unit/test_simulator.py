"""The autoscaler simulator: the real policy on simulated engines, and the ``relax autoscaler simulate`` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.autoscaler.cli import add_autoscaler_parser
from relax.autoscaler.config import AutoscalerConfig
from relax.autoscaler.simulator import (
    RELAX_TUNED,
    PolicyError,
    PolicyKind,
    PolicySpec,
    ScaleRecord,
    SimulationSettings,
    StartupDelays,
    count_reversals,
    parse_policy,
    relax_defaults_config,
    relax_tuned_config,
    simulate,
)
from relax.autoscaler.traces import Phase, Trace, TracePoint
from relax.cli import main
from relax.config.flags import PartialSuccessPolicy

MIN = 60.0
STEP_UP, STEP_DOWN = 3 * MIN, 11 * MIN


def step_trace(low: float = 8.0, high: float = 26.0, end: float = 22 * MIN) -> Trace:
    """``low`` req/s, ``high`` (about 7 engines' worth) from 3 to 11 min, then ``low`` again."""
    points = (TracePoint(0, low), TracePoint(STEP_UP, low), TracePoint(STEP_UP, high), TracePoint(STEP_DOWN, high),
              TracePoint(STEP_DOWN, low), TracePoint(end, low))
    return Trace("test-step", points)


def flat_trace(rate: float, minutes: float) -> Trace:
    return Trace("test-flat", (TracePoint(0, rate), TracePoint(minutes * MIN, rate)))


def fixed_startup(**changes: float) -> SimulationSettings:
    """No start-up jitter, so times can be computed exactly."""
    return SimulationSettings(startup=StartupDelays(jitter=0.0, **changes))


@pytest.fixture(scope="module")
def relax_on_step():
    return simulate(step_trace(), parse_policy("relax"), fixed_startup())


# -- policies -------------------------------------------------------------------------------------


def test_parse_policy_kinds() -> None:
    relax = parse_policy("relax")
    assert relax.kind is PolicyKind.RELAX and relax.label == "relax"
    assert relax.config == relax_tuned_config() and relax.config.enabled
    assert relax.config.evaluation_interval_secs == RELAX_TUNED["evaluation_interval_secs"]
    defaults = parse_policy("relax-defaults")
    assert defaults.config == AutoscalerConfig(enabled=True, min_engines=4, max_engines=8)
    assert defaults.config == relax_defaults_config()
    assert parse_policy("static:3").static_engines == 3
    assert parse_policy("static:min").static_engines == 4
    assert parse_policy(" Static:MAX ").label == "static:8"


def test_parse_policy_with_a_user_config() -> None:
    user = AutoscalerConfig.model_validate({"enabled": False, "min_engines": 2, "max_engines": 5,
                                            "scale_in_policy": {"max_delta": 2}})
    defaults = parse_policy("relax-defaults", user)
    assert defaults.config.min_engines == 2 and defaults.config.enabled  # the file as is, enabled
    assert defaults.config.scale_in_cooldown_secs == 300  # the file did not set it: documented default
    relax = parse_policy("relax", user)
    assert relax.config.scale_in_policy.max_delta == 2  # the file's keys win...
    assert relax.config.scale_in_cooldown_secs == RELAX_TUNED["scale_in_cooldown_secs"]  # ...over the tuned ones
    assert parse_policy("static:max", user).static_engines == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [("greedy", "unknown --policy 'greedy'"), ("static:x", "whole number"), ("static:0", "at least 1 engine"),
     ("static:", "whole number")],
)
def test_parse_policy_errors(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(text)


# -- static pools -------------------------------------------------------------------------------


def test_static_never_scales_and_costs_exactly_n_times_duration() -> None:
    result = simulate(step_trace(end=15 * MIN), parse_policy("static:3"))
    assert result.actions == [] and result.scale_actions == 0 and result.reversals == 0
    assert result.final_engines == result.peak_engines == 3
    assert {point["active"] for point in result.timeline} == {3}
    assert result.engine_seconds == pytest.approx(3 * 15 * MIN)
    assert result.mean_engines == pytest.approx(3)
    assert result.config is None


def test_an_overloaded_static_pool_queues_and_a_big_one_does_not() -> None:
    small = simulate(step_trace(end=15 * MIN), parse_policy("static:4"))
    big = simulate(step_trace(end=15 * MIN), parse_policy("static:8"))
    assert small.queue_wait_p95 > 60 and small.secs_above_objective > 5 * MIN
    assert big.queue_wait_p95 == 0 and big.secs_above_objective == 0
    assert big.ttft_p95 is not None and big.ttft_p95 < 1
    assert small.requests == big.requests  # the same arrivals whatever the pool (one seed, separate streams)


# -- the relax policy under a step ------------------------------------------------------------------


def test_relax_scales_out_after_its_condition_duration(relax_on_step) -> None:
    first = relax_on_step.actions[0]
    assert first.action == "scale_out" and first.accepted
    held = relax_tuned_config().scale_out_policy.condition_duration_secs
    assert STEP_UP + held <= first.t <= STEP_UP + held + 60
    assert first.to_engines == 8  # the queue signals size the step in one action
    assert "queue" in first.reason


def test_relax_scales_back_in_after_the_load_falls(relax_on_step) -> None:
    ins = [a for a in relax_on_step.actions if a.action == "scale_in"]
    config = relax_tuned_config()
    assert ins, "expected scale-in after the load fell"
    assert all(a.t >= STEP_DOWN + config.scale_in_policy.condition_duration_secs for a in ins)
    assert all(a.from_engines - a.to_engines == 1 for a in ins)  # scale_in_policy.max_delta
    for before, after in zip(ins, ins[1:], strict=False):
        assert after.t - before.t >= config.scale_in_cooldown_secs
    assert relax_on_step.final_engines < relax_on_step.peak_engines == 8
    assert relax_on_step.reversals == 0


def test_engines_serve_only_after_their_startup(relax_on_step) -> None:
    first = relax_on_step.actions[0]
    delays = StartupDelays()
    boot = delays.placement_wait_secs + delays.start_secs + delays.weight_sync_secs  # each phase unjittered
    before = [p for p in relax_on_step.timeline if first.t < p["t"] < first.t + boot]
    after = [p for p in relax_on_step.timeline if first.t + boot < p["t"] < STEP_DOWN]
    assert before and all(p["active"] == 4 and p["engines"] == 8 for p in before)
    assert after and all(p["active"] == 8 for p in after)


def test_engine_seconds_count_from_placement_to_removal() -> None:
    # The load stays high to the end, so the pool goes 4 -> 8 once and never back.
    trace = Trace("up", (TracePoint(0, 8), TracePoint(2 * MIN, 8), TracePoint(2 * MIN, 30), TracePoint(12 * MIN, 30)))
    result = simulate(trace, parse_policy("relax"), fixed_startup(placement_wait_secs=60))
    (out,) = result.actions
    placed = out.t + 60  # the GPU is held from the end of the placement wait
    assert result.engine_seconds == pytest.approx(4 * 12 * MIN + 4 * (12 * MIN - placed))


def test_bounds_are_never_crossed() -> None:
    user = AutoscalerConfig.model_validate({"min_engines": 2, "max_engines": 3})
    for policy in ("relax", "relax-defaults"):
        result = simulate(step_trace(high=40), parse_policy(policy, user), fixed_startup())
        assert all(2 <= p["active"] <= 3 and p["engines"] <= 3 for p in result.timeline)
        assert result.peak_engines == 3
        assert all(2 <= a.to_engines <= 3 for a in result.actions)


def test_initial_engines_are_never_scaled_in() -> None:
    user = AutoscalerConfig.model_validate({"min_engines": 1, "max_engines": 8})
    settings = SimulationSettings(initial_engines=3)
    result = simulate(flat_trace(1.0, 15), parse_policy("relax", user), settings)
    assert result.actions == []  # idle, but the 3 initial engines are the floor
    assert result.final_engines == 3


def test_deterministic_with_a_seed() -> None:
    trace = step_trace(end=14 * MIN)
    one = simulate(trace, parse_policy("relax"), SimulationSettings(seed=7)).to_dict()
    two = simulate(trace, parse_policy("relax"), SimulationSettings(seed=7)).to_dict()
    other = simulate(trace, parse_policy("relax"), SimulationSettings(seed=8)).to_dict()
    assert one == two
    assert one["requests"] != other["requests"]
    assert json.loads(json.dumps(one)) == one  # JSON-safe


def test_drain_finishes_or_retries_every_request() -> None:
    """A real drain waits for in-flight work; a drain timeout aborts it and the leftovers are retried, not lost."""
    trace = Trace("burst", (TracePoint(0, 6), TracePoint(4 * MIN, 6), TracePoint(4 * MIN, 2), TracePoint(14 * MIN, 2),
                            TracePoint(14 * MIN, 0), TracePoint(20 * MIN, 0)))
    user = AutoscalerConfig.model_validate({"min_engines": 1, "max_engines": 4})
    eager = {"scale_in_policy": {"condition_duration_secs": 0.0}, "scale_in_cooldown_secs": 0.0}
    spec = PolicySpec(PolicyKind.RELAX, parse_policy("relax", user).config.patch(eager))
    results = {}
    for timeout in (1.0, 300.0):
        settings = SimulationSettings(drain_timeout_secs=timeout, group_size=1, startup=StartupDelays(jitter=0.0))
        results[timeout] = result = simulate(trace, spec, settings)
        assert result.scale_outs == 1 and result.scale_ins == 3
        assert result.completed == result.requests
        assert result.final_engines == 1
    assert results[1.0].engine_seconds < results[300.0].engine_seconds  # the patient drain held GPUs longer


def test_a_scale_out_that_times_out_is_rolled_back_and_backs_off() -> None:
    config = relax_tuned_config().patch({"scale_out_request_timeout_secs": 100.0})  # boot takes 140 s
    result = simulate(step_trace(end=15 * MIN), PolicySpec(PolicyKind.RELAX, config), fixed_startup())
    outs = [a for a in result.actions if a.action == "scale_out"]
    assert outs and result.peak_engines == 4
    assert all(p["active"] == 4 for p in result.timeline)
    assert max(p["engines"] for p in result.timeline) <= 8
    assert all(b.t - a.t >= 100 + 30 for a, b in zip(outs, outs[1:], strict=False))  # timeout + backoff


def test_rl_phases_feed_the_trainer_wait_signal() -> None:
    points = []
    for cycle in range(3):
        start = cycle * 6 * MIN
        points += [TracePoint(start, 24, phase=Phase.ROLLOUT), TracePoint(start + 4 * MIN, 24),
                   TracePoint(start + 4 * MIN, 0.1, phase=Phase.TRAIN), TracePoint(start + 6 * MIN, 0.1)]
    trace = Trace("rl", tuple(points))
    starved = simulate(trace, parse_policy("static:4"))
    fed = simulate(trace, parse_policy("static:8"))
    assert starved.trainer_wait_secs is not None and fed.trainer_wait_secs is not None
    assert starved.trainer_wait_secs > 3 * fed.trainer_wait_secs
    assert simulate(flat_trace(5, 2), parse_policy("static:4")).trainer_wait_secs is None


def test_count_reversals() -> None:
    def record(t: float, action: str, accepted: bool = True) -> ScaleRecord:
        return ScaleRecord(t, action, 4, 5, accepted, "")

    actions = [record(0, "scale_out"), record(100, "scale_in"), record(200, "scale_out", accepted=False),
               record(900, "scale_out"), record(950, "scale_out"), record(2000, "scale_in")]
    assert count_reversals(actions, window_secs=600) == 1  # out->in at 100; in->out at 900 is 800 s later
    assert count_reversals(actions, window_secs=2000) == 3


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="dt_secs"):
        SimulationSettings(dt_secs=0)
    with pytest.raises(ValueError, match="group_size"):
        SimulationSettings(group_size=0)
    with pytest.raises(PolicyError, match="initial engines"):
        simulate(flat_trace(1, 1), parse_policy("relax"), SimulationSettings(initial_engines=9))


# -- CLI ----------------------------------------------------------------------------------------------


def small_trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "load.csv"
    path.write_text("t_secs,rate\n0,4\n180,4\n")
    return path


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace_file(tmp_path)
    assert main(["autoscaler", "simulate", "--trace", str(trace), "--policy", "relax", "--json", "--seed", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy"] == "relax" and report["seed"] == 3 and report["trace"] == str(trace)
    for key in ("engine_seconds", "queue_wait_p95_s", "secs_above_objective", "scale_actions", "reversals",
                "final_engines", "timeline", "actions", "config"):
        assert key in report
    assert report["timeline"][0] == {"t": 0.0, "rate": 4.0, "active": 4, "engines": 4, "queued": 0}


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoscaler", "simulate", "--trace", str(small_trace_file(tmp_path)), "--policy", "static:2"]) == 0
    out = capsys.readouterr().out
    assert "engine-seconds" in out and "static:2" in out and "engines per minute 2222" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "nope"], "unknown trace 'nope'"),
        (["--trace", "missing.csv"], "no such file"),
        (["--trace", "steady", "--policy", "best"], "unknown --policy 'best'"),
        (["--trace", "steady", "--policy", "static:-1"], "static:N needs at least 1 engine"),
        (["--trace", "steady", "--config", "absent.yaml"], "--config absent.yaml: no such file"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoscaler", "simulate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("relax autoscaler simulate: ") and message in err
    assert err.count("\n") == 1


def test_cli_bad_trace_file_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0,1\n60,1\n30,oops\n")
    assert main(["autoscaler", "simulate", "--trace", str(path)]) == 2
    assert "line 3: rate must be a number" in capsys.readouterr().err


def test_cli_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "as.yaml"
    path.write_text("enabled: true\nmax_engine: 8\n")
    assert main(["autoscaler", "simulate", "--trace", "steady", "--config", str(path)]) == 2
    assert "unknown key 'max_engine'" in capsys.readouterr().err


def test_cli_config_that_clashes_with_the_tuned_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "as.yaml"
    path.write_text("enabled: true\nmetrics_interval_secs: 20\n")  # valid alone (evaluation every 30 s)
    assert main(["autoscaler", "simulate", "--trace", "steady", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tuned settings" in err and "evaluation_interval_secs (10)" in err and "relax-defaults" in err


def test_cli_config_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "as.yaml"
    config.write_text("enabled: true\nmin_engines: 2\nmax_engines: 6\n")
    args = ["autoscaler", "simulate", "--trace", str(small_trace_file(tmp_path)), "--config", str(config), "--json"]
    assert main([*args, "--policy", "static:max"]) == 0
    assert json.loads(capsys.readouterr().out)["final_engines"] == 6
    assert main([*args, "--policy", "relax-defaults"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["max_engines"] == 6 and report["final_engines"] == 2


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoscaler", "simulate"]) == 2  # --trace is required
    assert "--trace" in capsys.readouterr().err
    assert main(["autoscaler", "simulate", "--trace", "steady", "--seed", "x"]) == 2


def test_add_autoscaler_parser_sets_func() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="relax")
    add_autoscaler_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["autoscaler", "simulate", "--trace", "steady"])
    assert callable(args.func) and args.policy == "relax" and args.seed == 0 and not args.json


def test_scale_requests_are_carried_out_by_the_real_executor_and_its_partial_success_policy() -> None:
    """The request timeout falls inside the start-up jitter (112-168 s), so some engines of the first scale-out
    are ACTIVE in time and some are not: the run's own policy decides, as in a real run."""
    config = relax_tuned_config().patch({"scale_out_request_timeout_secs": 140.0})
    results = {}
    for policy in PartialSuccessPolicy:
        settings = SimulationSettings(partial_success_policy=policy)
        results[policy] = simulate(step_trace(end=15 * MIN), PolicySpec(PolicyKind.RELAX, config), settings)
    rolled_back, kept = results[PartialSuccessPolicy.ROLLBACK_ALL], results[PartialSuccessPolicy.KEEP_PARTIAL]
    assert rolled_back.request_outcomes["so-1"] == "FAILED"
    assert kept.request_outcomes["so-1"] == "PARTIAL"
    first = rolled_back.actions[0].t
    late = [p for p in rolled_back.timeline if first + 240 < p["t"] < first + 300]  # after the rollback's drain
    assert late and all(p["active"] == 4 for p in late)  # everything the failed request started is gone
    assert max(p["active"] for p in kept.timeline if first + 240 < p["t"] < first + 300) > 4
