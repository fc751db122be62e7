"""The rollout's settings from the recipe's flags (``rollout.settings.rollout_settings``): every knob lands in
the record of the part that reads it, once, and the run's secrets never show in a repr."""

from __future__ import annotations

from pathlib import Path

from relax.config.flags import PartialSuccessPolicy, parse_args
from relax.config.verify_weights import VerifyPolicy
from relax.rollout.settings import RunFacts, rollout_settings
from relax.weights.pause_mode import PauseMode
from tests.unit.test_plan import driver_plan, recipe_qwen3_4b_args

FACTS = RunFacts(backend="sglang", broadcast_backend="nccl", engines_per_node=1, engine_log_dir="/runs/r1/engines",
                 engine_api_key="run-secret", engine_generation_key="user-key", external_engine_api_key="ops-key",
                 sglang_router_api_key="router-key")


def settings_for(tmp_path: Path, *extra: str):
    yaml = tmp_path / "autoscaler.yaml"
    yaml.write_text("enabled: true\nmin_engines: 4\nmax_engines: 8\n")
    args = parse_args([*recipe_qwen3_4b_args(str(yaml)), *extra])
    return rollout_settings(args, driver_plan(args, env={}), FACTS)


def test_the_recipe_lands_in_the_part_that_reads_each_knob(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    assert (s.data.prompt_data, s.data.num_rollout, s.data.rollout_batch_size) == (
        "/data/dapo-math-17k/dapo-math-17k.jsonl", 3000, 32)
    assert (s.data.sampling.n_samples, s.data.sampling.max_new_tokens, s.data.sampling.temperature) == (8, 8192, 0.8)
    assert s.data.eval_sampling is not None
    assert (s.data.eval_sampling.n_samples, s.data.eval_sampling.max_new_tokens, s.data.eval_sampling.top_p) == (
        16, 16384, 0.7)
    assert s.data.eval_datasets == (("aime", "/data/aime-2024/aime-2024.jsonl"),)
    assert s.data.shuffle and s.data.apply_chat_template and s.data.rm_type == "deepscaler"
    assert s.model_path == s.fleet.model_path == "/models/Qwen3-4B" and s.fleet.gpus_per_engine == 1
    assert s.fleet.verify_weights is VerifyPolicy.FIRST and s.fleet.weight_sync_pause_mode is PauseMode.RETRACT
    assert (s.fleet.broadcast.backend, s.launch.backend, s.launch.log_dir) == ("nccl", "sglang", "/runs/r1/engines")
    assert s.launch.sglang_mem_fraction_static == 0.7
    assert s.scaling.max_engines == 8 and s.scaling.partial_success_policy == PartialSuccessPolicy.ROLLBACK_ALL
    assert s.dispatch.migrate


def test_each_flag_reaches_its_one_place(tmp_path: Path) -> None:
    s = settings_for(tmp_path, "--scale-in-unfinished", "retry", "--verify-weights", "every",
                     "--scale-in-drain-timeout", "12", "--scale-in-shutdown-timeout", "3",
                     "--weight-sync-pause-mode", "in_place", "--weight-broadcast-timeout", "90",
                     "--scale-out-timeout", "240", "--sglang-router-url", "http://127.0.0.1:30000")
    assert not s.dispatch.migrate
    assert s.fleet.verify_weights is VerifyPolicy.EVERY
    assert (s.fleet.drain_timeout_s, s.fleet.shutdown_timeout_s) == (12.0, 3.0)
    assert s.fleet.weight_sync_pause_mode is PauseMode.IN_PLACE and s.fleet.broadcast.timeout_s == 90.0
    assert s.scaling.scale_out_timeout_s == 240.0
    assert s.fleet.sglang_router_url == "http://127.0.0.1:30000"


def test_the_run_secrets_are_carried_but_never_shown(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    assert (s.fleet.engine_api_key, s.fleet.engine_generation_key, s.fleet.external_engine_api_key,
            s.fleet.sglang_router_api_key) == ("run-secret", "user-key", "ops-key", "router-key")
    shown = repr(s) + repr(FACTS)
    assert not any(secret in shown for secret in ("run-secret", "user-key", "ops-key", "router-key"))


def test_joining_engines_start_with_dummy_weights_where_that_is_verified(tmp_path: Path) -> None:
    """--joiner-weights auto: dummy on the built-in engine (tested end to end), the checkpoint on SGLang (its dummy
    start is not yet verified against the real engine); explicit choices win on either."""
    import dataclasses

    yaml = tmp_path / "autoscaler.yaml"
    yaml.write_text("enabled: true\nmin_engines: 4\nmax_engines: 8\n")

    def dummy(backend: str, *extra: str) -> bool:
        args = parse_args([*recipe_qwen3_4b_args(str(yaml)), *extra])
        facts = dataclasses.replace(FACTS, backend=backend)
        return rollout_settings(args, driver_plan(args, env={}), facts).fleet.dummy_joins

    assert (dummy("builtin"), dummy("sglang")) == (True, False)
    assert dummy("sglang", "--joiner-weights", "dummy") and not dummy("builtin", "--joiner-weights", "checkpoint")
