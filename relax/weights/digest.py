"""Digests of a weight version in the form an engine's ``/weights_checker`` reports them, computed from HF tensors.

SGLang 0.5.23's ``POST /weights_checker {"action": "checksum"}`` answers, per TP rank, one checksum per tensor of
the *served* model — the first 8 bytes of the SHA-256 of the tensor's bytes, as 16 hex digits
(``srt/utils/weight_checker.py``) — and ``per_gpu_checksum``, the SHA-256 of every ``name + checksum`` in name
order (:func:`version_digest`). The built-in engine answers the same route in the same shape.

What differs between engines is the *layout* of the served model (:class:`ChecksumLayout`) and the *hash*
(:class:`ChecksumAlgorithm`): SGLang hashes a tensor with SHA-256 on the CPU but, when it lives on a GPU, with
its own Triton kernel (``sglang/kernels/ops/memory/gpu_tensor_hash.py``: position-mixed 32-bit words summed per
tile, reduced to 64 bits); :func:`sglang_gpu_hash` is that hash in plain torch, so rank 0 can compute what a GPU
engine will answer (tests/sglang/test_gpu_hash.py holds it against SGLang's own kernel, run by Triton's
interpreter). :func:`checksum_algorithm` says which one an engine uses, from its ``/server_info``.

The layouts:

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


class ChecksumAlgorithm(str, Enum):
    """How an engine hashes one served tensor (both answered as 16 hex digits)."""

    SHA256 = "sha256"  # SHA-256, first 8 bytes: SGLang on CPU, the built-in engine
    SGLANG_GPU = "sglang-gpu"  # SGLang's Triton tile hash, for tensors on a GPU


def checksum_algorithm(server_info: Mapping[str, Any]) -> ChecksumAlgorithm:
    """The hash an engine's ``/weights_checker`` uses, from its ``/server_info``: SGLang's GPU hash when it serves
    from CUDA, SHA-256 otherwise (the built-in engine always hashes with SHA-256)."""
    if server_info.get("engine") == "relax-builtin":
        return ChecksumAlgorithm.SHA256
    device = str(server_info.get("device") or "cuda")  # SGLang's default device is cuda
    return ChecksumAlgorithm.SGLANG_GPU if device.startswith("cuda") else ChecksumAlgorithm.SHA256


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


def _hash(served: ServedTensor, tensors: Mapping[str, Any], algorithm: ChecksumAlgorithm) -> str:
    if algorithm is ChecksumAlgorithm.SGLANG_GPU:
        return f"{sglang_gpu_hash(_served_bytes(served, tensors)):016x}"
    h = hashlib.sha256()
    for part in served.parts:
        h.update(_raw(tensors[part]))
    if served.zero_bytes:
        h.update(bytes(served.zero_bytes))
    return h.digest()[:8].hex()


def _served_bytes(served: ServedTensor, tensors: Mapping[str, Any]) -> Any:
    """The served tensor's bytes as one uint8 tensor (a copy when fused or padded: the GPU hash needs them whole)."""
    import torch

    parts = [tensors[p].detach().contiguous().reshape(-1).view(torch.uint8) for p in served.parts]
    if served.zero_bytes:
        parts.append(torch.zeros(served.zero_bytes, dtype=torch.uint8, device=parts[0].device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def layout_checksums(tensors: Mapping[str, Any], layout: ChecksumLayout | str, *,
                     algorithm: ChecksumAlgorithm | str = ChecksumAlgorithm.SHA256,
                     threads: int = HASH_THREADS) -> dict[str, str]:
    """Per served tensor, the checksum the engine's ``/weights_checker`` reports for ``tensors`` (HF names, in the
    dtype the engine serves), hashed with ``algorithm``. SHA-256 copies no tensor and runs on ``threads``
    threads; the GPU hash runs where the tensors are (on rank 0's GPU with NCCL)."""
    import torch

    tied = (_HEAD in tensors and _EMBED in tensors and tensors[_HEAD].shape == tensors[_EMBED].shape
            and torch.equal(tensors[_HEAD], tensors[_EMBED]))
    plan = served_tensors({n: tuple(t.shape) for n, t in tensors.items()},
                          {n: t.element_size() for n, t in tensors.items()}, layout, tied_head=tied)
    algorithm = ChecksumAlgorithm(algorithm)
    work: Callable[[ServedTensor], str] = lambda served: _hash(served, tensors, algorithm)  # noqa: E731
    if threads <= 1 or algorithm is ChecksumAlgorithm.SGLANG_GPU:
        return {s.name: work(s) for s in plan}
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="relax-digest") as pool:
        return dict(zip((s.name for s in plan), pool.map(work, plan), strict=True))


# SGLang's GPU tensor hash (its constants and steps; the kernel's tile is 8192 words)
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_POS_A, _POS_B = 0x27D4EB2D, 0x165667B1
_SEED = 0x243F6A88
_TILE_WORDS = 8192
_CHUNK_TILES = 256  # tiles hashed per pass (2M words): bounded temporaries for any tensor size


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for uint32 values held in int64, without overflowing int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _rotl32(x: Any, r: int) -> Any:
    return ((x << r) | (x >> (32 - r))) & _M32


def _fmix32(x: Any) -> Any:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def sglang_gpu_hash(tensor: Any, seed: int = _SEED) -> int:
    """SGLang's ``gpu_tensor_hash`` of ``tensor``'s bytes, in torch on whatever device the tensor is on.

    The bytes are read as little-endian uint32 words (zero-padded to a multiple of 4); word ``i`` is mixed with its
    position under two seeds and finalized (murmur3's fmix32); each tile of 8192 words sums both streams mod 2**32,
    xors in the padded byte count and finalizes them into one 64-bit value; the tiles' values are summed mod 2**64
    and finished with splitmix64.
    """
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    words = raw.view(torch.int32)
    n = words.numel()
    if n == 0:
        return 0
    seed1 = seed & _M32
    seed2 = ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    total_hi = total_lo = 0
    step = _CHUNK_TILES * _TILE_WORDS
    for start in range(0, n, step):
        v = words[start:start + step].to(torch.int64) & _M32
        idx = torch.arange(start, start + v.numel(), dtype=torch.int64, device=v.device)
        p1 = ((_mul32(idx, _POS_A) + seed1) & _M32) ^ _rotl32(idx, 15)
        p2 = ((_mul32(idx, _POS_B) + seed2) & _M32) ^ _rotl32(idx, 13)
        k1, k2 = _fmix32(v ^ p1), _fmix32(v ^ p2)
        tail = -v.numel() % _TILE_WORDS  # a partial last tile: its missing words count as nothing
        if tail:
            k1 = torch.cat([k1, k1.new_zeros(tail)])
            k2 = torch.cat([k2, k2.new_zeros(tail)])
        h1 = _fmix32((k1.view(-1, _TILE_WORDS).sum(dim=1) & _M32) ^ nbytes)
        h2 = _fmix32((k2.view(-1, _TILE_WORDS).sum(dim=1) & _M32) ^ nbytes)
        total_hi += int(h1.sum())
        total_lo += int(h2.sum())
    x = ((total_hi << 32) + total_lo) & _M64  # the sum of (h1 << 32 | h2) over tiles, mod 2**64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


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


def sglang_checksums(state: Mapping[str, Any], dtype: Any = None,
                     algorithm: ChecksumAlgorithm | str = ChecksumAlgorithm.SHA256) -> dict[str, str]:
    """Per-tensor checksums of ``state`` (HF names) as SGLang serving it in ``dtype`` reports them."""
    cast = {n: t if dtype is None or not t.is_floating_point() else t.to(dtype) for n, t in state.items()}
    return layout_checksums(cast, ChecksumLayout.SGLANG, algorithm=algorithm)


def checksum_mismatches(expected: Mapping[str, str], served: Mapping[str, str]) -> list[str]:
    """Tensor names whose served checksum differs from, or is missing against, the expected one."""
    return sorted(name for name in expected if served.get(name) != expected[name]) + sorted(
        name for name in served if name not in expected)


__all__ = ["ChecksumAlgorithm", "ChecksumLayout", "ServedTensor", "checksum_algorithm", "checksum_mismatches",
           "layout_checksums", "served_tensors", "sglang_checksums", "sglang_gpu_hash", "sglang_layout",
           "tensor_checksum", "version_digest"]
