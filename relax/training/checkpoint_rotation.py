"""Which checkpoints ``--keep-checkpoints N`` deletes: a pure decision over names (no file I/O).

The rule: of the complete checkpoints of a ``--save`` directory, keep the newest ``keep`` by step (the step is
the number in ``step_NNNNNN``, the order ``--load DIR`` resumes by), and always the one ``latest`` names;
``keep == 0`` keeps all. Only names of the ``step_NNNNNN`` form are ever candidates: anything else in the
directory (``latest``, an unfinished ``.tmp-step_*`` write, files of the user's) is not the rule's to delete,
and the caller passes only checkpoints that are complete, so one being written is never among them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["CHECKPOINT_NAME", "checkpoint_step", "checkpoints_to_delete"]

CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})$")
"""A checkpoint directory's name (``checkpoint_name``: ``step_%06d``)."""


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
