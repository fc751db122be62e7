"""SGLang's ``flattened_bucket`` wire format: one bucket of named tensors as one uint8 buffer.

A broadcast weight update (``/update_weights_from_distributed`` with ``load_format: "flattened_bucket"``)
moves a bucket as a single collective instead of one per tensor: the sender views every tensor's bytes as
uint8 and concatenates them in ``names`` order; the receiver, which gets ``names``, ``dtypes`` and ``shapes``
in the HTTP body, allocates one buffer of the total size, receives it and cuts it back into tensors at the
cumulative byte offsets. One collective per 64 MiB bucket keeps the per-call overhead (a gloo/NCCL round
trip each) negligible; per-tensor broadcasts of a 300-tensor model pay it 300 times.

The receiver views each slice as its dtype, which needs every offset to be a multiple of that dtype's size
(SGLang's rule). ``BucketSpec.of`` orders a bucket's tensors by decreasing element size, which makes that
true for any mix of dtypes (sizes are powers of two, and each tensor's byte count is a multiple of its own
element size, so of every smaller one after it). Pure torch: no Ray, no process group. The rollout manager
only cuts manifests into specs (``specs_from_manifest``, ``to_body``) and never imports torch, so torch is
imported where a function works on tensors or element sizes, not with the module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BucketSpec", "dtype_from_name", "flatten", "specs_from_manifest", "unflatten"]

@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: dtype for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype)}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` → ``torch.bfloat16``; a clear error for anything else."""
    key = name.removeprefix("torch.")
    dtype = _dtypes().get(key)
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as 'bfloat16' or 'float32')")
    return dtype


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


@dataclass(frozen=True)
class BucketSpec:
    """What the receiver is told about one bucket: names, dtypes and shapes, in wire order."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names ({len(self.names)}), dtypes ({len(self.dtypes)}) and shapes "
                             f"({len(self.shapes)}) must have the same length")
        if len(set(self.names)) != len(self.names):
            raise ValueError("a bucket names a tensor twice")

    @classmethod
    def of(cls, bucket: Mapping[str, torch.Tensor]) -> BucketSpec:
        """The spec of ``bucket`` in wire order (largest element size first, else as given)."""
        order = sorted(bucket, key=lambda n: -bucket[n].element_size())  # stable: keeps order within a size
        return cls(tuple(order), tuple(str(bucket[n].dtype).removeprefix("torch.") for n in order),
                   tuple(tuple(bucket[n].shape) for n in order))

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(s, dtype_from_name(d)) for s, d in zip(self.shapes, self.dtypes, strict=True))

    def offsets(self) -> list[int]:
        """Byte offset of each tensor in the flat buffer; raises when one is misaligned for its dtype."""
        out, at = [], 0
        for name, shape, dtype_name in zip(self.names, self.shapes, self.dtypes, strict=True):
            dtype = dtype_from_name(dtype_name)
            size = dtype.itemsize
            if at % size:
                raise ValueError(f"tensor {name!r} ({dtype_name}) starts at byte {at}, not a multiple of {size}: "
                                 "order the bucket's tensors by decreasing element size")
            out.append(at)
            at += _nbytes(shape, dtype)
        return out

    def to_body(self) -> dict[str, list]:
        """The ``names``/``dtypes``/``shapes`` fields of an ``/update_weights_from_distributed`` body."""
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes]}


def flatten(bucket: Mapping[str, torch.Tensor], spec: BucketSpec | None = None,
            device: torch.device | str | None = None,
            out: torch.Tensor | None = None) -> tuple[torch.Tensor, BucketSpec]:
    """``bucket`` as one contiguous uint8 buffer (a copy, so later training steps cannot change it).

    ``out``, when given, is a uint8 buffer of exactly the bucket's size to copy into (reused memory).
    """
    import torch

    spec = spec or BucketSpec.of(bucket)
    first = bucket[spec.names[0]] if spec.names else None
    target = torch.device(device) if device is not None else (first.device if first is not None else None)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != spec.nbytes):
        raise ValueError(f"out must be a uint8 buffer of {spec.nbytes} bytes, got {out.dtype} x {out.numel()}")
    out = out if out is not None else torch.empty(spec.nbytes, dtype=torch.uint8, device=target)
    for name, at in zip(spec.names, spec.offsets(), strict=True):
        t = bucket[name].detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        out[at:at + raw.numel()].copy_(raw)
    return out, spec


def unflatten(buffer: torch.Tensor, spec: BucketSpec) -> dict[str, torch.Tensor]:
    """The named tensors of a received buffer: views into it, no copy."""
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, got {buffer.dtype} of shape {tuple(buffer.shape)}")
    if buffer.numel() != spec.nbytes:
        raise ValueError(f"buffer holds {buffer.numel()} bytes, the bucket's tensors need {spec.nbytes}")
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype_name, at in zip(spec.names, spec.shapes, spec.dtypes, spec.offsets(), strict=True):
        dtype = dtype_from_name(dtype_name)
        n = _nbytes(shape, dtype)
        out[name] = buffer[at:at + n].view(dtype).view(shape)
    return out


def specs_from_manifest(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        bucket_sizes: Sequence[int]) -> list[BucketSpec]:
    """Cut a manifest's flat lists back into per-bucket specs (``bucket_sizes`` tensors each, in order)."""
    if sum(bucket_sizes) != len(names):
        raise ValueError(f"bucket sizes sum to {sum(bucket_sizes)}, the manifest has {len(names)} tensors")
    specs, at = [], 0
    for size in bucket_sizes:
        specs.append(BucketSpec(tuple(names[at:at + size]), tuple(dtypes[at:at + size]),
                                tuple(tuple(int(d) for d in s) for s in shapes[at:at + size])))
        at += size
    return specs
