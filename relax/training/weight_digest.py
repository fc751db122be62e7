"""Digests of a weight version in the form SGLang's ``/weights_checker`` reports them, computed from HF tensors.

SGLang 0.5.23's ``POST /weights_checker {"action": "checksum"}`` answers, per TP rank, one checksum per tensor of
the *served* model: the first 8 bytes of the SHA-256 of the tensor's bytes, as 16 hex digits
(``srt/utils/weight_checker.py``, ``srt/managers/mm_utils.tensor_hash``). The served model is laid out as
SGLang loads it, not as Hugging Face names it: ``q_proj``/``k_proj``/``v_proj`` are one ``qkv_proj`` and
``gate_proj``/``up_proj`` one ``gate_up_proj`` (concatenated in that order along the output dimension), a
tied ``lm_head`` is the embedding, and the vocabulary rows of the embedding and ``lm_head`` are padded with
zeros to a multiple of 64 (``VocabParallelEmbedding``). :func:`sglang_checksums` builds that layout from a
publication's HF tensors in the dtype the engine serves, so a refit can be checked tensor by tensor: what the
trainer published is what the engine holds. (TP > 1 shards the fused tensors across ranks; this covers TP 1.)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

#: HF names fused into one SGLang parameter, in concatenation order.
_FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)
#: SGLang pads the vocabulary dimension to a multiple of this (``DEFAULT_VOCAB_PADDING_SIZE``), with zero rows.
VOCAB_PADDING = 64
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_PART = re.compile(r"^(?P<prefix>.*\.)(?P<part>q_proj|k_proj|v_proj|gate_proj|up_proj)(?P<suffix>\.(weight|bias))$")


def tensor_checksum(tensor: Any) -> str:
    """SGLang's checksum of one tensor: SHA-256 of its bytes, first 8 bytes, 16 hex digits."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def sglang_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """HF tensors renamed and fused the way SGLang's Llama/Qwen-family models hold them."""
    import torch

    out: dict[str, Any] = {}
    parts: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name, tensor in state.items():
        match = _PART.match(name)
        if match is None:
            if name == "lm_head.weight" and "model.embed_tokens.weight" in state and torch.equal(
                    tensor, state["model.embed_tokens.weight"]):
                continue  # tied: SGLang holds one tensor, the embedding
            out[name] = _pad_vocab(tensor) if name in _VOCAB_TENSORS else tensor
            continue
        fused = next(f for f, members in _FUSED if match["part"] in members)
        parts.setdefault((match["prefix"], fused, match["suffix"]), {})[match["part"]] = tensor
    for (prefix, fused, suffix), members in parts.items():
        order = next(m for f, m in _FUSED if f == fused)
        if set(members) != set(order):
            raise ValueError(f"{prefix}{fused}{suffix}: the publication has {sorted(members)} of {list(order)}")
        out[f"{prefix}{fused}{suffix}"] = torch.cat([members[m] for m in order], dim=0)
    return out


def _pad_vocab(tensor: Any) -> Any:
    import torch

    extra = -tensor.shape[0] % VOCAB_PADDING
    return tensor if not extra else torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def sglang_checksums(state: Mapping[str, Any], dtype: Any = None) -> dict[str, str]:
    """Per-tensor checksums of ``state`` (HF names) as SGLang serving it in ``dtype`` reports them."""
    layout = sglang_layout(state)
    return {name: tensor_checksum(t if dtype is None or not t.is_floating_point() else t.to(dtype))
            for name, t in layout.items()}


def checksum_mismatches(expected: Mapping[str, str], served: Mapping[str, str]) -> list[str]:
    """Tensor names whose served checksum differs from, or is missing against, the expected one."""
    return sorted(name for name in expected if served.get(name) != expected[name]) + sorted(
        name for name in served if name not in expected)


__all__ = ["checksum_mismatches", "sglang_checksums", "sglang_layout", "tensor_checksum"]
