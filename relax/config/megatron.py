"""Megatron/slime compatibility flags: accepted so existing run scripts parse unchanged.

Relax trains with an FSDP2-wrapped Hugging Face model, so most Megatron switches (parallel sizes,
fusions, the model-architecture flags that duplicate the checkpoint's ``config.json``) have nothing
to act on. Rejecting them would force users to edit a recipe that works on slime/Relax; silently
swallowing them would hide that they do nothing. So each flag here is either *mapped* onto a Relax
setting or *ignored* and named once in a single warning line.

This module is data plus two tiny helpers; ``relax.config.flags`` registers the table with argparse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from relax import argtypes


class Arity(Enum):
    """How many command-line values a compatibility flag consumes."""

    SWITCH = "switch"  # no value: --sequence-parallel
    VALUE = "value"  # exactly one value: --tensor-model-parallel-size 2
    VALUES = "values"  # one or more values


class Disposition(Enum):
    """What Relax does with a compatibility flag."""

    MAPPED = "mapped"  # sets a Relax setting (``target`` field of TrainArgs)
    IGNORED = "ignored"  # accepted and reported once as ignored


@dataclass(frozen=True)
class CompatFlag:
    """One accepted Megatron/slime flag and what it becomes in Relax."""

    option: str
    arity: Arity
    disposition: Disposition
    reason: str
    target: str | None = None  # TrainArgs field a MAPPED flag sets
    convert: Callable[[object], object] | None = None  # parsed value -> target value
    value_type: Callable[[str], object] = str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        """argparse destination; prefixed so it never collides with a Relax field."""
        return "compat_" + self.option.lstrip("-").replace("-", "_")


def _true(_: object) -> bool:
    return True


def _constant(value: object) -> Callable[[object], object]:
    """A ``convert`` for a switch that sets ``target`` to ``value`` (``--bf16`` -> precision "bf16")."""
    return lambda _: value


_FSDP = "Relax shards the model with FSDP2 over the trainer GPUs"
_ARCH = "the architecture comes from --hf-checkpoint's config.json"
_KERNEL = "Megatron kernel/precision switch; the FSDP2 trainer has its own defaults"
_LOG = "Relax logs to TensorBoard, a JSONL file, the control plane's /metrics and W&B (--use-wandb)"
_RUNTIME = "slime/Relax runtime knob with no counterpart in this implementation"


def _ignored(option: str, arity: Arity, reason: str, choices: tuple[str, ...] | None = None) -> CompatFlag:
    return CompatFlag(option, arity, Disposition.IGNORED, reason, choices=choices)


_S, _V = Arity.SWITCH, Arity.VALUE

MAPPED_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(
        "--recompute-granularity", _V, Disposition.MAPPED,
        "activation checkpointing of every decoder layer in the FSDP2 trainer",
        target="gradient_checkpointing", convert=_true, choices=("full", "selective"),
    ),
    CompatFlag(
        "--use-dynamic-batch-size", _S, Disposition.MAPPED,
        "micro-batches are packed up to --max-tokens-per-gpu tokens",
        target="use_dynamic_batch_size", convert=_true,
    ),
    CompatFlag(
        "--micro-batch-size", _V, Disposition.MAPPED,
        "samples per micro-batch when dynamic batching is off",
        target="micro_batch_size", value_type=argtypes.positive_int,
    ),
    CompatFlag(
        "--balance-data", _S, Disposition.MAPPED,
        "spread samples over trainer ranks by token count",
        target="balance_data", convert=_true,
    ),
    CompatFlag(
        "--bf16", _S, Disposition.MAPPED,
        "bf16 compute with fp32 master weights and fp32 gradient reduction on CUDA (the default there "
        "too); fp32 on CPU",
        target="precision", convert=_constant("bf16"),
    ),
    CompatFlag(
        "--fp16", _S, Disposition.MAPPED,
        "fp16 compute with dynamic loss scaling, fp32 master weights and gradient reduction on CUDA; fp32 on CPU",
        target="precision", convert=_constant("fp16"),
    ),
)

IGNORED_FLAGS: tuple[CompatFlag, ...] = (
    # Parallelism: FSDP2 replaces all of it.
    _ignored("--tensor-model-parallel-size", _V, _FSDP),
    _ignored("--sequence-parallel", _S, _FSDP),
    _ignored("--pipeline-model-parallel-size", _V, _FSDP),
    _ignored("--virtual-pipeline-model-parallel-size", _V, _FSDP),
    _ignored("--decoder-last-pipeline-num-layers", _V, _FSDP),
    _ignored("--context-parallel-size", _V, _FSDP),
    _ignored("--expert-model-parallel-size", _V, _FSDP),
    _ignored("--expert-tensor-parallel-size", _V, _FSDP),
    _ignored("--use-distributed-optimizer", _S, _FSDP),
    _ignored("--recompute-method", _V, "--recompute-granularity alone turns on activation checkpointing"),
    _ignored("--recompute-num-layers", _V, "--recompute-granularity alone turns on activation checkpointing"),
    # Kernels and precision.
    _ignored("--attention-dropout", _V, "RL fine-tuning runs the HF model without dropout"),
    _ignored("--hidden-dropout", _V, "RL fine-tuning runs the HF model without dropout"),
    _ignored("--accumulate-allreduce-grads-in-fp32", _S, "FSDP2 reduces gradients in fp32 already"),
    _ignored("--attention-softmax-in-fp32", _S, _KERNEL),
    _ignored("--attention-backend", _V, _KERNEL),
    _ignored("--no-rope-fusion", _S, _KERNEL),
    _ignored("--no-gradient-accumulation-fusion", _S, _KERNEL),
    _ignored("--no-masked-softmax-fusion", _S, _KERNEL),
    _ignored("--no-bias-swiglu-fusion", _S, _KERNEL),
    _ignored("--optimizer-cpu-offload", _S, "Megatron optimizer offload; not implemented for FSDP2"),
    _ignored("--overlap-cpu-optimizer-d2h-h2d", _S, "Megatron optimizer offload; not implemented for FSDP2"),
    _ignored("--use-precision-aware-optimizer", _S, "Megatron optimizer option"),
    # Model architecture (duplicates config.json).
    _ignored("--swiglu", _S, _ARCH),
    _ignored("--num-layers", _V, _ARCH),
    _ignored("--hidden-size", _V, _ARCH),
    _ignored("--ffn-hidden-size", _V, _ARCH),
    _ignored("--num-attention-heads", _V, _ARCH),
    _ignored("--group-query-attention", _S, _ARCH),
    _ignored("--num-query-groups", _V, _ARCH),
    _ignored("--use-rotary-position-embeddings", _S, _ARCH),
    _ignored("--disable-bias-linear", _S, _ARCH),
    _ignored("--add-qkv-bias", _S, _ARCH),
    _ignored("--normalization", _V, _ARCH),
    _ignored("--norm-epsilon", _V, _ARCH),
    _ignored("--rotary-base", _V, _ARCH),
    _ignored("--rotary-percent", _V, _ARCH),
    _ignored("--position-embedding-type", _V, _ARCH),
    _ignored("--max-position-embeddings", _V, _ARCH),
    _ignored("--seq-length", _V, _ARCH),
    _ignored("--vocab-size", _V, _ARCH),
    _ignored("--make-vocab-size-divisible-by", _V, _ARCH),
    _ignored("--kv-channels", _V, _ARCH),
    _ignored("--qk-layernorm", _S, _ARCH),
    _ignored("--untie-embeddings-and-output-weights", _S, _ARCH),
    # Checkpoint formats.
    _ignored("--ref-load", _V, "the reference model is --hf-checkpoint (Relax has no Megatron checkpoints)"),
    _ignored("--megatron-to-hf-mode", _V, "Relax checkpoints are Hugging Face weights already"),
    _ignored("--ckpt-format", _V, "Relax checkpoints are Hugging Face weights already"),
    _ignored("--warm-hf-checkpoint-page-cache", _S, _RUNTIME),
    _ignored("--no-load-optim", _S, _RUNTIME),
    _ignored("--no-load-rng", _S, _RUNTIME),
    # Logging back ends.
    _ignored("--use-clearml", _S, _LOG),
    _ignored("--use-metrics-service", _S, _LOG),
    _ignored("--use-tensorboard", _S, "TensorBoard is always on (see --tensorboard-dir)"),
    _ignored("--tb-project-name", _V, "TensorBoard goes to --tensorboard-dir"),
    _ignored("--tb-experiment-name", _V, "TensorBoard goes to --tensorboard-dir"),
    _ignored("--log-passrate", _S, "evaluation always logs pass@k"),
    # slime/Relax runtime knobs.
    _ignored("--train-backend", _V, "Relax always trains with FSDP2", choices=("fsdp", "megatron")),
    _ignored("--num-data-storage-units", _V, _RUNTIME),
    _ignored("--num-iters-per-train-update", _V, _RUNTIME),
    _ignored("--ref-actor-config", _V, _RUNTIME),
    _ignored("--use-health-check", _S, "engine health checks are always on"),
    _ignored("--use-fault-tolerance", _S, "requests of failed engines are always retried elsewhere"),
    _ignored("--scale-weight-sync-precheck", _S, "joining engines always pull the latest weight version"),
    _ignored("--sglang-router-ip", _V, "Relax routes requests itself; --sglang-router-url URL mirrors the pool "
             "into an existing SGLang router"),
    _ignored("--sglang-router-port", _V, "Relax routes requests itself; --sglang-router-url URL mirrors the pool "
             "into an existing SGLang router"),
)

COMPAT_FLAGS: tuple[CompatFlag, ...] = MAPPED_FLAGS + IGNORED_FLAGS

IGNORED_WARNING_PREFIX = "ignored (Megatron-only): "


def mapped_settings(present: Mapping[str, object]) -> dict[str, object]:
    """TrainArgs field values for the MAPPED flags that were given.

    ``present`` maps ``CompatFlag.dest`` to the parsed value for flags on the command line only. Two flags
    that set one field to different values (``--bf16 --fp16``) raise ``ValueError``: Megatron rejects that
    pair too, and picking one silently would train in a precision the script did not mean.
    """
    settings: dict[str, object] = {}
    given_by: dict[str, str] = {}
    for flag in MAPPED_FLAGS:
        if flag.dest in present:
            value = present[flag.dest]
            assert flag.target is not None
            value = flag.convert(value) if flag.convert else value
            if flag.target in settings and settings[flag.target] != value:
                raise ValueError(f"{given_by[flag.target]} and {flag.option} contradict each other; give one")
            settings[flag.target] = value
            given_by[flag.target] = flag.option
    return settings


def ignored_options(present: Iterable[str]) -> tuple[str, ...]:
    """Option names (table order, each once) of the IGNORED flags whose dest is in ``present``."""
    given = set(present)
    return tuple(flag.option for flag in IGNORED_FLAGS if flag.dest in given)


def ignored_warning(options: Iterable[str]) -> str | None:
    """The single warning line naming every ignored flag, or None when there is nothing to say."""
    names = list(options)
    if not names:
        return None
    return IGNORED_WARNING_PREFIX + ", ".join(names)
