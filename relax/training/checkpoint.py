"""Trainer checkpoints on disk: HF weights + full optimizer state + a small JSON of run state.

Layout of one checkpoint directory::

    model.safetensors        full weights, HF names (what ``save_pretrained`` writes): loadable by
                             ``AutoModelForCausalLM.from_pretrained`` and by SGLang as-is
    config.json, generation_config.json, tokenizer files, chat template
                             copied from the run's ``--hf-checkpoint``
    optimizer.pt             the *full* (unsharded) optimizer state, keyed by parameter FQN, as
                             ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(
                             full_state_dict=True)`` returns it
    trainer_state.json       {"format_version", "step", "world_size", "extra": {...caller's JSON...}}

Why full state dicts written by rank 0 rather than per-rank shards: a checkpoint then does not depend on
the world size (resume on more or fewer trainer GPUs, or publish it as a plain HF model), and only rank
0's node needs the filesystem. The price is that rank 0 holds the full model + optimizer state in CPU
memory while saving, which is fine for the model sizes this project targets (<= ~8 B on one node).
The directory appears atomically (``weights.atomic_dir``): a crash mid-save leaves the previous
checkpoint intact and no half-written one.

The functions here do only file I/O; the collectives that gather and scatter the state live in
``relax.training.actor``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax.training.weights import WEIGHTS_FILE, atomic_dir, copy_model_files, write_safetensors

__all__ = [
    "FORMAT_VERSION",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "TrainerCheckpoint",
    "hf_support_files",
    "read_optimizer_state",
    "read_trainer_state",
    "write_checkpoint",
]

FORMAT_VERSION = 1
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
#: Files of an HF checkpoint that are not weights and that a checkpoint carries along.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".gguf", ".msgpack", ".h5")


@dataclass(frozen=True)
class TrainerCheckpoint:
    """The run state stored next to the weights."""

    step: int
    world_size: int
    extra: dict[str, Any]


def hf_support_files(hf_dir: str | Path) -> list[str]:
    """Names of the top-level non-weight files (config, tokenizer, chat template) in an HF directory."""
    return sorted(
        p.name for p in Path(hf_dir).iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
    )


def write_checkpoint(
    out_dir: str | Path,
    *,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    hf_dir: str | Path,
    state: TrainerCheckpoint,
) -> Path:
    """Write a complete checkpoint atomically (rank 0 only)."""
    if not isinstance(state.extra, dict):
        raise TypeError(f"extra must be a dict, got {type(state.extra).__name__}")
    payload = json.dumps(
        {"format_version": FORMAT_VERSION, "step": state.step, "world_size": state.world_size,
         "saved_at": time.time(), "extra": state.extra},
        indent=2,
    )  # serialise first: a non-JSON ``extra`` fails before any file is written

    def fill(tmp: Path) -> None:
        write_safetensors(model_state, tmp / WEIGHTS_FILE)
        copy_model_files(hf_dir, tmp, hf_support_files(hf_dir))
        torch.save(dict(optimizer_state), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(payload)

    return atomic_dir(out_dir, fill)


def read_trainer_state(ckpt_dir: str | Path) -> TrainerCheckpoint:
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a trainer checkpoint (no {STATE_FILE})")
    data = json.loads(path.read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {data.get('format_version')!r}")
    return TrainerCheckpoint(int(data["step"]), int(data["world_size"]), dict(data.get("extra") or {}))


def read_optimizer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The full optimizer state dict (CPU tensors); ``weights_only`` because checkpoints may travel."""
    return torch.load(Path(ckpt_dir) / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
