"""Resource plan: --resource parsing, placement bundles, node-group markers, batch geometry, --dry-run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest

from relax.autoscaler.config import load_autoscaler_config
from relax.config.flags import ConfigError, RewardType, TrainArgs, parse_args
from relax.config.plan import (
    CONTROL_PLANE_MARKER_AMOUNT,
    AffinityStatus,
    AutoscalerBounds,
    Bundle,
    Plan,
    build_plan,
    format_plan,
    parse_resource,
    validate_paths,
    validate_plan_against_cluster,
)

RESOURCE = '{"actor": [1, 4], "rollout": [1, 4]}'

# The model-architecture flags scripts/models/qwen3-4B.sh passes (Relax and slime alike).
QWEN3_4B_MODEL_ARGS = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]


def recipe_qwen3_4b_args(autoscaler_yaml: str, rm_type: str = "deepscaler") -> list[str]:
    """What examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh hands to the driver."""
    return [
        "--fully-async",
        "--resource", RESOURCE,
        "--rollout-num-gpus-per-engine", "1",
        "--autoscaler-config", autoscaler_yaml,
        *QWEN3_4B_MODEL_ARGS,
        # CKPT_ARGS
        "--hf-checkpoint", "/models/Qwen3-4B", "--ref-load", "/models/Qwen3-4B_torch_dist",
        "--load", "/exp/Qwen3-4B_relax/", "--save", "/exp/Qwen3-4B_relax/", "--save-interval", "20",
        # ROLLOUT_ARGS
        "--prompt-data", "/data/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", rm_type,
        "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "8192", "--rollout-temperature", "0.8",
        "--global-batch-size", "256", "--balance-data",
        # EVAL_ARGS
        "--eval-interval", "20", "--eval-prompt-data", "aime", "/data/aime-2024/aime-2024.jsonl",
        "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "0.7",
        # PERF_ARGS
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
        # GRPO_ARGS
        "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--use-tis",
        # OPTIMIZER_ARGS
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        # SGLANG_ARGS
        "--rollout-backend", "sglang", "--sglang-mem-fraction-static", "0.7",
        # MISC_ARGS
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32", "--attention-backend", "flash",
    ]


def driver_plan(args: TrainArgs, env: Mapping[str, str] | None = None) -> Plan:
    """The plan as the driver builds it (``relax.entrypoints.train.main``): the autoscaler YAML, when given, loaded
    whole, then ``build_plan``."""
    autoscaler = load_autoscaler_config(args.autoscaler_config) if args.autoscaler_config else None
    return build_plan(args, env, autoscaler=autoscaler)


def _write_yaml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def autoscaler_yaml(tmp_path: Path) -> str:
    return _write_yaml(tmp_path / "autoscaler.yaml", "enabled: true\nmin_engines: 4\nmax_engines: 8\n")


@pytest.fixture
def recipe_argv(autoscaler_yaml: str) -> list[str]:
    return recipe_qwen3_4b_args(autoscaler_yaml)


def _plan(argv: list[str], env: dict[str, str] | None = None, autoscaler=None):
    return build_plan(parse_args(argv), env=env or {}, autoscaler=autoscaler)


def _base(*extra: str) -> list[str]:
    return ["--resource", RESOURCE, "--num-rollout", "10", *extra]


STABLE_BUNDLE = {"GPU": 1.0, "CPU": 1.0, "stable_gpu": 1.0, "stable_cpu": 1.0}


# --------------------------------------------------------------------------------------------------
# The seed recipe


def test_recipe_parses(recipe_argv):
    args = parse_args(recipe_argv)
    assert args.fully_async and args.rm_type is RewardType.DEEPSCALER
    assert args.eval_prompt_data == (("aime", "/data/aime-2024/aime-2024.jsonl"),)
    assert args.gradient_checkpointing and args.use_dynamic_batch_size and args.balance_data
    assert args.sglang_mem_fraction_static == 0.7 and args.save_interval == 20
    assert "--tensor-model-parallel-size" in args.ignored_flags and "--qk-layernorm" in args.ignored_flags
    assert parse_args(recipe_qwen3_4b_args("a.yaml", rm_type="dapo")).rm_type is RewardType.DAPO


def test_recipe_plan_has_four_trainer_gpus_and_four_pinned_one_gpu_engines(recipe_argv):
    plan = driver_plan(parse_args(recipe_argv), env={})
    assert (plan.trainer_gpus, plan.initial_engines, plan.gpus_per_engine) == (4, 4, 1)
    assert plan.affinity is AffinityStatus.ON and plan.node_group == "stable"
    assert [b.to_ray() for b in plan.trainer_bundles] == [STABLE_BUNDLE] * 4
    assert [[b.to_ray() for b in engine] for engine in plan.initial_engine_bundles] == [[STABLE_BUNDLE]] * 4
    assert [b.to_ray() for b in plan.elastic_engine_bundles] == [{"GPU": 1.0, "CPU": 1.0}]
    assert plan.control_plane_options() == {"stable_cpu": CONTROL_PLANE_MARKER_AMOUNT}
    assert plan.autoscaler == AutoscalerBounds(enabled=True, min_engines=4, max_engines=8)
    assert (plan.engine_floor, plan.max_engines, plan.headroom_engines) == (4, 8, 4)
    assert (plan.baseline_gpus, plan.embedded_cluster_gpus) == (8, 12)
    assert plan.batch.samples_per_rollout == 256 and plan.batch.optimizer_steps_per_rollout == 1
    assert (plan.max_staleness, plan.max_waiting_partitions, plan.num_rollout) == (1, 2, 3000)
    assert plan.notes == ()


def test_recipe_dry_run_text(recipe_argv):
    text = format_plan(driver_plan(parse_args(recipe_argv), env={}))
    assert "trainer (actor)  4 GPUs; bundles 4 × {GPU: 1, CPU: 1, stable_gpu: 1, stable_cpu: 1}" in text
    assert "4 initial engines × 1 GPU = 4 GPUs" in text
    assert "autoscaler enabled min 4 / max 8" in text
    assert "cluster must declare stable_gpu, stable_cpu" in text
    assert "32 prompts × 8 samples = 256 samples per rollout step" in text
    assert "max 1 version(s)" in text and "3000 rollout steps" in text


def test_recipe_node_group_comes_from_the_env_parameter(recipe_argv, monkeypatch):
    monkeypatch.setenv("RELAX_INITIAL_NODE_GROUP", "ignored_because_env_is_a_parameter")
    plan = driver_plan(parse_args(recipe_argv), env={"RELAX_INITIAL_NODE_GROUP": "baseline"})
    assert plan.marker_resources == ("baseline_gpu", "baseline_cpu")
    assert plan.trainer_bundles[0].to_ray()["baseline_gpu"] == 1.0
    assert plan.control_plane_options() == {"baseline_cpu": CONTROL_PLANE_MARKER_AMOUNT}
    assert driver_plan(parse_args(recipe_argv), env={}).node_group == "stable"


def test_bad_node_group_name(recipe_argv):
    with pytest.raises(ConfigError, match="RELAX_INITIAL_NODE_GROUP='a b' is not a valid node-group name"):
        driver_plan(parse_args(recipe_argv), env={"RELAX_INITIAL_NODE_GROUP": "a b"})


@pytest.mark.parametrize(
    ("extra", "env", "status"),
    [
        (["--no-enable-affinity"], {}, AffinityStatus.OFF_BY_FLAG),
        ([], {"ENABLE_AFFINITY": "0"}, AffinityStatus.OFF_BY_ENV),
        ([], {"ENABLE_AFFINITY": "1"}, AffinityStatus.ON),
    ],
)
def test_affinity_switches(recipe_argv, extra, env, status):
    plan = driver_plan(parse_args(recipe_argv + extra), env=env)
    assert plan.affinity is status
    if status is not AffinityStatus.ON:
        assert plan.marker_resources == () and plan.control_plane_options() == {}
        assert plan.trainer_bundles[0].to_ray() == {"GPU": 1.0, "CPU": 1.0}


def test_no_markers_without_an_autoscaler():
    plan = _plan(_base())
    assert plan.affinity is AffinityStatus.NOT_NEEDED and plan.autoscaler is None
    assert plan.trainer_bundles[0].to_ray() == {"GPU": 1.0, "CPU": 1.0}
    assert (plan.max_engines, plan.headroom_engines, plan.embedded_cluster_gpus) == (None, 4, 12)
    assert "no autoscaler" in format_plan(plan)


def test_disabled_autoscaler_keeps_bounds_but_no_markers(tmp_path):
    path = _write_yaml(tmp_path / "a.yaml", "enabled: false\nmin_engines: 4\nmax_engines: 6\n")
    plan = driver_plan(parse_args(_base("--autoscaler-config", path)))
    assert plan.affinity is AffinityStatus.NOT_NEEDED and plan.headroom_engines == 2
    assert any("enabled: false" in note for note in plan.notes)


def test_build_plan_needs_the_loaded_autoscaler_config():
    with pytest.raises(ValueError, match="autoscaler="):
        build_plan(parse_args(_base("--autoscaler-config", "x.yaml")))


def test_plan_is_frozen():
    plan = _plan(_base())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.trainer_gpus = 3  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# --resource


def test_resource_not_json_quotes_the_string():
    with pytest.raises(ConfigError) as info:
        parse_resource("{actor: [1, 4]}")
    message = str(info.value)
    assert message.startswith("--resource is not valid JSON: '{actor: [1, 4]}'")
    assert '{"actor": [1, 4], "rollout": [1, 4]}' in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[1, 4]", "must be a JSON object"),
        ('{"actor": [1, 4]}', "has no 'rollout' role"),
        ('{"rollout": [1, 4]}', "has no 'actor' role"),
        ('{"actor": [2, 4], "rollout": [1, 4]}', "role 'actor' has 2 replicas; replicas must be 1"),
        ('{"actor": [1, 4], "rollout": [0, 4]}', "role 'rollout' has 0 replicas"),
        ('{"actor": [1, 0], "rollout": [1, 4]}', "role 'actor' needs a positive GPU count, got 0"),
        ('{"actor": [1, 4], "rollout": [1, -2]}', "negative GPU count"),
        ('{"actor": [1, "4"], "rollout": [1, 4]}', "must be [replicas, gpus] with two integers"),
        ('{"actor": [1, 2.5], "rollout": [1, 4]}', "must be [replicas, gpus] with two integers"),
        ('{"actor": [1, true], "rollout": [1, 4]}', "must be [replicas, gpus] with two integers"),
        ('{"actor": 4, "rollout": [1, 4]}', "must be [replicas, gpus]"),
        ('{"actor": [1, 4], "rollout": [1, 4], "critic": [1, 2]}', "'critic' is not a Relax role"),
    ],
)
def test_resource_errors(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_resource(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_resource_role_without_gpus_is_a_note():
    spec = parse_resource('{"actor": [1, 4], "rollout": [1, 2], "advantages": [1, 0]}')
    assert (spec.actor_gpus, spec.rollout_gpus, spec.ignored_roles) == (4, 2, ("advantages",))
    plan = _plan(["--resource", '{"actor": [1, 4], "rollout": [1, 4], "advantages": [1, 0]}',
                  "--num-rollout", "1"])
    assert plan.notes == ("--resource role 'advantages' has no GPUs and is ignored",)


def test_rollout_gpus_must_divide_into_engines():
    plan = _plan(_base("--rollout-num-gpus-per-engine", "2"))
    assert (plan.initial_engines, plan.gpus_per_engine) == (2, 2)
    # one 2-GPU bundle per engine (one node; the server sees both GPUs), markers scaled with the GPUs
    assert [[b.to_ray() for b in engine] for engine in plan.initial_engine_bundles] == [[{"GPU": 2.0, "CPU": 1.0}]] * 2
    assert [b.to_ray() for b in plan.elastic_engine_bundles] == [{"GPU": 2.0, "CPU": 1.0}]
    assert plan.baseline_gpus == 8 and sum(b.gpu for b in plan.baseline_bundles) == 8
    assert "one bundle per engine {GPU: 2, CPU: 1} (its server sees 2 GPUs)" in format_plan(plan)
    with pytest.raises(ConfigError, match="rollout GPUs \\(4\\) are not divisible by --rollout-num-gpus-per-engine 3"):
        _plan(_base("--rollout-num-gpus-per-engine", "3"))


def test_slime_style_gpu_flags():
    plan = _plan(["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
                  "--num-rollout", "1"])
    assert (plan.trainer_gpus, plan.rollout_gpus) == (8, 4)
    assert _plan(_base("--rollout-num-gpus", "4", "--actor-num-gpus-per-node", "4")).trainer_gpus == 4
    with pytest.raises(ConfigError, match="--rollout-num-gpus 2 disagrees with --resource rollout"):
        _plan(_base("--rollout-num-gpus", "2"))
    with pytest.raises(ConfigError, match="disagrees with --resource actor"):
        _plan(_base("--actor-num-gpus-per-node", "8"))


def test_missing_resources_and_num_rollout():
    with pytest.raises(ConfigError, match="no GPU counts given: pass --resource"):
        _plan(["--num-rollout", "1"])
    with pytest.raises(ConfigError, match="--num-rollout is required"):
        _plan(["--resource", RESOURCE])


# --------------------------------------------------------------------------------------------------
# Batch geometry and staleness


def test_batch_geometry_defaults_to_one_step_per_rollout():
    plan = _plan(_base("--rollout-batch-size", "4", "--n-samples-per-prompt", "2"))
    assert (plan.batch.samples_per_rollout, plan.batch.global_batch_size) == (8, 8)
    assert plan.batch.optimizer_steps_per_rollout == 1


def test_batch_geometry_several_steps():
    plan = _plan(_base("--global-batch-size", "64", "--max-staleness", "0"))
    assert plan.batch.optimizer_steps_per_rollout == 4 and plan.total_optimizer_steps == 40
    assert (plan.max_staleness, plan.max_waiting_partitions) == (0, 1)


def test_non_dividing_batch_geometry_explains_the_fix():
    with pytest.raises(ConfigError) as info:
        _plan(_base("--global-batch-size", "100"))
    message = str(info.value)
    assert "--global-batch-size 100 does not divide the 256 samples of a rollout step" in message
    assert "--rollout-batch-size 32 × --n-samples-per-prompt 8" in message
    assert "e.g. 64" in message
    with pytest.raises(ConfigError, match="e.g. 256"):
        _plan(_base("--global-batch-size", "512"))


def test_uneven_split_over_trainer_gpus_is_a_note():
    plan = _plan(["--resource", '{"actor": [1, 3], "rollout": [1, 1]}', "--num-rollout", "1"])
    assert any("does not split evenly over 3 trainer GPUs" in note for note in plan.notes)


# --------------------------------------------------------------------------------------------------
# Autoscaler bounds


@pytest.mark.parametrize(
    ("low", "high", "fragment"),
    [
        (0, 8, "min_engines must be at least 1"),
        (4, 3, "max_engines (3) is below min_engines (4)"),
        (6, 8, "min_engines (6) is above the 4 initial engines"),
        (2, 3, "max_engines (3) is below the 4 initial engines"),
    ],
)
def test_engine_bounds_are_checked(low, high, fragment):
    with pytest.raises(ConfigError) as info:
        _plan(_base(), autoscaler=AutoscalerBounds(True, low, high))
    assert fragment in str(info.value)


def test_min_below_initial_says_the_floor_is_the_initial_count():
    plan = _plan(_base(), autoscaler=AutoscalerBounds(True, 2, 8))
    assert plan.engine_floor == 4
    assert any("effective floor is 4" in note for note in plan.notes)
    assert "note: autoscaler min_engines (2)" in format_plan(plan)


def test_any_object_with_the_bounds_protocol_works():
    class Config:  # stands in for the full pydantic model
        enabled = True
        min_engines = 4
        max_engines = 6
        scale_out_cooldown_secs = 60

    plan = _plan(_base(), autoscaler=Config())
    assert plan.autoscaler == AutoscalerBounds(True, 4, 6) and plan.headroom_gpus == 2


def test_the_plan_takes_the_bounds_of_the_loaded_autoscaler_config(tmp_path):
    path = _write_yaml(tmp_path / "a.yaml", "enabled: true\nmin_engines: 4\nmax_engines: 8\nmetrics_interval_secs: 5\n")
    assert driver_plan(parse_args(_base("--autoscaler-config", path))).autoscaler == AutoscalerBounds(True, 4, 8)
    defaults = _write_yaml(tmp_path / "d.yaml", "enabled: true\n")
    assert driver_plan(parse_args(_base("--autoscaler-config", defaults))).autoscaler == AutoscalerBounds(True, 1, 8)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("enabled: [\n", "not valid YAML at line"),
        ("", "the file is empty"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("enabled: maybe\n", "enabled must be true or false"),
        ("enabled: true\nmin_engines: four\n", "min_engines must be an integer"),
        ("enabled: true\nmax_engines: 8.5\n", "max_engines must be an integer"),
    ],
)
def test_a_bad_autoscaler_config_stops_the_plan_naming_the_flag(tmp_path, text, fragment):
    path = _write_yaml(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as info:  # what the driver prints before it exits
        driver_plan(parse_args(_base("--autoscaler-config", path)))
    assert str(info.value).startswith(f"--autoscaler-config {path}: ")
    assert fragment in str(info.value)


def test_missing_autoscaler_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        driver_plan(parse_args(_base("--autoscaler-config", str(tmp_path / "nope.yaml"))))


# --------------------------------------------------------------------------------------------------
# Against the cluster and the file system


def test_cluster_that_fits(recipe_argv):
    plan = driver_plan(parse_args(recipe_argv), env={})
    resources = {"GPU": 8.0, "CPU": 64.0, "stable_gpu": 8.0, "stable_cpu": 64.0}
    assert validate_plan_against_cluster(plan, resources) == []


def test_missing_markers_name_them_and_the_switch(recipe_argv):
    plan = driver_plan(parse_args(recipe_argv), env={})
    problems = validate_plan_against_cluster(plan, {"GPU": 8.0, "CPU": 64.0})
    assert len(problems) == 1
    assert "stable_gpu, stable_cpu" in problems[0]
    assert "--no-enable-affinity" in problems[0] and "ENABLE_AFFINITY=0" in problems[0]


def test_only_the_missing_marker_is_named(recipe_argv):
    plan = driver_plan(parse_args(recipe_argv), env={"RELAX_INITIAL_NODE_GROUP": "baseline"})
    problems = validate_plan_against_cluster(plan, {"GPU": 8.0, "CPU": 64.0, "baseline_gpu": 8.0})
    assert len(problems) == 1
    assert "marker resources baseline_cpu (" in problems[0]


def test_too_few_gpus_cpus_and_marker_amounts(recipe_argv):
    plan = driver_plan(parse_args(recipe_argv), env={})
    problems = validate_plan_against_cluster(plan, {"GPU": 4.0, "CPU": 2.0, "stable_gpu": 4.0, "stable_cpu": 8.0})
    assert any("has 4 GPUs but the baseline needs 8 (4 trainer + 4 rollout)" in p for p in problems)
    assert any("has 2 CPUs but the baseline bundles need 8" in p for p in problems)
    assert any("stable_gpu: 4 but the pinned baseline needs 8" in p for p in problems)
    assert any("stable_cpu: 8 but the pinned baseline needs 8.01" in p for p in problems)


def test_no_marker_checks_when_affinity_is_off():
    plan = _plan(_base())
    assert validate_plan_against_cluster(plan, {"GPU": 8.0, "CPU": 8.0}) == []


def test_validate_paths_uses_the_injected_check():
    args = parse_args(_base("--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl",
                            "--eval-prompt-data", "aime", "/a.jsonl", "--load", "/not/yet"))
    problems = validate_paths(args, exists=lambda path: path == "/m")
    assert problems == [
        "--prompt-data: no such file or directory: /d.jsonl",
        "--eval-prompt-data aime: no such file or directory: /a.jsonl",
    ]


def test_bundle_to_ray():
    assert Bundle(markers=(("g_gpu", 1.0),)).to_ray() == {"GPU": 1.0, "CPU": 1.0, "g_gpu": 1.0}


def test_the_plan_names_the_backend_and_the_interpreter(recipe_argv):
    text = format_plan(driver_plan(parse_args(recipe_argv), env={"RELAX_SGLANG_PYTHON": "/opt/sglang/bin/python"}))
    assert "rollout engines  4 x sglang (python /opt/sglang/bin/python), 1 GPU each" in text
    assert "on a node without CUDA, SGLang's CPU platform (bf16" in text  # what Relax chooses there, said up front
    argv = [*recipe_argv, "--sglang-python", "/venvs/sg/bin/python"]  # the flag wins over the environment
    text = format_plan(driver_plan(parse_args(argv), env={"RELAX_SGLANG_PYTHON": "/opt/sglang/bin/python"}))
    assert "4 x sglang (python /venvs/sg/bin/python)" in text


def test_auto_and_builtin_in_the_plan():
    import sys

    base = ["--num-rollout", "1", "--resource", '{"actor": [1, 1], "rollout": [1, 2]}']
    auto = format_plan(driver_plan(parse_args(base), env={}))
    assert (f"2 x auto: sglang (python {sys.executable}, the engine's own interpreter) if the engine's GPUs are "
            "CUDA devices, else builtin") in auto
    builtin = format_plan(driver_plan(parse_args([*base, "--rollout-backend", "builtin"]), env={}))
    assert f"2 x builtin (python {sys.executable}, the engine's own interpreter), 1 GPU each" in builtin


def test_the_plan_names_the_control_plane_url():
    base = ["--num-rollout", "1", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}']
    local = format_plan(driver_plan(parse_args(base), env={}))
    assert "control plane    http://127.0.0.1:8000 (this node only; from elsewhere: ssh -L 8000:127.0.0.1:8000" in local
    wide = format_plan(driver_plan(parse_args([*base, "--api-host", "0.0.0.0", "--api-port", "8100"]), env={}))
    assert "http://0.0.0.0:8100 (reachable from other machines; RELAX_API_TOKEN required)" in wide
