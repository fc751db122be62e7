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
checkpoint intact and no half-written one, only a ``.tmp-step_...`` sibling that never counts.

Beside the checkpoints of a ``--save DIR``::

    DIR/step_00000K/         one checkpoint per save (the name is ``checkpoint_name(K)``)
    DIR/latest               the name of the newest one, one line; replaced atomically (``write_latest``)
                             and only once its checkpoint is complete

A crash between a checkpoint's rename and the pointer's replacement leaves ``latest`` naming the previous
one, so resuming trusts the directory over the pointer: ``find_resume_checkpoint`` takes the newest
*complete* checkpoint and says why when the pointer disagrees.

The functions here do only file I/O; the collectives that gather and scatter the state live in
``relax.training.actor``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax.training.checkpoint_rotation import (
    CHECKPOINT_NAME,
    checkpoints_to_delete,
    format_size,
    interrupted_save_leftovers,
)
from relax.training.durable import atomic_write_text
from relax.weights.buckets import WEIGHTS_FILE, atomic_dir, copy_model_files, write_safetensors

__all__ = [
    "FORMAT_VERSION",
    "LATEST_FILE",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "ResumeChoice",
    "TrainerCheckpoint",
    "checkpoint_name",
    "find_resume_checkpoint",
    "hf_support_files",
    "is_complete",
    "read_latest",
    "repair_latest",
    "read_optimizer_state",
    "read_trainer_state",
    "remove_save_leftovers",
    "rotate_checkpoints",
    "write_checkpoint",
    "write_latest",
]

FORMAT_VERSION = 1
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")
log = logging.getLogger(__name__)
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


# --------------------------------------------------------------------------------------------------
# Which checkpoint to resume from


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` training steps (``step_000030``)."""
    return f"step_{step:06d}"


def is_complete(ckpt_dir: str | Path) -> bool:
    """Whether ``ckpt_dir`` is a finished checkpoint: ``atomic_dir`` renamed it into place.

    Only a finished write has its final name, so the files a checkpoint is made of (a readable
    ``trainer_state.json`` of this format, the weights, the optimizer state) being there under that name is
    the mark. A ``.tmp-*``/``.old-*`` sibling of an interrupted write is never complete, whatever it holds.
    """
    path = Path(ckpt_dir)
    if path.name.startswith((".tmp-", ".old-")) or not path.is_dir():
        return False
    if not (path / WEIGHTS_FILE).is_file() or not (path / OPTIMIZER_FILE).is_file():
        return False
    try:
        read_trainer_state(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def write_latest(save_dir: str | Path, ckpt_dir: str | Path) -> Path:
    """Point ``save_dir/latest`` at ``ckpt_dir`` (a complete checkpoint in ``save_dir``), atomically.

    Written to a temporary file, flushed to disk and ``os.replace``d: a crash leaves the old pointer or the new
    one, never an empty or half-written file. Call it only after the checkpoint itself is complete (the trainer's
    save returned), so the pointer never names a checkpoint that is not there. A checkpoint this process can see
    is checked; one it cannot (rank 0 wrote it on another node's disk) is taken on the caller's word.
    """
    root, name = Path(save_dir), Path(ckpt_dir).name
    if (root / name).exists() and not is_complete(root / name):
        raise ValueError(f"{root / name} is not a complete checkpoint; the latest pointer must not name it")
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / LATEST_FILE, name + "\n")
    return root / LATEST_FILE


def read_latest(save_dir: str | Path) -> str | None:
    """The checkpoint name ``save_dir/latest`` holds, or None when it is missing, empty or not a plain name."""
    try:
        text = (Path(save_dir) / LATEST_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and "/" not in text and "\\" not in text and text not in (".", "..") else None


@dataclass(frozen=True)
class ResumeChoice:
    """What ``--load`` resumes from: ``path`` (None: nothing to resume, start at step 0), its step and why."""

    path: Path | None
    step: int
    reason: str


def repair_latest(save_dir: str | Path, chosen: str | Path) -> bool:
    """Point ``save_dir/latest`` at ``chosen`` (the newest complete checkpoint a resume picked) when it names
    another or nothing; True when it was rewritten. A checkpoint outside ``save_dir`` changes nothing."""
    root, chosen = Path(save_dir), Path(chosen)
    if chosen.parent.resolve() != root.resolve() or read_latest(root) == chosen.name:
        return False
    write_latest(root, chosen)
    return True


def find_resume_checkpoint(load: str | Path) -> ResumeChoice:
    """The checkpoint ``--load`` resumes from, and why that one.

    * ``load`` is a checkpoint directory (it holds ``trainer_state.json``): that one, as asked; this is also
      how to resume from an older checkpoint on purpose. A ``step_*`` directory without it is an error.
    * ``load`` is a ``--save`` directory: its newest *complete* checkpoint (``is_complete``) by step, whatever
      ``latest`` says. The pointer can be stale (a crash after a checkpoint's rename, before the pointer's
      replacement), missing, or name a checkpoint that is not complete; an interrupted write (``.tmp-*``) or a
      directory without its files never counts. The reason says when the pointer was overruled.
    * No complete checkpoint there, or no such directory: ``path`` is None and ``reason`` says what was seen.
      (The caller decides; the driver then hands ``load`` to the trainer as given, since rank 0 may see a
      filesystem that this process does not.)
    """
    given = Path(load)
    if (given / STATE_FILE).is_file():
        return ResumeChoice(given, read_trainer_state(given).step, f"--load names the checkpoint {given}")
    if _CHECKPOINT_NAME.match(given.name) and given.is_dir():  # named as one, but not finished: never guess
        raise FileNotFoundError(f"{given} is not a complete checkpoint (no {STATE_FILE}); give its --save "
                                "directory to resume from the newest complete one")
    if not given.is_dir():
        return ResumeChoice(None, 0, f"{given} does not exist here")
    complete: list[tuple[int, str]] = []
    skipped: list[str] = []
    for child in sorted(given.iterdir()):
        is_checkpoint_name = _CHECKPOINT_NAME.match(child.name) is not None
        if not is_checkpoint_name and not child.name.startswith(".tmp-step_"):
            continue
        if is_checkpoint_name and is_complete(child):
            complete.append((read_trainer_state(child).step, child.name))
        elif child.is_dir():
            skipped.append(child.name)
    ignored = f"; ignored, not complete: {', '.join(skipped)}" if skipped else ""
    pointer = read_latest(given)
    if not complete:
        return ResumeChoice(None, 0, f"no complete checkpoint in {given}{ignored}")
    step, name = max(complete)
    if pointer == name:
        why = f"the newest complete checkpoint, as {LATEST_FILE} says"
    elif pointer is None:
        why = f"the newest complete checkpoint ({LATEST_FILE} is missing or unreadable)"
    elif pointer in {n for _s, n in complete}:
        why = (f"the newest complete checkpoint; {LATEST_FILE} names the older {pointer} (stale: the run stopped "
               "before it was updated)")
    else:
        why = f"the newest complete checkpoint; {LATEST_FILE} names {pointer}, which is not a complete checkpoint"
    return ResumeChoice(given / name, step, f"{name} in {given}: {why}{ignored}")


# --------------------------------------------------------------------------------------------------
# --keep-checkpoints


def rotate_checkpoints(save_dir: str | Path, keep: int) -> list[Path]:
    """Delete the complete checkpoints of ``save_dir`` that ``--keep-checkpoints keep`` no longer keeps.

    Call it after a save, once ``latest`` names the new checkpoint. Which ones is ``checkpoints_to_delete``'s
    decision over the *complete* ``step_NNNNNN`` directories here (an unfinished write is never complete, and
    nothing else is a candidate) and ``latest``. Each goes in two moves: renamed to an ``.old-`` sibling (one
    atomic step, after which it no longer counts as a checkpoint), then removed. A failure logs one line and
    the run goes on (the worst case is a checkpoint or an ``.old-*`` directory left behind). Returns the
    checkpoints deleted. A ``save_dir`` this process cannot see (rank 0 wrote it on another node's disk)
    deletes nothing.
    """
    root = Path(save_dir)
    if keep <= 0:
        return []
    try:
        complete = [c.name for c in root.iterdir() if CHECKPOINT_NAME.match(c.name) and is_complete(c)]
    except OSError as exc:
        log.warning("--keep-checkpoints: cannot list %s (%s); no checkpoint deleted", root, exc)
        return []
    deleted: list[Path] = []
    for name in checkpoints_to_delete(complete, read_latest(root), keep):
        path = root / name
        trash = root / f".old-{name}-{uuid.uuid4().hex[:8]}"
        try:
            path.rename(trash)
        except OSError as exc:
            log.warning("--keep-checkpoints: could not delete %s (%s); it stays", path, exc)
            continue
        try:
            shutil.rmtree(trash)
        except OSError as exc:
            log.warning("--keep-checkpoints: %s is no longer a checkpoint but could not be removed (%s); delete %s "
                        "by hand", path, exc, trash)
        deleted.append(path)
    if deleted:
        log.info("--keep-checkpoints %d: deleted %s", keep, ", ".join(p.name for p in deleted))
    return deleted


# --------------------------------------------------------------------------------------------------
# What interrupted saves left


def remove_save_leftovers(save_dir: str | Path) -> list[str]:
    """Remove what interrupted saves left in ``save_dir``; returns the names removed.

    Call it only once this process holds the directory's claim (the driver's start-up): a live run's checkpoint
    being written has the same name as an interrupted one. Which entries go is ``interrupted_save_leftovers``'
    decision (``.tmp-step_*``, ``.old-step_*``, ``.latest.tmp-*`` of exactly the shapes the saves write, files
    or directories alike); checkpoints, ``latest`` and the user's files stay. One info line names them and
    their total size; one warning line names those that could not be removed, and the run goes on. A
    ``save_dir`` this process cannot see removes nothing.
    """
    root = Path(save_dir)
    try:
        names = interrupted_save_leftovers(child.name for child in root.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("save dir %s: cannot list it (%s); leftovers of interrupted saves, if any, stay", root, exc)
        return []
    removed: list[str] = []
    failed: list[str] = []
    total = 0
    for name in names:
        path = root / name
        size = _disk_size(path)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:  # gone meanwhile: nothing left to remove
            continue
        except OSError as exc:
            failed.append(f"{name} ({exc.strerror or exc})")
            continue
        removed.append(name)
        total += size
    if removed:
        log.info("save dir %s: removed %d leftover%s of interrupted saves (%s) %s", root, len(removed),
                 "" if len(removed) == 1 else "s", ", ".join(removed), format_size(total))
    if failed:
        log.warning("save dir %s: could not remove %d leftover%s of interrupted saves: %s; delete by hand", root,
                    len(failed), "" if len(failed) == 1 else "s", ", ".join(failed))
    return removed


def _disk_size(path: Path) -> int:
    """Bytes of the files under ``path`` (``path`` itself when it is a file); links are not followed."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total
