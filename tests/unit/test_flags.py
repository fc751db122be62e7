"""Flags of python -m relax.entrypoints.train: the documented flags (docs/training.md), Megatron, errors."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from relax.config.flags import (
    ConfigError,
    KLLossType,
    LRDecayStyle,
    PartialSuccessPolicy,
    RewardType,
    TrainArgs,
    build_parser,
    ignored_flags_warning,
    parse_args,
    parse_args_or_exit,
)
from relax.config.megatron import COMPAT_FLAGS, IGNORED_WARNING_PREFIX, Arity


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_are_the_documented_ones():
    args = parse_args([])
    assert args.scale_out_timeout == 300.0
    assert args.scale_out_partial_success_policy is PartialSuccessPolicy.ROLLBACK_ALL
    assert args.scale_in_drain_timeout == 30.0
    assert args.scale_in_shutdown_timeout == 30.0
    assert (args.api_host, args.api_port) == ("127.0.0.1", 8000)
    assert args.max_staleness == 1
    assert args.enable_affinity is True
    assert args.rollout_num_gpus_per_engine == 1
    assert (args.eps_clip, args.eps_clip_high, args.clip_grad) == (0.2, 0.28, 1.0)
    assert args.advantage_estimator == "grpo"
    assert args.tis_clip == 2.0
    assert args.ignored_flags == () and args.sglang_passthrough == ()
    assert args.resolved_tensorboard_dir == "outputs/tensorboard"


# Every documented flag: (argv, field, expected value).
DESIGN_FLAGS = [
    (["--fully-async"], "fully_async", True),
    (["--resource", '{"actor": [1, 4], "rollout": [1, 4]}'], "resource", '{"actor": [1, 4], "rollout": [1, 4]}'),
    (["--rollout-num-gpus-per-engine", "2"], "rollout_num_gpus_per_engine", 2),
    (["--autoscaler-config", "a.yaml"], "autoscaler_config", "a.yaml"),
    (["--enable-affinity"], "enable_affinity", True),
    (["--no-enable-affinity"], "enable_affinity", False),
    (["--scale-out-timeout", "600"], "scale_out_timeout", 600.0),
    (["--scale-out-partial-success-policy", "keep_partial"], "scale_out_partial_success_policy",
     PartialSuccessPolicy.KEEP_PARTIAL),
    (["--scale-in-drain-timeout", "60"], "scale_in_drain_timeout", 60.0),
    (["--scale-in-shutdown-timeout", "20"], "scale_in_shutdown_timeout", 20.0),
    (["--hf-checkpoint", "/m/Qwen3-4B"], "hf_checkpoint", "/m/Qwen3-4B"),
    (["--prompt-data", "/d/train.jsonl"], "prompt_data", "/d/train.jsonl"),
    (["--input-key", "question"], "input_key", "question"),
    (["--label-key", "answer"], "label_key", "answer"),
    (["--apply-chat-template"], "apply_chat_template", True),
    (["--rollout-shuffle"], "rollout_shuffle", True),
    (["--rm-type", "dapo"], "rm_type", RewardType.DAPO),
    (["--rm-type", "math"], "rm_type", RewardType.MATH),
    (["--rm-type", "deepscaler"], "rm_type", RewardType.DEEPSCALER),
    (["--rm-type", "tiny"], "rm_type", RewardType.TINY),
    (["--custom-rm-path", "my_pkg.rewards:score"], "custom_rm_path", "my_pkg.rewards:score"),
    (["--reward-key", "score"], "reward_key", "score"),
    (["--eval-prompt-data", "aime", "/d/aime.jsonl"], "eval_prompt_data", (("aime", "/d/aime.jsonl"),)),
    (["--eval-prompt-data", "aime", "a", "--eval-interval", "20"], "eval_interval", 20),
    (["--n-samples-per-eval-prompt", "16"], "n_samples_per_eval_prompt", 16),
    (["--eval-max-response-len", "16384"], "eval_max_response_len", 16384),
    (["--eval-top-p", "0.7"], "eval_top_p", 0.7),
    (["--skip-eval-before-train"], "skip_eval_before_train", True),
    (["--num-rollout", "3000"], "num_rollout", 3000),
    (["--rollout-batch-size", "16"], "rollout_batch_size", 16),
    (["--n-samples-per-prompt", "4"], "n_samples_per_prompt", 4),
    (["--rollout-max-response-len", "8192"], "rollout_max_response_len", 8192),
    (["--rollout-max-prompt-len", "2048"], "rollout_max_prompt_len", 2048),
    (["--rollout-temperature", "0.8"], "rollout_temperature", 0.8),
    (["--max-staleness", "0"], "max_staleness", 0),
    (["--sglang-mem-fraction-static", "0.7"], "sglang_mem_fraction_static", 0.7),
    (["--global-batch-size", "256"], "global_batch_size", 256),
    (["--lr", "1e-6"], "lr", 1e-6),
    (["--weight-decay", "0.1"], "weight_decay", 0.1),
    (["--adam-beta1", "0.9"], "adam_beta1", 0.9),
    (["--adam-beta2", "0.98"], "adam_beta2", 0.98),
    (["--advantage-estimator", "grpo"], "advantage_estimator", "grpo"),
    (["--eps-clip", "0.1"], "eps_clip", 0.1),
    (["--eps-clip-high", "0.3"], "eps_clip_high", 0.3),
    (["--use-tis"], "use_tis", True),
    (["--kl-loss-coef", "0.01"], "kl_loss_coef", 0.01),
    (["--entropy-coef", "0.001"], "entropy_coef", 0.001),
    (["--calculate-per-token-loss"], "calculate_per_token_loss", True),
    (["--save", "/ckpt"], "save", "/ckpt"),
    (["--save", "/ckpt", "--save-interval", "20"], "save_interval", 20),
    (["--load", "/ckpt"], "load", "/ckpt"),
    (["--api-host", "0.0.0.0"], "api_host", "0.0.0.0"),
    (["--api-port", "9000"], "api_port", 9000),
    # Not in section 9's list but named by the brief / slime scripts.
    (["--dry-run"], "dry_run", True),
    (["--clip-grad", "0.5"], "clip_grad", 0.5),
    (["--seed", "42"], "seed", 42),
    (["--max-tokens-per-gpu", "9216"], "max_tokens_per_gpu", 9216),
    (["--optimizer", "adam"], "optimizer", "adam"),
    (["--lr-decay-style", "cosine"], "lr_decay_style", LRDecayStyle.COSINE),
    (["--use-kl-loss"], "use_kl_loss", True),
    (["--kl-loss-type", "k3"], "kl_loss_type", KLLossType.K3),
    (["--rollout-num-gpus", "4"], "rollout_num_gpus", 4),
    (["--actor-num-nodes", "1"], "actor_num_nodes", 1),
    (["--actor-num-gpus-per-node", "4"], "actor_num_gpus_per_node", 4),
    (["--tensorboard-dir", "/tb"], "tensorboard_dir", "/tb"),
    (["--rollout-top-k", "-1"], "rollout_top_k", -1),
]


@pytest.mark.parametrize(("argv", "field", "expected"), DESIGN_FLAGS, ids=lambda v: str(v))
def test_every_design_flag_parses(argv, field, expected):
    assert getattr(parse_args(argv), field) == expected


def test_parser_destinations_are_trainargs_fields():
    parser = build_parser()
    dests = {action.dest for action in parser._actions if not isinstance(action, argparse._HelpAction)}
    plain = {d for d in dests if not d.startswith("compat_")} - {"colocate"}
    train_args_fields = {f.name for f in dataclasses.fields(TrainArgs)}
    assert plain <= train_args_fields
    mapped_targets = {flag.target for flag in COMPAT_FLAGS if flag.target}
    assert mapped_targets <= train_args_fields


def test_train_args_is_frozen():
    args = parse_args([])
    with pytest.raises(AttributeError):
        args.lr = 1.0  # type: ignore[misc]
    assert isinstance(args, TrainArgs)


def test_eval_prompt_data_takes_several_pairs_and_repeats():
    args = parse_args(["--eval-prompt-data", "aime", "a.jsonl", "math", "m.jsonl",
                       "--eval-prompt-data", "gsm", "g.jsonl"])
    assert args.eval_prompt_data == (("aime", "a.jsonl"), ("math", "m.jsonl"), ("gsm", "g.jsonl"))


def test_eval_prompt_data_needs_pairs_and_unique_names():
    assert "NAME PATH pairs" in _error(["--eval-prompt-data", "aime"])
    assert "repeated: aime" in _error(["--eval-prompt-data", "aime", "a", "aime", "b"])


def test_unknown_flag_names_it_and_suggests_the_closest():
    message = _error(["--rollout-batchsize", "32"])
    assert message.startswith("unknown flag --rollout-batchsize")
    assert "did you mean --rollout-batch-size?" in message


def test_unknown_flag_with_underscores_suggests_dashes():
    assert "did you mean --n-samples-per-prompt?" in _error(["--n_samples_per_prompt", "8"])


def test_unknown_flag_without_a_close_match():
    message = _error(["--qqqzzz"])
    assert "unknown flag --qqqzzz" in message and "did you mean" not in message
    assert "--help" in message


def test_stray_value_is_explained():
    assert "unexpected argument 'oops'" in _error(["oops"])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--rollout-batch-size", "-3"], "--rollout-batch-size: must be a positive integer, got '-3'"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt: must be a positive integer"),
        (["--global-batch-size", "x"], "--global-batch-size: must be a positive integer, got 'x'"),
        (["--rollout-num-gpus-per-engine", "0"], "--rollout-num-gpus-per-engine: must be a positive integer"),
        (["--max-staleness", "-1"], "--max-staleness: must be an integer >= 0"),
        (["--scale-out-timeout", "0"], "--scale-out-timeout: must be a number > 0"),
        (["--scale-in-drain-timeout", "nan"], "--scale-in-drain-timeout: must be a number > 0"),
        (["--scale-out-partial-success-policy", "all"], "choose from rollback_all, keep_partial"),
        (["--rm-type", "gpt"], "--rm-type: invalid choice 'gpt'; choose from dapo, math, deepscaler, tiny"),
        (["--kl-loss-type", "k9"], "--kl-loss-type: invalid choice 'k9'"),
        (["--sglang-mem-fraction-static", "1.5"], "--sglang-mem-fraction-static: must be a number in (0, 1]"),
        (["--adam-beta2", "1"], "--adam-beta2: must be a number in [0, 1)"),
        (["--api-port", "70000"], "--api-port: must be a port number"),
        (["--rollout-top-k", "0"], "--rollout-top-k: must be -1 (off) or a positive integer"),
        (["--lr"], "--lr needs a value"),
        (["--fully-async=yes"], "--fully-async takes no value"),
        (["--train-backend", "jax"], "--train-backend: invalid choice"),
        (["--recompute-granularity", "half"], "--recompute-granularity: invalid choice"),
        (["--micro-batch-size", "-2"], "--micro-batch-size: must be a positive integer"),
    ],
)
def test_invalid_values_name_the_flag(argv, fragment):
    assert fragment in _error(argv)


def test_colocate_is_rejected_with_the_alternative():
    assert _error(["--colocate"]).startswith("--colocate is not supported yet; use --fully-async")


def test_only_grpo_and_adam():
    assert "grpo only" in _error(["--advantage-estimator", "ppo"])
    assert "--optimizer sgd is not supported" in _error(["--optimizer", "sgd"])


def test_custom_reward_path():
    assert parse_args(["--custom-rm-path", "pkg.mod.fn"]).custom_rm_path == "pkg.mod.fn"
    assert "not a module:function path" in _error(["--custom-rm-path", "not a path"])
    assert "not a module:function path" in _error(["--custom-rm-path", "justmodule"])
    both = parse_args(["--rm-type", "dapo", "--custom-rm-path", "m:f"])  # custom wins, as in slime
    assert (both.rm_type, both.custom_rm_path) == (RewardType.DAPO, "m:f")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--save-interval", "20"], "--save-interval needs --save DIR"),
        (["--eval-interval", "5"], "--eval-interval needs --eval-prompt-data"),
        (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
        (["--lr", "1e-6", "--min-lr", "1e-5"], "--min-lr 1e-05 is above --lr 1e-06"),
    ],
)
def test_inconsistent_flags(argv, fragment):
    assert fragment in _error(argv)


def test_megatron_flags_are_mapped_or_listed_once_as_ignored():
    args = parse_args([
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-layers", "36",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", "--balance-data", "--micro-batch-size", "2",
        "--norm-epsilon", "1e-6", "--use-clearml", "--tb-project-name", "p",
    ])
    assert args.gradient_checkpointing and args.use_dynamic_batch_size and args.balance_data
    assert args.micro_batch_size == 2
    assert args.ignored_flags == (
        "--tensor-model-parallel-size", "--sequence-parallel", "--recompute-method", "--num-layers",
        "--norm-epsilon", "--use-clearml", "--tb-project-name",
    )
    warning = ignored_flags_warning(args)
    assert warning is not None and "\n" not in warning
    assert warning.startswith(IGNORED_WARNING_PREFIX)
    assert warning.count("--tensor-model-parallel-size") == 1
    assert "--max-tokens-per-gpu" not in warning and "--recompute-granularity" not in warning


def test_no_warning_without_ignored_flags():
    assert ignored_flags_warning(parse_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "10"])) is None


def test_every_compat_flag_is_accepted():
    for flag in COMPAT_FLAGS:
        argv = [flag.option]
        if flag.arity is not Arity.SWITCH:
            argv.append(flag.choices[0] if flag.choices else "1")
        if flag.target == "use_dynamic_batch_size":
            argv += ["--max-tokens-per-gpu", "4096"]
        args = parse_args(argv)
        assert args.ignored_flags in ((), (flag.option,)), flag.option


def test_sglang_passthrough_flags_reach_sglang_unchanged():
    args = parse_args([
        "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4",
        "--sglang-enable-metrics", "--sglang-log-level=warning", "--rollout-top-k", "-1",
        "--sglang-chunked-prefill-size", "-1", "--num-rollout", "5",
    ])
    assert args.sglang_mem_fraction_static == 0.7
    assert args.sglang_extra_args == (
        "--cuda-graph-bs", "1", "2", "4", "--enable-metrics", "--log-level", "warning",
        "--chunked-prefill-size", "-1",
    )
    assert args.num_rollout == 5 and args.rollout_top_k == -1


def test_kl_flags_reach_the_trainer():
    """--use-kl-loss loads the reference and logs the KL; it enters the loss only with --kl-loss-coef > 0."""
    from relax.training.actor import TrainerConfig

    def config(*argv: str) -> TrainerConfig:
        return TrainerConfig.from_args(parse_args(["--hf-checkpoint", "/m", *argv]))

    logged = config("--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "k2")
    assert logged.needs_reference and logged.loss_config().log_kl and logged.loss_config().kl_coef == 0.0
    assert logged.loss_config().kl_type == "k2"
    assert config("--kl-loss-coef", "0.1").needs_reference and not config().needs_reference


def test_parse_args_or_exit_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(["--rollout-batchsize", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "error: unknown flag --rollout-batchsize" in err and "Traceback" not in err


def test_parse_args_or_exit_logs_the_ignored_line_once(caplog):
    with caplog.at_level(logging.WARNING, logger="relax.config.flags"):
        parse_args_or_exit(["--sequence-parallel", "--swiglu"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(IGNORED_WARNING_PREFIX)]
    assert lines == [IGNORED_WARNING_PREFIX + "--sequence-parallel, --swiglu"]


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--scale-out-partial-success-policy" in out and "--no-enable-affinity" in out


def test_weight_sync_pause_mode_defaults_to_retract_and_names_bad_values() -> None:
    from relax.weights.pause_mode import PauseMode

    assert parse_args([]).weight_sync_pause_mode is PauseMode.RETRACT
    assert parse_args(["--weight-sync-pause-mode", "in_place"]).weight_sync_pause_mode is PauseMode.IN_PLACE
    assert parse_args(["--weight-sync-pause-mode", "none"]).weight_sync_pause_mode is PauseMode.NONE
    message = _error(["--weight-sync-pause-mode", "later"])
    assert "--weight-sync-pause-mode" in message and "retract, in_place, abort, none" in message


def test_weight_sync_defaults_to_broadcast_and_names_bad_values() -> None:
    from relax.config.flags import WeightSyncPath

    args = parse_args([])
    assert args.weight_sync is WeightSyncPath.BROADCAST and args.weight_broadcast_timeout == 60.0
    assert parse_args(["--weight-sync", "object-store"]).weight_sync is WeightSyncPath.OBJECT_STORE
    assert parse_args(["--weight-broadcast-timeout", "5"]).weight_broadcast_timeout == 5.0
    message = _error(["--weight-sync", "nccl"])
    assert "--weight-sync" in message and "broadcast, object-store" in message
    assert "--weight-broadcast-timeout" in _error(["--weight-broadcast-timeout", "0"])


def test_sglang_python_flag_wins_over_the_environment() -> None:
    args = parse_args(["--num-rollout", "1", "--sglang-python", "/opt/a/bin/python"])
    assert args.sglang_python == "/opt/a/bin/python" and args.sglang_passthrough == ()  # a flag, not a passthrough
    assert args.sglang_interpreter({"RELAX_SGLANG_PYTHON": "/opt/b/bin/python"}) == "/opt/a/bin/python"
    plain = parse_args(["--num-rollout", "1"])
    assert plain.sglang_interpreter({"RELAX_SGLANG_PYTHON": "/opt/b/bin/python"}) == "/opt/b/bin/python"
    assert plain.sglang_interpreter({"RELAX_SGLANG_PYTHON": " "}) is None
    assert plain.sglang_interpreter({}) is None


def test_verify_weights_defaults_to_first_and_names_bad_values() -> None:
    from relax.config.verify_weights import VerifyPolicy

    assert parse_args([]).verify_weights is VerifyPolicy.FIRST
    assert parse_args(["--verify-weights", "every"]).verify_weights is VerifyPolicy.EVERY
    assert parse_args(["--verify-weights", "off"]).verify_weights is VerifyPolicy.OFF
    message = _error(["--verify-weights", "always"])
    assert "--verify-weights" in message and "every, first, off" in message
