"""The autoscaler YAML model: defaults, strictness, cross-field rules, loader messages, PATCH, bounds."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from relax.autoscaler.config import (
    AutoscalerConfig,
    AutoscalerConfigError,
    effective_bounds,
    load_autoscaler_config,
)
from relax.config.flags import ConfigError
from relax.config.plan import check_engine_bounds


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "autoscaler.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def error_of(data: dict) -> str:
    with pytest.raises(AutoscalerConfigError) as info:
        AutoscalerConfig().patch(data)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- defaults ----------------------------------------------------------------------------------------


def test_documented_defaults() -> None:
    c = AutoscalerConfig()
    assert (c.enabled, c.min_engines, c.max_engines) == (False, 1, 8)
    assert (c.scale_out_cooldown_secs, c.scale_in_cooldown_secs) == (60, 300)
    assert (c.metrics_interval_secs, c.evaluation_interval_secs, c.condition_window_secs) == (10, 30, 60)
    assert (c.min_coverage_scale_out, c.min_coverage_scale_in) == (0.5, 1.0)
    assert c.scale_out_request_timeout_secs == 300
    assert c.rollout_service_url is None
    so = c.scale_out_policy
    assert (so.token_usage_threshold, so.queue_depth_per_engine, so.queue_time_p95_threshold) == (0.85, 10, 5.0)
    assert (so.ttft_p95_threshold, so.condition_duration_secs, so.max_delta) == (10.0, 30, 4)
    si = c.scale_in_policy
    assert (si.token_usage_threshold, si.queue_depth_threshold, si.throughput_variance_threshold) == (0.3, 0, 0.1)
    assert (si.condition_duration_secs, si.max_delta, si.projected_usage_max) == (120, 1, 0.5)
    rl = c.rl_signals
    assert (rl.trainer_wait_enabled, rl.trainer_wait_fraction_threshold) == (True, 0.5)
    assert (rl.staleness_blocked_enabled, rl.staleness_blocked_fraction_threshold) == (True, 0.5)


def test_satisfies_the_plans_bounds_protocol() -> None:
    config = AutoscalerConfig(enabled=True, min_engines=2, max_engines=8)
    notes = check_engine_bounds(config, 4)
    assert "effective floor is 4" in notes[0]


def test_config_is_frozen() -> None:
    config = AutoscalerConfig()
    with pytest.raises(pydantic.ValidationError):
        config.max_engines = 3  # type: ignore[misc]


def test_error_is_a_value_error_and_a_config_error() -> None:
    assert issubclass(AutoscalerConfigError, ValueError)
    assert issubclass(AutoscalerConfigError, ConfigError)


# -- loading -----------------------------------------------------------------------------------------


def test_load_recipe_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
enabled: true
min_engines: 4
max_engines: 8
scale_out_policy:
  queue_depth_per_engine: 5
  max_delta: 2
scale_in_policy:
  condition_duration_secs: 90
rl_signals:
  staleness_blocked_enabled: false
rollout_service_url: http://10.0.0.1:8000/
""",
    )
    c = load_autoscaler_config(path)
    assert (c.enabled, c.min_engines, c.max_engines) == (True, 4, 8)
    assert (c.scale_out_policy.queue_depth_per_engine, c.scale_out_policy.max_delta) == (5, 2)
    assert c.scale_out_policy.token_usage_threshold == 0.85  # untouched siblings keep defaults
    assert c.scale_in_policy.condition_duration_secs == 90
    assert c.rl_signals.staleness_blocked_enabled is False
    assert c.rollout_service_url == "http://10.0.0.1:8000"


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    original = AutoscalerConfig(enabled=True, min_engines=4, max_engines=6)
    assert load_autoscaler_config(write(tmp_path, yaml.safe_dump(original.model_dump()))) == original


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AutoscalerConfigError, match=r"nope\.yaml: no such file"):
        load_autoscaler_config(str(tmp_path / "nope.yaml"))


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(AutoscalerConfigError, match="directory"):
        load_autoscaler_config(str(tmp_path))


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "enabled: true\nmin_engines: 4\nscale_out_policy: [1, 2\n")
    with pytest.raises(AutoscalerConfigError, match=r"not valid YAML at line \d+") as info:
        load_autoscaler_config(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("text", "expected"), [("", "empty"), ("- 1\n- 2\n", "mapping"), ("42\n", "mapping")])
def test_empty_or_non_mapping_file(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(AutoscalerConfigError, match=expected):
        load_autoscaler_config(write(tmp_path, text))


def test_unknown_top_level_key_lists_allowed_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "enabled: true\nmax_engine: 8\n")
    with pytest.raises(AutoscalerConfigError) as info:
        load_autoscaler_config(path)
    message = str(info.value)
    assert "unknown key 'max_engine'" in message
    assert "did you mean 'max_engines'" in message
    assert "allowed keys: enabled, min_engines, max_engines" in message
    assert path in message


def test_unknown_nested_key_names_its_block() -> None:
    message = error_of({"scale_in_policy": {"cooldown": 5}})
    assert "unknown key 'scale_in_policy.cooldown'" in message
    assert "allowed keys in scale_in_policy:" in message
    assert "projected_usage_max" in message
    assert "unknown key 'rl_signals.trainer_wait'" in error_of({"rl_signals": {"trainer_wait": 0.5}})


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"max_engines": "8"}, "max_engines must be an integer, got '8'"),
        ({"max_engines": 8.5}, "max_engines must be an integer, got 8.5"),
        ({"min_engines": True}, "min_engines must be an integer, got True"),
        ({"enabled": "yes"}, "enabled must be true or false, got 'yes'"),
        ({"scale_out_policy": {"ttft_p95_threshold": "fast"}}, "scale_out_policy.ttft_p95_threshold must be a number"),
        ({"scale_out_policy": 5}, "scale_out_policy must be a mapping"),
        ({"rollout_service_url": "localhost:8000"}, "rollout_service_url: must be an http(s) URL"),
    ],
)
def test_wrong_types_name_the_field(data: dict, expected: str) -> None:
    assert expected in error_of(data)


def test_wrong_type_in_file(tmp_path: Path) -> None:
    with pytest.raises(AutoscalerConfigError, match="min_engines must be an integer, got 'four'"):
        load_autoscaler_config(write(tmp_path, "enabled: true\nmin_engines: four\n"))


def test_several_problems_in_one_line() -> None:
    message = error_of({"min_engines": 0, "max_engines": "x", "foo": 1, "bar": 2, "baz": 3})
    assert "(and 2 more)" in message


# -- cross-field and range rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"min_engines": 5, "max_engines": 4}, "max_engines (4) is below min_engines (5)"),
        ({"min_engines": 0}, "min_engines must be >= 1, got 0"),
        (
            {"scale_in_policy": {"token_usage_threshold": 0.85}},
            "scale_in_policy.token_usage_threshold (0.85) must be below scale_out_policy.token_usage_threshold (0.85)",
        ),
        (
            {"scale_out_policy": {"token_usage_threshold": 0.2}},
            "scale_in_policy.token_usage_threshold (0.3) must be below scale_out_policy.token_usage_threshold (0.2)",
        ),
        ({"evaluation_interval_secs": 5}, "evaluation_interval_secs (5) is shorter than metrics_interval_secs (10)"),
        ({"min_coverage_scale_out": 1.5}, "min_coverage_scale_out must be <= 1, got 1.5"),
        ({"min_coverage_scale_in": -0.1}, "min_coverage_scale_in must be >= 0, got -0.1"),
        ({"scale_out_cooldown_secs": -1}, "scale_out_cooldown_secs must be >= 0, got -1"),
        ({"scale_in_cooldown_secs": -5}, "scale_in_cooldown_secs must be >= 0, got -5"),
        (
            {"scale_out_policy": {"condition_duration_secs": -1}},
            "scale_out_policy.condition_duration_secs must be >= 0, got -1",
        ),
        (
            {"scale_in_policy": {"condition_duration_secs": -2}},
            "scale_in_policy.condition_duration_secs must be >= 0, got -2",
        ),
        ({"metrics_interval_secs": 0}, "metrics_interval_secs must be > 0, got 0"),
        ({"condition_window_secs": -60}, "condition_window_secs must be > 0"),
        ({"scale_out_policy": {"max_delta": 0}}, "scale_out_policy.max_delta must be >= 1, got 0"),
        ({"scale_in_policy": {"projected_usage_max": 0}}, "scale_in_policy.projected_usage_max must be > 0"),
        (
            {"rl_signals": {"trainer_wait_fraction_threshold": 2}},
            "rl_signals.trainer_wait_fraction_threshold must be <= 1",
        ),
    ],
)
def test_validation_messages_name_the_field(data: dict, expected: str) -> None:
    assert expected in error_of(data)


def test_boundary_values_are_accepted() -> None:
    c = AutoscalerConfig().patch(
        {
            "min_engines": 8,
            "max_engines": 8,
            "min_coverage_scale_out": 0,
            "min_coverage_scale_in": 1,
            "evaluation_interval_secs": 10,
            "scale_out_cooldown_secs": 0,
            "scale_out_policy": {"condition_duration_secs": 0},
        }
    )
    assert c.min_engines == c.max_engines == 8


# -- PATCH /config ----------------------------------------------------------------------------------------


def test_patch_deep_merges_and_leaves_the_original_alone() -> None:
    original = AutoscalerConfig(enabled=True, min_engines=4)
    patched = original.patch({"enabled": False, "scale_out_policy": {"max_delta": 2}})
    assert patched.enabled is False and patched.min_engines == 4
    assert patched.scale_out_policy.max_delta == 2
    assert patched.scale_out_policy.token_usage_threshold == 0.85
    assert original.enabled is True and original.scale_out_policy.max_delta == 4


def test_patch_revalidates_cross_field_rules() -> None:
    config = AutoscalerConfig(min_engines=4, max_engines=8)
    with pytest.raises(AutoscalerConfigError, match=r"max_engines \(3\) is below min_engines \(4\)"):
        config.patch({"max_engines": 3})


def test_patch_rejects_unknown_keys_and_non_mappings() -> None:
    with pytest.raises(AutoscalerConfigError, match="unknown key 'scale_out_policy.threshold'"):
        AutoscalerConfig().patch({"scale_out_policy": {"threshold": 1}})
    with pytest.raises(AutoscalerConfigError, match="must be a mapping"):
        AutoscalerConfig().patch([("enabled", True)])  # type: ignore[arg-type]


def test_patch_can_clear_the_service_url() -> None:
    config = AutoscalerConfig(rollout_service_url="http://a:1")
    assert config.patch({"rollout_service_url": None}).rollout_service_url is None


# -- effective bounds -----------------------------------------------------------------------------------


def test_effective_floor_is_the_initial_count_when_min_is_lower() -> None:
    floor, ceiling, notes = effective_bounds(AutoscalerConfig(min_engines=2, max_engines=8), 4)
    assert (floor, ceiling) == (4, 8)
    assert len(notes) == 1 and "effective floor is the initial count (4)" in notes[0]


def test_no_note_when_min_equals_initial() -> None:
    assert effective_bounds(AutoscalerConfig(min_engines=4, max_engines=8), 4) == (4, 8, [])


def test_initial_above_max_is_an_error() -> None:
    with pytest.raises(AutoscalerConfigError, match=r"max_engines \(4\) is below the 6 initial engines"):
        effective_bounds(AutoscalerConfig(max_engines=4), 6)


def test_min_above_initial_is_an_error() -> None:
    with pytest.raises(AutoscalerConfigError, match=r"min_engines \(4\) is above the 2 initial engines"):
        effective_bounds(AutoscalerConfig(min_engines=4, max_engines=8), 2)
