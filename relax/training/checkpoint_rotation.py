"""What goes from a ``--save`` directory: pure decisions over names (no file I/O).

Which checkpoints ``--keep-checkpoints N`` deletes (``checkpoints_to_delete``), and which entries are what
interrupted saves left behind (``interrupted_save_leftovers``).

The rule: of the complete checkpoints of a ``--save`` directory, keep the newest ``keep`` by step (the step is
the number in ``step_NNNNNN``, the order ``--load DIR`` resumes by), and always the one ``latest`` names;
``keep == 0`` keeps all. Only names of the ``step_NNNNNN`` form are ever candidates: anything else in the
directory (``latest``, an unfinished ``.tmp-step_*`` write, files of the user's) is not the rule's to delete,
and the caller passes only checkpoints that are complete, so one being written is never among them.

The leftovers: a checkpoint is written under ``.tmp-step_NNNNNN-<8 hex>`` and renamed into place
(``weights.buckets.atomic_dir``); a replaced or rotated one is renamed to ``.old-step_NNNNNN-<8 hex>`` and then
removed (``atomic_dir``, ``checkpoint.rotate_checkpoints``); ``latest`` is replaced through
``.latest.tmp-<8 hex>`` (``durable.atomic_write_text``). A process killed between those steps leaves the
sibling behind (a step one as large as a checkpoint) and nothing of a later run ever reads it. Only these exact
shapes are leftovers: a user's ``.tmp-notes`` or ``step_000010.bak`` is not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["CHECKPOINT_NAME", "LEFTOVER_NAME", "checkpoint_step", "checkpoints_to_delete", "format_size",
           "interrupted_save_leftovers"]

CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})$")
"""A checkpoint directory's name (``checkpoint_name``: ``step_%06d``)."""

_STEP = CHECKPOINT_NAME.pattern.removeprefix("^").removesuffix("$")
LEFTOVER_NAME = re.compile(rf"^(?:\.tmp-{_STEP}|\.old-{_STEP}|\.latest\.tmp)-[0-9a-f]{{8}}$")
"""What an interrupted save leaves in a ``--save`` directory: ``.tmp-step_*``, ``.old-step_*``, ``.latest.tmp-*``."""


def checkpoint_step(name: str) -> int | None:
    """The step of a ``step_NNNNNN`` name, or None for any other name."""
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def checkpoints_to_delete(complete: Iterable[str], latest: str | None, keep: int) -> list[str]:
    """Names among ``complete`` (complete checkpoints of one ``--save`` directory) to delete, oldest first.

    Keeps the ``keep`` newest by step and the one ``latest`` names (so ``keep + 1`` remain when ``latest``
    is older than the newest ``keep``, e.g. after a crash left it stale); ``keep <= 0`` deletes nothing.
    Names that are not ``step_NNNNNN`` are never returned.
    """
    if keep <= 0:
        return []
    steps = sorted({(step, name) for name in complete if (step := checkpoint_step(name)) is not None})
    older = steps[:-keep] if len(steps) > keep else []
    return [name for _step, name in older if name != latest]


def interrupted_save_leftovers(names: Iterable[str]) -> list[str]:
    """Names among ``names`` (the entries of one ``--save`` directory) that interrupted saves left, sorted.

    Only safe to act on while no other process saves into the directory: a live run's write in progress has
    the same name as an interrupted one. The caller holds the directory's claim first.
    """
    return sorted(name for name in names if LEFTOVER_NAME.match(name))


def format_size(num_bytes: int) -> str:
    """``num_bytes`` for a log line, in decimal units as ``du --si`` and disk vendors count (``1.2 GB``)."""
    if num_bytes < 1000:
        return f"{num_bytes} B"
    size = num_bytes / 1000
    for unit in ("kB", "MB", "GB"):
        if round(size, 1) < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
