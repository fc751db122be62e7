"""Weight publication pieces: buckets and on-disk copies (the manifest and the registry of published
versions: ``relax.weights.publication``, torch-free for the rollout manager).

(docs/architecture.md, "Weights and staleness".)

The path of one version: trainer rank 0 gathers the full state dict, ``make_buckets`` cuts it into
pieces of about ``bucket_bytes`` (so no single object-store object is huge and pulls can stream; with
``dtype=torch.bfloat16`` for bf16 engines, half the bytes of the fp32 master weights), the
buckets go into Ray's object store, and the ``WeightRegistry`` (inside the RolloutManager) records
``version -> (bucket refs, manifest)``. Each engine pulls the buckets of a version, ``materialize``
writes them as an HF-loadable directory in node-local shared memory, and the engine's server loads it
with ``/update_weights_from_disk``. One path for SGLang and the built-in engine, and a joining engine
simply pulls the latest version.

Everything here is pure Python + torch + safetensors: no Ray import, so it is unit-tested without a
cluster; the registry stores whatever "refs" it is given (Ray ``ObjectRef`` objects in production).
"""

from __future__ import annotations

import logging
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MODEL_FILES",
    "WEIGHTS_FILE",
    "atomic_dir",
    "cleanup_old",
    "copy_model_files",
    "make_buckets",
    "materialize",
    "merge_buckets",
    "publish_tensor",
    "version_dir",
    "write_safetensors",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
WEIGHTS_FILE = "model.safetensors"
#: The non-weight files an engine needs next to the weights to reload them.
MODEL_FILES = ("config.json", "generation_config.json")
_VERSION_DIR = re.compile(r"^v(\d+)$")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------
# Buckets and manifests


def publish_tensor(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as published: floating tensors cast to ``dtype`` (None: as they are), others untouched.

    Integer and bool buffers (position ids, masks, quantisation indices) keep their dtype: a cast would
    change their values or meaning, and they are small.
    """
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def make_buckets(
    state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
    dtype: torch.dtype | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Cut a state dict into consecutive buckets of at most ``bucket_bytes`` each (order kept).

    A tensor larger than the limit gets a bucket of its own rather than being split: engines load whole
    tensors, and a 1 GiB embedding in one object is still fine for the object store. An empty state dict
    gives no buckets.

    ``dtype`` is the publication dtype: the trainer gathers fp32 master weights, but engines that serve
    bf16 (SGLang on GPU loads a bf16 checkpoint) would cast them on load anyway, so publishing bf16 halves
    the bytes through the object store and shared memory for the same weights the engine ends up with.
    Floating tensors only (``publish_tensor``); None publishes as gathered (the built-in engine on CPU is
    fp32). Sizes, and so the cut, are those of the published tensors.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, original in state_dict.items():
        tensor = publish_tensor(original, dtype)
        n = _nbytes(tensor)
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += n
    if current:
        buckets.append(current)
    return buckets


def merge_buckets(buckets: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Buckets back into one state dict; a name in two buckets is a publication bug, so it raises."""
    merged: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        for name, tensor in bucket.items():
            if name in merged:
                raise ValueError(f"tensor {name!r} appears in more than one bucket")
            merged[name] = tensor
    return merged


# --------------------------------------------------------------------------------------------------
# On disk


def atomic_dir(out_dir: str | Path, fill: Callable[[Path], None]) -> Path:
    """Create ``out_dir`` by filling a temporary sibling and renaming it into place.

    Readers (an engine's loader, a resuming trainer) never see a half-written directory: the rename is
    atomic on one filesystem. An existing ``out_dir`` is replaced (re-pulling a version, or re-saving a
    checkpoint after a crash); on failure the temporary directory is removed and nothing changes.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        if out.exists():
            trash = out.parent / f".old-{out.name}-{uuid.uuid4().hex[:8]}"
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_safetensors(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """``save_pretrained``-compatible safetensors (contiguous CPU tensors, ``format=pt`` metadata)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def copy_model_files(src_dir: str | Path, dst_dir: str | Path, names: Iterable[str] = MODEL_FILES) -> list[str]:
    """Copy the named files that exist in ``src_dir``; ``config.json`` is required (engines need it)."""
    src, dst = Path(src_dir), Path(dst_dir)
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    if "config.json" in names and "config.json" not in copied:
        raise FileNotFoundError(f"{src} has no config.json")
    return copied


def materialize(
    buckets: Sequence[Mapping[str, torch.Tensor]], config_dir: str | Path, out_dir: str | Path
) -> Path:
    """Write one version as a directory an engine can load with ``/update_weights_from_disk``.

    ``model.safetensors`` holds every tensor of every bucket; ``config.json`` and
    ``generation_config.json`` come from ``config_dir`` (the run's HF checkpoint). Atomic (``atomic_dir``).
    """
    state = merge_buckets(buckets)

    def fill(tmp: Path) -> None:
        write_safetensors(state, tmp / WEIGHTS_FILE)
        copy_model_files(config_dir, tmp)

    return atomic_dir(out_dir, fill)


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{int(version)}"


def cleanup_old(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` highest ``v<N>`` directories under ``root``; returns what was removed.

    Shared memory is RAM: an engine that kept every version would eat the node's memory in a few dozen
    steps. Other entries (temporary directories of a write in progress) are left alone.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    base = Path(root)
    if not base.is_dir():
        return []
    versions = sorted(
        ((int(m.group(1)), p) for p in base.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))),
    )
    doomed = [p for _, p in versions[: max(0, len(versions) - keep)]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
