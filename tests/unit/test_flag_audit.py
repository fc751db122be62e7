"""No flag is accepted and then ignored: every field of the parsed arguments is read by the program (outside the
parser and its checks), or it is one of the few listed here with why nothing needs to read it.

"Read" is found in the source: an attribute of that name used anywhere in ``relax/`` except ``config/flags.py``
(``args.x``, ``a.x``), or a field of ``TrainerConfig``, which takes the same-named fields of the arguments
(``TrainerConfig.from_args``) and whose fields are then themselves checked here.
"""

from __future__ import annotations

import ast
import dataclasses
from functools import cache
from pathlib import Path

from relax.config.flags import TrainArgs
from relax.training.actor import TrainerConfig

ROOT = Path(__file__).resolve().parents[2] / "relax"

#: Fields nothing reads, and why that is honest: each accepted value is what Relax does anyway.
NOTHING_TO_READ = {
    "fully_async": "the only mode Relax runs (--colocate is refused with one line)",
    "advantage_estimator": "grpo, the only value accepted (any other is refused with one line)",
    "ignored_flags": "the list of Megatron-only flags itself, said in one warning line",
}
#: Fields read through a property of the arguments.
READ_THROUGH = {"tensorboard_dir": "resolved_tensorboard_dir"}


@cache
def attributes_read(exclude: tuple[str, ...]) -> set[str]:
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).as_posix() in exclude:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def test_every_parsed_flag_is_read_or_listed_with_its_reason() -> None:
    read = attributes_read(exclude=("config/flags.py",))
    trainer = {f.name for f in dataclasses.fields(TrainerConfig)}
    unread = []
    for field in dataclasses.fields(TrainArgs):
        name = field.name
        if name in NOTHING_TO_READ:
            continue
        if name in trainer or name in read or READ_THROUGH.get(name) in read:
            continue
        unread.append(name)
    assert not unread, f"flags parsed but never read (read them, or list them with a reason): {unread}"


def test_the_trainer_reads_every_field_it_takes() -> None:
    read = attributes_read(exclude=())
    unread = [f.name for f in dataclasses.fields(TrainerConfig) if f.name not in read]
    assert not unread, f"TrainerConfig fields nothing reads: {unread}"


def test_the_lists_name_real_fields() -> None:
    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    assert set(NOTHING_TO_READ) <= fields and set(READ_THROUGH) <= fields
