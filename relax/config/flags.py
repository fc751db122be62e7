"""Command-line flags of ``python -m relax.entrypoints.train`` (docs/training.md, "Flags").

Flag names follow Relax/slime so the recipe's run script parses unchanged. Parsing is pure: no Ray,
no file access; cross-flag resource checks live in ``relax.config.plan``. Every user-input error is a
``ConfigError`` whose one-line message names the flag and says how to fix it, so the driver can print
it and exit 2 instead of showing a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, NoReturn
from urllib.parse import urlsplit

from relax import argtypes
from relax.config.megatron import COMPAT_FLAGS, Arity, ignored_options, ignored_warning, mapped_settings
from relax.config.verify_weights import VerifyPolicy
from relax.logs import LOG_LEVELS
from relax.weights.pause_mode import PauseMode

PROG = "python -m relax.entrypoints.train"
#: ``--joiner-weights``: what a joining engine loads before its first refit (rollout.fleet).
JOINER_WEIGHTS = ("auto", "dummy", "checkpoint")
SGLANG_PASSTHROUGH_PREFIX = "--sglang-"
#: The SGLang interpreter when --sglang-python is not given (the flag wins).
SGLANG_PYTHON_ENV = "RELAX_SGLANG_PYTHON"

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user-input error: bad flag, bad value, inconsistent settings. The message is one line."""


class PartialSuccessPolicy(str, Enum):
    """What a scale-out does when only some of its new engines come up."""

    ROLLBACK_ALL = "rollback_all"
    KEEP_PARTIAL = "keep_partial"


class RewardType(str, Enum):
    """Built-in reward functions selectable with ``--rm-type``."""

    DAPO = "dapo"  # last "Answer:" line, normalised, +1/-1
    MATH = "math"  # math-verify equivalence
    DEEPSCALER = "deepscaler"  # boxed answer after the reasoning block, +1/0
    TINY = "tiny"  # the tiny preset's synthetic task
    LAST_NUMBER = "last-number"  # the smollm2 preset's task: the last number of the reply, +1/0


class UnfinishedRequests(str, Enum):
    """What happens to a request still running on an engine that leaves once its drain budget is spent."""

    MIGRATE = "migrate"  # abort it and continue on another engine from the tokens it has (rollout.dispatch.migration)
    RETRY = "retry"  # abort it and generate it again from the prompt elsewhere


class WeightSyncPath(str, Enum):
    """How a new version reaches the engines (docs/architecture.md, "Weights and staleness")."""

    BROADCAST = "broadcast"  # SGLang's distributed update: rank 0 broadcasts buckets over gloo/NCCL, one group each
    OBJECT_STORE = "object-store"  # buckets through Ray's object store, written to shared memory, loaded from disk


class KLLossType(str, Enum):
    """Per-token estimator of KL(policy || reference) on tokens the policy sampled (the names of slime and verl;
    Schulman's k1/k2/k3). ``relax.training.grpo.kl_estimate`` has the formulas."""

    KL = "kl"  # k1: the log ratio, unbiased, can be negative
    K1 = "k1"
    ABS = "abs"  # |k1|
    K2 = "k2"  # half the squared log ratio
    MSE = "mse"
    K3 = "k3"  # e^d - d - 1 with d the reference's log ratio: unbiased, never negative
    LOW_VAR_KL = "low_var_kl"  # k3 clamped to [-10, 10]


class LRDecayStyle(str, Enum):
    """Learning-rate schedule after warm-up."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


SUPPORTED_OPTIMIZERS = ("adam", "adamw")  # both mean torch AdamW (decoupled weight decay)


@dataclass(frozen=True)
class TrainArgs:
    """Typed, validated flags. Field names are the argparse destinations (``--rm-type`` -> rm_type)."""

    # Mode
    fully_async: bool = False
    dry_run: bool = False
    ray_cluster_manifest: str | None = None
    # Resources (parsed and checked by relax.config.plan)
    resource: str | None = None
    actor_num_nodes: int | None = None
    actor_num_gpus_per_node: int | None = None
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    autoscaler_config: str | None = None
    enable_affinity: bool = True
    # Scaling
    scale_out_timeout: float = 300.0
    scale_out_partial_success_policy: PartialSuccessPolicy = PartialSuccessPolicy.ROLLBACK_ALL
    scale_in_drain_timeout: float = 30.0
    scale_in_unfinished: UnfinishedRequests = UnfinishedRequests.MIGRATE
    scale_in_shutdown_timeout: float = 30.0
    sglang_router_url: str | None = None
    # Model and data
    hf_checkpoint: str | None = None
    prompt_data: str | None = None
    input_key: str = "prompt"
    label_key: str | None = "label"
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    rm_type: RewardType | None = None
    custom_rm_path: str | None = None
    reward_key: str | None = None
    # Evaluation
    eval_prompt_data: tuple[tuple[str, str], ...] = ()
    eval_interval: int | None = None
    n_samples_per_eval_prompt: int = 1
    eval_max_response_len: int | None = None
    eval_temperature: float | None = None
    eval_top_p: float | None = None
    skip_eval_before_train: bool = False
    # Rollout
    num_rollout: int | None = None
    rollout_batch_size: int = 32
    n_samples_per_prompt: int = 8
    rollout_max_prompt_len: int | None = None
    rollout_max_response_len: int = 1024
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    max_staleness: int = 1
    sglang_mem_fraction_static: float | None = None
    rollout_backend: str = "auto"
    sglang_python: str | None = None  # --sglang-python; RELAX_SGLANG_PYTHON when unset (sglang_interpreter)
    engine_host: str = "auto"
    sglang_passthrough: tuple[tuple[str, tuple[str, ...]], ...] = ()
    weight_sync_pause_mode: PauseMode = PauseMode.RETRACT
    weight_sync: WeightSyncPath = WeightSyncPath.BROADCAST
    weight_broadcast_timeout: float = 60.0
    update_weight_buffer_size: int = 512 * 2**20
    verify_weights: VerifyPolicy = VerifyPolicy.FIRST
    joiner_weights: str = "auto"
    # Training
    global_batch_size: int | None = None
    max_tokens_per_gpu: int | None = None
    use_dynamic_batch_size: bool = False
    micro_batch_size: int | None = None
    balance_data: bool = False
    gradient_checkpointing: bool = False
    precision: str = "auto"  # --bf16 / --fp16 (relax.config.megatron); auto = bf16 on CUDA, fp32 on CPU
    optimizer: str = "adam"
    lr: float = 1e-6
    lr_decay_style: LRDecayStyle = LRDecayStyle.CONSTANT
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    advantage_estimator: str = "grpo"
    disable_grpo_std_normalization: bool = False
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    use_tis: bool = False
    tis_clip: float = 2.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: KLLossType = KLLossType.LOW_VAR_KL
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = False
    seed: int = 1234
    # Checkpoints
    save: str | None = None
    save_interval: int | None = None
    keep_checkpoints: int = 0
    load: str | None = None
    # Control plane
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # Output
    output_dir: str = "outputs"
    tensorboard_dir: str | None = None
    record_samples: bool = False
    log_level: str = "info"
    # Experiment tracking (W&B; relax.training.tracking)
    use_wandb: bool = False
    wandb_project: str | None = None
    wandb_group: str | None = None
    wandb_team: str | None = None
    wandb_run_id: str | None = None
    wandb_key: str | None = field(default=None, repr=False)  # a secret: never shown nor logged
    wandb_host: str | None = None
    wandb_mode: str | None = None  # online | offline; None: WANDB_MODE, else online
    # Bookkeeping
    ignored_flags: tuple[str, ...] = ()
    argv: tuple[str, ...] = field(default=(), repr=False)  # may hold secrets (--wandb-key)

    def sglang_interpreter(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The Python that runs ``python -m sglang.launch_server``: ``--sglang-python``, else
        ``RELAX_SGLANG_PYTHON``, else ``None`` (the engine actor's own interpreter)."""
        environ = os.environ if environ is None else environ
        return self.sglang_python or (environ.get(SGLANG_PYTHON_ENV) or "").strip() or None

    @property
    def sglang_extra_args(self) -> tuple[str, ...]:
        """``--sglang-X v`` passthroughs as SGLang's own ``--X v`` command-line tokens."""
        tokens: list[str] = []
        for name, values in self.sglang_passthrough:
            tokens.append("--" + name)
            tokens.extend(values)
        return tuple(tokens)

    @property
    def resolved_tensorboard_dir(self) -> str:
        """TensorBoard directory: ``--tensorboard-dir`` or ``<output-dir>/tensorboard``."""
        return self.tensorboard_dir or f"{self.output_dir.rstrip('/')}/tensorboard"


# --------------------------------------------------------------------------------------------------
# Parser


class RelaxArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that raises ConfigError instead of printing usage and exiting.

    Why: the caller decides how to report (one line, exit 2; not argparse's usage block first) and tests can
    assert on the message. The training entrypoint and the ``relax`` command (whose sub-commands inherit it)
    both use it.
    """

    def error(self, message: str) -> NoReturn:
        raise ConfigError(_rewrite_argparse_message(message))


_ARGUMENT_PREFIX = re.compile(r"^argument (--[\w-]+)(?:/--[\w-]+)?: ")


def _rewrite_argparse_message(message: str) -> str:
    """Turn argparse's wording into Relax's: ``--flag: what is wrong``, on one line."""
    message = _ARGUMENT_PREFIX.sub(r"\1: ", message)
    message = message.replace(": expected one argument", " needs a value")
    message = message.replace(": expected at least one argument", " needs at least one value")
    message = re.sub(r": ignored explicit argument (.+)$", r" takes no value (got \1)", message)
    return " ".join(message.split())


def build_parser() -> argparse.ArgumentParser:
    """The parser for ``python -m relax.entrypoints.train``; errors raise ConfigError."""
    parser = RelaxArgumentParser(
        prog=PROG,
        description="Fully-asynchronous GRPO post-training on Ray with an elastic rollout pool.",
        epilog="Unknown --sglang-* flags are passed to SGLang as --*. Megatron-only flags are accepted "
        "and either mapped to a Relax setting or reported once as ignored.",
        allow_abbrev=False,
    )
    _add_mode_flags(parser.add_argument_group("mode"))
    _add_resource_flags(parser.add_argument_group("resources"))
    _add_scaling_flags(parser.add_argument_group("elastic scaling"))
    _add_data_flags(parser.add_argument_group("model and data"))
    _add_eval_flags(parser.add_argument_group("evaluation"))
    _add_rollout_flags(parser.add_argument_group("rollout"))
    _add_training_flags(parser.add_argument_group("training (GRPO)"))
    _add_checkpoint_flags(parser.add_argument_group("checkpoints"))
    _add_output_flags(parser.add_argument_group("control plane and output"))
    _add_tracking_flags(parser.add_argument_group("experiment tracking (W&B)"))
    _add_compat_flags(parser.add_argument_group("Megatron/slime compatibility (mapped or ignored)"))
    return parser


def _add_mode_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--fully-async", action="store_true",
                       help="trainer and rollout on separate GPUs (the only mode Relax runs)")
    group.add_argument("--colocate", action="store_true",
                       help="not supported yet; use --fully-async")
    group.add_argument("--dry-run", action="store_true",
                       help="print the resource plan and exit without starting anything")
    group.add_argument("--ray-cluster-manifest", metavar="PATH",
                       help="with --dry-run: check the plan against a KubeRay RayCluster (a manifest file or a "
                            "kustomize directory) instead of a live cluster; exit 1 if it does not fit")


def _add_resource_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--resource", metavar="JSON",
                       help='per role [replicas, gpus], e.g. \'{"actor": [1, 4], "rollout": [1, 4]}\'')
    group.add_argument("--actor-num-nodes", type=argtypes.positive_int, metavar="N",
                       help="slime style: trainer nodes (used when --resource is absent)")
    group.add_argument("--actor-num-gpus-per-node", type=argtypes.positive_int, metavar="N",
                       help="slime style: trainer GPUs per node (used when --resource is absent)")
    group.add_argument("--rollout-num-gpus", type=argtypes.positive_int, metavar="N",
                       help="slime style: rollout GPUs (used when --resource is absent)")
    group.add_argument("--rollout-num-gpus-per-engine", type=argtypes.positive_int, default=1, metavar="N",
                       help="GPUs per rollout engine; the scaling unit (default 1)")
    group.add_argument("--autoscaler-config", metavar="YAML",
                       help="autoscaler config; the autoscaler runs when it says enabled: true")
    group.add_argument("--enable-affinity", action=argparse.BooleanOptionalAction, default=True,
                       help="pin the baseline to the RELAX_INITIAL_NODE_GROUP node group when the "
                       "autoscaler is enabled (default on)")


def _add_scaling_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--scale-out-timeout", type=argtypes.positive_float, default=300.0, metavar="SECS",
                       help="whole scale-out budget: placement, start, health, weight sync (default 300)")
    group.add_argument("--scale-out-partial-success-policy", type=argtypes.enum_type(PartialSuccessPolicy),
                       default=PartialSuccessPolicy.ROLLBACK_ALL,
                       metavar=argtypes.choices_metavar(PartialSuccessPolicy),
                       help="when only some new engines come up (default rollback_all)")
    group.add_argument("--scale-in-drain-timeout", type=argtypes.positive_float, default=30.0, metavar="SECS",
                       help="wait for in-flight requests before aborting them (default 30); see "
                            "--scale-in-unfinished")
    group.add_argument("--scale-in-unfinished", type=argtypes.enum_type(UnfinishedRequests),
                       default=UnfinishedRequests.MIGRATE, metavar=argtypes.choices_metavar(UnfinishedRequests),
                       help="requests still running when an engine leaves (scale-in past the drain timeout, an "
                            "eviction): migrate (default: continue on another engine from the tokens generated "
                            "so far) or retry (generate again from the prompt)")
    group.add_argument("--scale-in-shutdown-timeout", type=argtypes.positive_float, default=30.0, metavar="SECS",
                       help="graceful engine shutdown before kill (default 30)")
    group.add_argument("--sglang-router-url", type=router_url, metavar="URL",
                       help="an SGLang router (sglang-router 0.3.x) to keep in step with the pool: each engine is "
                            "registered there once it serves the newest weights and removed before it drains, is "
                            "evicted or fails (docs/elastic.md, \"Using an SGLang router\")")


def router_url(text: str) -> str:
    """``--sglang-router-url``: an http(s) URL with a host, no credentials, query or fragment; trailing ``/`` dropped.

    Checked here so that a typo is one line before Ray starts, not a warning per engine during the run (a router
    that is merely down is the run's business: it keeps training and retries).
    """
    raw = text.strip()
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL ({exc}); e.g. http://10.0.0.5:30000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        hint = " (missing 'http://'?)" if "//" not in raw else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} must be an http(s) URL with a host{hint}, e.g. http://10.0.0.5:30000")
    if "@" in parts.netloc or parts.query or parts.fragment or port == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be the router's base URL without credentials, query or fragment, e.g. "
            "http://10.0.0.5:30000")
    return raw.rstrip("/")


def _add_data_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hf-checkpoint", metavar="PATH", help="Hugging Face model directory")
    group.add_argument("--prompt-data", metavar="PATH", help="training prompts (JSONL)")
    group.add_argument("--input-key", default="prompt", metavar="KEY", help="prompt field (default prompt)")
    group.add_argument("--label-key", default="label", metavar="KEY", help="label field (default label)")
    group.add_argument("--apply-chat-template", action="store_true",
                       help="wrap prompts with the tokenizer's chat template")
    group.add_argument("--rollout-shuffle", action="store_true", help="shuffle prompts every epoch")
    group.add_argument("--rollout-seed", type=int, default=42, metavar="N",
                       help="seed of the prompt shuffle (default 42)")
    group.add_argument("--rm-type", type=argtypes.enum_type(RewardType), metavar=argtypes.choices_metavar(RewardType),
                       help="built-in reward function")
    group.add_argument("--custom-rm-path", metavar="MODULE:FUNCTION",
                       help="custom reward function (module:function or dotted path)")
    group.add_argument("--reward-key", metavar="KEY",
                       help="a reward function that returns a dict (say {'score': 1.0, 'acc': True}) is read at "
                            "this key; without it such a result is an error")


def _add_eval_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--eval-prompt-data", nargs="+", action="extend", metavar="NAME PATH",
                       help="evaluation sets as NAME PATH pairs; may repeat")
    group.add_argument("--eval-interval", type=argtypes.positive_int, metavar="STEPS",
                       help="evaluate every STEPS rollout steps")
    group.add_argument("--n-samples-per-eval-prompt", type=argtypes.positive_int, default=1, metavar="N",
                       help="samples per evaluation prompt, for pass@k (default 1)")
    group.add_argument("--eval-max-response-len", type=argtypes.positive_int, metavar="TOKENS",
                       help="evaluation response limit (default: --rollout-max-response-len)")
    group.add_argument("--eval-temperature", type=argtypes.non_negative_float, metavar="T",
                       help="evaluation temperature (default: --rollout-temperature)")
    group.add_argument("--eval-top-p", type=argtypes.fraction, metavar="P",
                       help="evaluation top-p (default: --rollout-top-p)")
    group.add_argument("--skip-eval-before-train", action="store_true",
                       help="do not evaluate the initial checkpoint")


def _add_rollout_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--num-rollout", type=argtypes.positive_int, metavar="N", help="rollout steps to train")
    group.add_argument("--rollout-batch-size", type=argtypes.positive_int, default=32, metavar="PROMPTS",
                       help="prompts per rollout step (default 32)")
    group.add_argument("--n-samples-per-prompt", type=argtypes.positive_int, default=8, metavar="N",
                       help="responses per prompt, the GRPO group size (default 8)")
    group.add_argument("--rollout-max-prompt-len", type=argtypes.positive_int, metavar="TOKENS",
                       help="drop prompts longer than this")
    group.add_argument("--rollout-max-response-len", type=argtypes.positive_int, default=1024, metavar="TOKENS",
                       help="max new tokens per response (default 1024)")
    group.add_argument("--rollout-temperature", type=argtypes.non_negative_float, default=1.0, metavar="T",
                       help="sampling temperature (default 1.0)")
    group.add_argument("--rollout-top-p", type=argtypes.fraction, default=1.0, metavar="P", help="top-p (default 1.0)")
    group.add_argument("--rollout-top-k", type=argtypes.top_k, default=-1, metavar="K", help="top-k, -1 = off")
    group.add_argument("--max-staleness", type=argtypes.non_negative_int, default=1, metavar="N",
                       help="max weight versions a rollout may lag the trainer; 0 = on-policy (default 1)")
    group.add_argument("--sglang-mem-fraction-static", type=argtypes.fraction, metavar="F",
                       help="fraction of GPU memory for weights and KV cache")
    group.add_argument("--rollout-backend", choices=["auto", "sglang", "builtin"], default="auto",
                       help="engine server: SGLang, Relax's built-in engine, or auto (SGLang for engines on CUDA "
                            "GPUs, the built-in engine for CPU-only engines)")
    group.add_argument("--sglang-python", metavar="PATH",
                       help="the Python that runs SGLang's server on the engine nodes (SGLang in its own "
                            f"environment); default ${SGLANG_PYTHON_ENV}, else the engine's own interpreter")
    group.add_argument("--engine-host", default="auto", metavar="HOST",
                       help="address engines bind: auto (loopback on one machine, the node IP across nodes), "
                            "node, or an explicit IP")
    group.add_argument("--weight-sync-pause-mode", type=argtypes.enum_type(PauseMode),
                       default=PauseMode.RETRACT, metavar=argtypes.choices_metavar(PauseMode),
                       help="how each engine pauses around a weight load: retract (default: in-flight requests "
                            "re-encode on the new weights), in_place, abort, or none (SGLang then waits for "
                            "every in-flight request before loading)")
    group.add_argument("--weight-sync", type=argtypes.enum_type(WeightSyncPath), default=WeightSyncPath.BROADCAST,
                       metavar=argtypes.choices_metavar(WeightSyncPath),
                       help="how new weights reach the engines: broadcast (default: SGLang's distributed update "
                            "from trainer rank 0, gloo on CPU, NCCL on GPU) or object-store (Ray's object store and "
                            "a load from shared memory; for engines that cannot reach the trainer)")
    group.add_argument("--update-weight-buffer-size", type=argtypes.positive_int, default=512 * 2**20,
                       metavar="BYTES",
                       help="bucket size of a broadcast weight update (default 512 MiB, as slime); each engine keeps "
                            "one receive buffer of this size")
    group.add_argument("--weight-broadcast-timeout", type=argtypes.positive_float, default=60.0, metavar="S",
                       help="deadline of one broadcast step (a group join, one bucket); an engine that misses it "
                            "is failed and replaced (default 60)")
    group.add_argument("--verify-weights", type=argtypes.enum_type(VerifyPolicy), default=VerifyPolicy.FIRST,
                       metavar=argtypes.choices_metavar(VerifyPolicy),
                       help="check an engine's served weights against the trainer's publication (per-tensor "
                            "SHA-256, /weights_checker) before it continues after a load: first (default: each "
                            "engine's first load, when it joins), every (every load; the check's time is in every "
                            "pause), or off. A mismatch reloads the version once, then fails the engine")
    group.add_argument("--joiner-weights", choices=JOINER_WEIGHTS, default="auto",
                       help="what an engine started after the trainer published by broadcast (scale-out, a "
                            "replacement) loads before its first refit sends every tensor: dummy (random weights, "
                            "no checkpoint read; routable only once that refit is verified, whatever "
                            "--verify-weights says), checkpoint (the base checkpoint, read for nothing), or auto "
                            "(default: dummy on the built-in engine, checkpoint on SGLang until its dummy start is "
                            "verified against the real engine)")


def _add_training_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--global-batch-size", type=argtypes.positive_int, metavar="SAMPLES",
                       help="samples per optimizer step (default: one step per rollout step)")
    group.add_argument("--max-tokens-per-gpu", type=argtypes.positive_int, metavar="TOKENS",
                       help="token budget of a micro-batch (dynamic batching)")
    group.add_argument("--optimizer", default="adam", metavar="{adam}", help="AdamW (the only optimizer)")
    group.add_argument("--lr", type=argtypes.positive_float, default=1e-6, metavar="LR", help="learning rate")
    group.add_argument("--lr-decay-style", type=argtypes.enum_type(LRDecayStyle), default=LRDecayStyle.CONSTANT,
                       metavar=argtypes.choices_metavar(LRDecayStyle), help="schedule after warm-up (default constant)")
    group.add_argument("--lr-warmup-iters", type=argtypes.non_negative_int, default=0, metavar="STEPS",
                       help="linear warm-up optimizer steps (default 0)")
    group.add_argument("--lr-decay-iters", type=argtypes.positive_int, metavar="STEPS",
                       help="optimizer step at which linear/cosine decay reaches --min-lr (default: the run's "
                            "training steps)")
    group.add_argument("--min-lr", type=argtypes.non_negative_float, default=0.0, metavar="LR",
                       help="floor of linear/cosine decay (default 0)")
    group.add_argument("--weight-decay", type=argtypes.non_negative_float, default=0.0, metavar="WD")
    group.add_argument("--adam-beta1", type=argtypes.beta, default=0.9, metavar="B1")
    group.add_argument("--adam-beta2", type=argtypes.beta, default=0.999, metavar="B2")
    group.add_argument("--adam-eps", type=argtypes.positive_float, default=1e-8, metavar="EPS")
    group.add_argument("--clip-grad", type=argtypes.non_negative_float, default=1.0, metavar="NORM",
                       help="gradient-norm clip, 0 = off (default 1.0)")
    group.add_argument("--advantage-estimator", default="grpo", metavar="{grpo}", help="only grpo")
    group.add_argument("--disable-grpo-std-normalization", action="store_true",
                       help="normalise rewards by the group mean only")
    group.add_argument("--eps-clip", type=argtypes.non_negative_float, default=0.2, metavar="EPS",
                       help="lower PPO clip (default 0.2)")
    group.add_argument("--eps-clip-high", type=argtypes.non_negative_float, default=0.28, metavar="EPS",
                       help="upper PPO clip (default 0.28)")
    group.add_argument("--use-tis", action="store_true",
                       help="truncated importance sampling against rollout log-probs")
    group.add_argument("--tis-clip", type=argtypes.positive_float, default=2.0, metavar="C",
                       help="TIS weight clip (default 2.0)")
    group.add_argument("--use-kl-loss", action="store_true",
                       help="load the reference model and log KL (enters the loss when --kl-loss-coef > 0)")
    group.add_argument("--kl-loss-coef", type=argtypes.non_negative_float, default=0.0, metavar="C")
    group.add_argument("--kl-loss-type", type=argtypes.enum_type(KLLossType), default=KLLossType.LOW_VAR_KL,
                       metavar=argtypes.choices_metavar(KLLossType))
    group.add_argument("--entropy-coef", type=argtypes.non_negative_float, default=0.0, metavar="C")
    group.add_argument("--calculate-per-token-loss", action="store_true",
                       help="token-mean loss aggregation (default sample-mean)")
    group.add_argument("--seed", type=int, default=1234, metavar="N")


def _add_checkpoint_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--save", metavar="DIR", help="checkpoint directory")
    group.add_argument("--save-interval", type=argtypes.positive_int, metavar="STEPS",
                       help="save every STEPS rollout steps (needs --save)")
    group.add_argument("--keep-checkpoints", type=argtypes.non_negative_int, default=0, metavar="N",
                       help="keep only the newest N complete checkpoints in --save (the one 'latest' names is never "
                            "deleted); 0 keeps all (default)")
    group.add_argument("--load", metavar="DIR", help="resume from this checkpoint directory if it has one")


def _add_output_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--api-host", default="127.0.0.1", metavar="HOST",
                       help="control-plane HTTP host (default 127.0.0.1)")
    group.add_argument("--api-port", type=argtypes.port, default=8000, metavar="PORT",
                       help="control-plane HTTP port (default 8000)")
    group.add_argument("--output-dir", default="outputs", metavar="DIR",
                       help="logs, metrics JSONL and TensorBoard (default outputs)")
    group.add_argument("--tensorboard-dir", metavar="DIR", help="default <output-dir>/tensorboard")
    group.add_argument("--record-samples", action="store_true",
                       help="write every trained sample (response text and tokens, reward, version, finish "
                            "reason) to <output-dir>/samples.jsonl; large on long responses")
    group.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                       help="info (default): one console line per training step and the events that matter; "
                            "debug: every actor's per-step lines too (rollout steps, trainer ranks, weight loads)")


def _add_tracking_flags(group: argparse._ArgumentGroup) -> None:
    """slime's W&B flags, plus --wandb-mode (docs/training.md, "Experiment tracking (W&B)")."""
    group.add_argument("--use-wandb", action="store_true",
                       help="log every metrics.jsonl row, the summary and the training plot to a W&B run "
                            "(needs pip install 'relax[wandb]')")
    group.add_argument("--wandb-project", metavar="NAME", help="W&B project (default relax)")
    group.add_argument("--wandb-group", metavar="NAME", help="W&B run group")
    group.add_argument("--wandb-team", metavar="ENTITY", help="W&B entity (team or user; default: the key's user)")
    group.add_argument("--wandb-run-id", metavar="ID",
                       help="W&B run id to log to (resumed if it exists); default: a new id, kept in "
                            "<output-dir>/wandb-run-id and reused when --load resumes the run")
    group.add_argument("--wandb-key", metavar="KEY",
                       help="W&B API key for online mode (default: WANDB_API_KEY or `wandb login`); never logged")
    group.add_argument("--wandb-host", metavar="URL", help="W&B server base URL (default https://api.wandb.ai)")
    group.add_argument("--wandb-mode", choices=("online", "offline"), metavar="{online,offline}",
                       help="online, or offline: write under <output-dir>/wandb/ for a later `wandb sync` "
                            "(default: WANDB_MODE, else online)")


def _add_compat_flags(group: argparse._ArgumentGroup) -> None:
    """Register the Megatron/slime table; defaults are SUPPRESS so only given flags appear."""
    for flag in COMPAT_FLAGS:
        kwargs: dict[str, object] = {"dest": flag.dest, "default": argparse.SUPPRESS,
                                     "help": f"{flag.disposition.value}: {flag.reason}"}
        if flag.arity is Arity.SWITCH:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = flag.value_type
            kwargs["metavar"] = "{" + ",".join(flag.choices) + "}" if flag.choices else "VALUE"
            if flag.choices:
                kwargs["choices"] = flag.choices
            if flag.arity is Arity.VALUES:
                kwargs["nargs"] = "+"
        group.add_argument(flag.option, **kwargs)


# --------------------------------------------------------------------------------------------------
# Parsing


def known_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string the parser accepts (for suggestions and passthrough detection)."""
    return [option for action in parser._actions for option in action.option_strings]


def _looks_like_flag(token: str) -> bool:
    if token.startswith("--"):
        return True
    return token.startswith("-") and len(token) > 1 and not _is_number(token)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def split_sglang_passthrough(
    argv: Sequence[str], known: set[str]
) -> tuple[list[str], tuple[tuple[str, tuple[str, ...]], ...]]:
    """Pull unknown ``--sglang-X [values...]`` out of argv.

    Why a pre-scan: argparse cannot accept "any option with this prefix", and SGLang has hundreds
    of server flags that run scripts forward as ``--sglang-*``. They are handed to the SGLang
    launcher as ``--X values``; the built-in engine ignores them.
    """
    rest: list[str] = []
    passthrough: list[tuple[str, tuple[str, ...]]] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        name, has_inline, inline = token.partition("=")
        if not (name.startswith(SGLANG_PASSTHROUGH_PREFIX) and name not in known):
            rest.append(token)
            index += 1
            continue
        index += 1
        values: list[str] = [inline] if has_inline else []
        while not has_inline and index < len(argv) and not _looks_like_flag(argv[index]):
            values.append(argv[index])
            index += 1
        passthrough.append((name[len(SGLANG_PASSTHROUGH_PREFIX):], tuple(values)))
    return rest, tuple(passthrough)


def _unknown_argument_error(extras: Sequence[str], known: Sequence[str]) -> ConfigError:
    """One-line error for the first unknown token, with the closest known flag when there is one."""
    flags = [token for token in extras if _looks_like_flag(token)]
    if not flags:
        return ConfigError(
            f"unexpected argument {extras[0]!r}: values must follow a flag (e.g. --num-rollout 100)"
        )
    name = flags[0].partition("=")[0]
    candidates = [option for option in known if option.startswith("--")]
    normalized = name.replace("_", "-")
    match = difflib.get_close_matches(normalized, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {match[0]}?" if match else ""
    more = f" (and {len(flags) - 1} more)" if len(flags) > 1 else ""
    return ConfigError(f"unknown flag {name}{more}{hint} ({PROG} --help lists every flag)")


def parse_args(argv: Sequence[str] | None = None) -> TrainArgs:
    """Parse and validate the command line; raises ConfigError with a one-line message."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    options = known_options(parser)
    rest, passthrough = split_sglang_passthrough(tokens, set(options))
    namespace, extras = parser.parse_known_args(rest)
    if extras:
        raise _unknown_argument_error(extras, options)
    values = vars(namespace)
    if values.pop("colocate"):
        raise ConfigError(
            "--colocate is not supported yet; use --fully-async (trainer and rollout engines on separate GPUs)"
        )
    compat = {key: values.pop(key) for key in list(values) if key.startswith("compat_")}
    values["eval_prompt_data"] = _eval_pairs(values["eval_prompt_data"])
    try:
        mapped = mapped_settings(compat)
    except ValueError as error:  # two mapped flags for one setting (--bf16 --fp16)
        raise ConfigError(str(error)) from None
    args = TrainArgs(
        **values,
        **mapped,
        sglang_passthrough=passthrough,
        ignored_flags=ignored_options(compat),
        argv=tuple(tokens),
    )
    validate_args(args)
    return args


def _eval_pairs(raw: list[str] | None) -> tuple[tuple[str, str], ...]:
    if not raw:
        return ()
    if len(raw) % 2:
        raise ConfigError(
            f"--eval-prompt-data takes NAME PATH pairs, got {len(raw)} values ({' '.join(raw)}); "
            "e.g. --eval-prompt-data aime /data/aime-2024.jsonl"
        )
    return tuple((raw[i], raw[i + 1]) for i in range(0, len(raw), 2))


_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def _valid_callable_path(path: str) -> bool:
    """``pkg.module:function`` or ``pkg.module.function``."""
    module, colon, function = path.partition(":")
    if colon:
        parts = [*module.split("."), function]
    else:
        parts = path.split(".")
        if len(parts) < 2:
            return False
    return all(_IDENTIFIER.match(part) for part in parts)


def validate_args(args: TrainArgs) -> None:
    """Cross-flag checks that need no files and no cluster; raises ConfigError."""
    if args.advantage_estimator != "grpo":
        raise ConfigError(
            f"--advantage-estimator {args.advantage_estimator} is not supported; Relax implements "
            "grpo only (use --advantage-estimator grpo)"
        )
    if args.optimizer not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(f"--optimizer {args.optimizer} is not supported; use --optimizer adam (AdamW)")
    # --custom-rm-path wins over --rm-type when both are given (slime's rule, and get_reward_fn's).
    if args.custom_rm_path is not None and not _valid_callable_path(args.custom_rm_path):
        raise ConfigError(
            f"--custom-rm-path {args.custom_rm_path!r} is not a module:function path; "
            "e.g. --custom-rm-path my_rewards:score"
        )
    if args.ray_cluster_manifest is not None and not args.dry_run:
        raise ConfigError("--ray-cluster-manifest checks a plan before the cluster exists: use it with --dry-run "
                          "(a real start checks the live cluster)")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR to know where checkpoints go")
    if args.keep_checkpoints and args.save is None:
        raise ConfigError(f"--keep-checkpoints {args.keep_checkpoints} needs --save DIR (the directory it keeps "
                          "checkpoints in)")
    if args.eval_interval is not None and not args.eval_prompt_data:
        raise ConfigError("--eval-interval needs --eval-prompt-data NAME PATH to know what to evaluate")
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu TOKENS (the micro-batch budget)")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}; lower --min-lr")
    names = [name for name, _ in args.eval_prompt_data]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"--eval-prompt-data names must be unique; repeated: {', '.join(duplicates)}")


def ignored_flags_warning(args: TrainArgs) -> str | None:
    """The single "ignored (Megatron-only): ..." line for the driver to log, or None."""
    return ignored_warning(args.ignored_flags)


def fail(error: ConfigError, stream: IO[str] | None = None) -> NoReturn:
    """Print ``error: <message>`` on one line and exit 2 (argparse's usage-error code)."""
    print(f"{PROG}: error: {error}", file=stream or sys.stderr)
    raise SystemExit(2)


def parse_args_or_exit(argv: Sequence[str] | None = None, stream: IO[str] | None = None) -> TrainArgs:
    """Driver entry: parse, log the ignored-flags line once, or print the error and exit 2."""
    try:
        args = parse_args(argv)
    except ConfigError as error:
        fail(error, stream)
    warning = ignored_flags_warning(args)
    if warning:
        logger.warning(warning)
    return args
