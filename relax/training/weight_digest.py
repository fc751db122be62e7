"""Digests of a weight version in the form an engine's ``/weights_checker`` reports them, computed from HF tensors.

SGLang 0.5.23's ``POST /weights_checker {"action": "checksum"}`` answers, per TP rank, one checksum per tensor of
the *served* model — the first 8 bytes of the SHA-256 of the tensor's bytes, as 16 hex digits
(``srt/utils/weight_checker.py``) — and ``per_gpu_checksum``, the SHA-256 of every ``name + checksum`` in name
order (:func:`version_digest`). The built-in engine answers the same route in the same shape.

What differs between engines is the *layout* of the served model (:class:`ChecksumLayout`):

* ``sglang``: as SGLang loads a Llama/Qwen-family model, not as Hugging Face names it: ``q_proj``/``k_proj``/
  ``v_proj`` are one ``qkv_proj`` and ``gate_proj``/``up_proj`` one ``gate_up_proj`` (concatenated in that order
  along the output dimension), a tied ``lm_head`` is the embedding, and the vocabulary rows of the embedding and
  ``lm_head`` are padded with zeros to a multiple of 64 (``VocabParallelEmbedding``);
* ``hf``: the published tensors as they are (the built-in engine serves the HF model).

:func:`layout_checksums` hashes a publication in either layout without building a fused tensor: concatenating
along dimension 0 of row-major tensors concatenates their bytes, so a fused tensor's hash is the hash of its
parts' bytes in order, then the padding's zeros. ``hashlib`` releases the GIL on large buffers, so the tensors
hash on several threads at once. (TP > 1 shards the fused tensors across ranks; this covers TP 1.)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

#: HF names fused into one SGLang parameter, in concatenation order.
_FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)
#: SGLang pads the vocabulary dimension to a multiple of this (``DEFAULT_VOCAB_PADDING_SIZE``), with zero rows.
VOCAB_PADDING = 64
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
_VOCAB_TENSORS = (_EMBED, _HEAD)
_PART = re.compile(r"^(?P<prefix>.*\.)(?P<part>q_proj|k_proj|v_proj|gate_proj|up_proj)(?P<suffix>\.(weight|bias))$")
#: Threads that hash at once (hashlib releases the GIL for buffers over 2 KiB).
HASH_THREADS = 4


class ChecksumLayout(str, Enum):
    """How an engine lays out the model it serves, which is what its checksums are of."""

    SGLANG = "sglang"
    HF = "hf"


@dataclass(frozen=True)
class ServedTensor:
    """One tensor as the engine holds it: the published tensors whose bytes it is, in order, then zero bytes."""

    name: str
    parts: tuple[str, ...]
    zero_bytes: int = 0


def _row_bytes(shape: Iterable[int], itemsize: int) -> int:
    n = itemsize
    for d in list(shape)[1:]:
        n *= int(d)
    return n


def served_tensors(shapes: Mapping[str, tuple[int, ...]], itemsizes: Mapping[str, int],
                   layout: ChecksumLayout | str, *, tied_head: bool = False) -> list[ServedTensor]:
    """What the engine serves, from a publication's names and shapes (HF names, in publication order).

    ``tied_head``: the publication carries an ``lm_head`` equal to its embedding, which SGLang does not hold.
    """
    if ChecksumLayout(layout) is ChecksumLayout.HF:
        return [ServedTensor(name, (name,)) for name in shapes]
    out: list[ServedTensor] = []
    parts: dict[tuple[str, str, str], dict[str, str]] = {}
    for name, shape in shapes.items():
        match = _PART.match(name)
        if match is None:
            if name == _HEAD and tied_head:
                continue  # tied: SGLang holds one tensor, the embedding
            pad = (-int(shape[0]) % VOCAB_PADDING) * _row_bytes(shape, itemsizes[name]) if name in _VOCAB_TENSORS else 0
            out.append(ServedTensor(name, (name,), pad))
            continue
        fused = next(f for f, members in _FUSED if match["part"] in members)
        parts.setdefault((match["prefix"], fused, match["suffix"]), {})[match["part"]] = name
    for (prefix, fused, suffix), members in parts.items():
        order = next(m for f, m in _FUSED if f == fused)
        if set(members) != set(order):
            raise ValueError(f"{prefix}{fused}{suffix}: the publication has {sorted(members)} of {list(order)}")
        out.append(ServedTensor(f"{prefix}{fused}{suffix}", tuple(members[m] for m in order)))
    return out


def _raw(tensor: Any) -> memoryview:
    import torch

    return memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _hash(served: ServedTensor, tensors: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for part in served.parts:
        h.update(_raw(tensors[part]))
    if served.zero_bytes:
        h.update(bytes(served.zero_bytes))
    return h.digest()[:8].hex()


def layout_checksums(tensors: Mapping[str, Any], layout: ChecksumLayout | str, *,
                     threads: int = HASH_THREADS) -> dict[str, str]:
    """Per served tensor, the checksum the engine's ``/weights_checker`` reports for ``tensors`` (HF names, in the
    dtype the engine serves). No tensor is copied; the hashing runs on ``threads`` threads."""
    import torch

    tied = (_HEAD in tensors and _EMBED in tensors and tensors[_HEAD].shape == tensors[_EMBED].shape
            and torch.equal(tensors[_HEAD], tensors[_EMBED]))
    plan = served_tensors({n: tuple(t.shape) for n, t in tensors.items()},
                          {n: t.element_size() for n, t in tensors.items()}, layout, tied_head=tied)
    work: Callable[[ServedTensor], str] = lambda served: _hash(served, tensors)  # noqa: E731
    if threads <= 1:
        return {s.name: work(s) for s in plan}
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="relax-digest") as pool:
        return dict(zip((s.name for s in plan), pool.map(work, plan), strict=True))


def version_digest(checksums: Mapping[str, str]) -> str:
    """One digest of a whole version: SGLang's ``per_gpu_checksum`` (SHA-256 of each name + checksum, in name
    order), so an engine's answer and the trainer's publication compare as one string."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def tensor_checksum(tensor: Any) -> str:
    """SGLang's checksum of one tensor: SHA-256 of its bytes, first 8 bytes, 16 hex digits."""
    return hashlib.sha256(_raw(tensor)).digest()[:8].hex()


def sglang_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """HF tensors renamed, fused and padded the way SGLang's Llama/Qwen-family models hold them (copies: for
    tests and tools that want the tensors themselves; :func:`layout_checksums` hashes without them)."""
    import torch

    tied = _HEAD in state and _EMBED in state and torch.equal(state[_HEAD], state[_EMBED])
    plan = served_tensors({n: tuple(t.shape) for n, t in state.items()},
                          {n: t.element_size() for n, t in state.items()}, ChecksumLayout.SGLANG, tied_head=tied)
    out: dict[str, Any] = {}
    for served in plan:
        fused = torch.cat([state[p] for p in served.parts], dim=0) if len(served.parts) > 1 else state[served.parts[0]]
        if served.zero_bytes:
            rows = served.zero_bytes // _row_bytes(fused.shape, fused.element_size())
            fused = torch.cat([fused, fused.new_zeros((rows, *fused.shape[1:]))])
        out[served.name] = fused
    return out


def sglang_checksums(state: Mapping[str, Any], dtype: Any = None) -> dict[str, str]:
    """Per-tensor checksums of ``state`` (HF names) as SGLang serving it in ``dtype`` reports them."""
    cast = {n: t if dtype is None or not t.is_floating_point() else t.to(dtype) for n, t in state.items()}
    return layout_checksums(cast, ChecksumLayout.SGLANG)


def checksum_mismatches(expected: Mapping[str, str], served: Mapping[str, str]) -> list[str]:
    """Tensor names whose served checksum differs from, or is missing against, the expected one."""
    return sorted(name for name in expected if served.get(name) != expected[name]) + sorted(
        name for name in served if name not in expected)


__all__ = ["ChecksumLayout", "ServedTensor", "checksum_mismatches", "layout_checksums", "served_tensors",
           "sglang_checksums", "sglang_layout", "tensor_checksum", "version_digest"]
