"""Which precision a trainer rank computes in, and the FSDP2 mixed-precision policy for it (pure).

On CUDA the default is bf16 compute over fp32 master weights, fp32 gradient reduction and fp32 AdamW state
(docs/training.md, "Precision on GPU"); on CPU the trainer computes in fp32, because CPU low-precision
matmuls are slower and the CPU tests compare results exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["PRECISIONS", "Precision", "mixed_precision_for", "precision_fallback_warning", "resolve_precision"]

Precision = Literal["auto", "fp32", "bf16", "fp16"]
#: ``TrainerConfig.precision`` values: auto = bf16 on CUDA, fp32 on CPU.
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device_type: str) -> str:
    """The precision a rank actually computes in: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    ``auto`` is bf16 on CUDA (what the GPU recipes train in, and what SGLang serves) and fp32 elsewhere.
    Off CUDA a requested bf16/fp16 also becomes fp32: CPU low-precision matmuls are slower than fp32, and
    the CPU tests compare trainer results exactly (``precision_fallback_warning`` says so once).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if device_type != "cuda":
        return "fp32"
    return "bf16" if precision == "auto" else precision


def precision_fallback_warning(precision: str, device_type: str) -> str | None:
    """The one warning line for a bf16/fp16 request that ``resolve_precision`` turns into fp32, else None."""
    if precision not in _COMPUTE_DTYPES or resolve_precision(precision, device_type) == precision:
        return None
    return (f"trainer: precision {precision} (--{precision}) applies on CUDA only; training in fp32 on "
            f"{device_type} (CPU {precision} matmuls are slow, and CPU results must stay exact fp32)")


def mixed_precision_for(precision: str, device_type: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy every ``fully_shard`` call gets, or None for plain fp32 (CPU, or ``fp32``).

    Only the unsharded parameters that forward/backward run on are cast (``param_dtype``): the sharded
    parameters the optimizer updates stay fp32 (the master copy, and so AdamW's moments too), and gradients
    are reduce-scattered in fp32 (``reduce_dtype``) so averaging over ranks loses nothing.
    """
    resolved = resolve_precision(precision, device_type)
    if resolved == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_COMPUTE_DTYPES[resolved], reduce_dtype=torch.float32)
