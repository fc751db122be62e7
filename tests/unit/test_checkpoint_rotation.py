"""--keep-checkpoints N: the rule (pure, over names) and the deletion after a save (on a temporary directory)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from relax.config.flags import ConfigError, parse_args
from relax.training.checkpoint import (
    OPTIMIZER_FILE,
    STATE_FILE,
    checkpoint_name,
    find_resume_checkpoint,
    rotate_checkpoints,
    write_latest,
)
from relax.training.checkpoint_rotation import checkpoints_to_delete
from relax.weights.buckets import WEIGHTS_FILE

# ---------------------------------------------------------------------------------------------- the rule


def names(*steps: int) -> list[str]:
    return [checkpoint_name(s) for s in steps]


def test_keeps_the_newest_n_by_step_and_deletes_the_rest_oldest_first() -> None:
    # given in no particular order: the order is the step's, not the listing's
    assert checkpoints_to_delete(names(40, 10, 30, 20, 50), "step_000050", 3) == names(10, 20)


def test_zero_keeps_all() -> None:
    assert checkpoints_to_delete(names(10, 20, 30), "step_000030", 0) == []


def test_fewer_than_n_deletes_nothing() -> None:
    assert checkpoints_to_delete(names(10, 20), "step_000020", 3) == []
    assert checkpoints_to_delete([], None, 1) == []


def test_the_checkpoint_latest_names_is_never_deleted() -> None:
    # latest stale (a crash between a checkpoint's rename and the pointer's update): it stays, N+1 remain
    assert checkpoints_to_delete(names(10, 20, 30), "step_000010", 1) == names(20)
    assert checkpoints_to_delete(names(10, 20, 30), "step_000020", 1) == names(10)


def test_steps_sort_numerically_beyond_six_digits() -> None:
    assert checkpoints_to_delete(names(999_999, 1_000_000), "step_1000000", 1) == ["step_999999"]


def test_only_step_nnnnnn_names_are_candidates() -> None:
    listing = [*names(10, 20, 30), "latest", ".tmp-step_000040-abcd1234", ".old-step_000005-abcd1234", "step_7",
               "step_000010.bak", "notes.txt", "Step_000001"]
    assert checkpoints_to_delete(listing, "step_000030", 1) == names(10, 20)


# ---------------------------------------------------------------------------------------------- the deletion


def fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / WEIGHTS_FILE).write_bytes(b"w")
    (path / STATE_FILE).write_text(json.dumps({"format_version": 1, "step": step, "world_size": 1}))
    if complete:
        (path / OPTIMIZER_FILE).write_bytes(b"o")
    return path


def test_rotation_after_each_save_keeps_n_and_leaves_everything_else(tmp_path: Path) -> None:
    (tmp_path / ".tmp-step_000070-abcd1234").mkdir()  # a write in progress (or interrupted)
    fake_checkpoint(tmp_path, 5, complete=False)  # named as a checkpoint but not complete: not the rule's
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_000001.bak").mkdir()
    for step in (10, 20, 30, 40, 50):
        write_latest(tmp_path, fake_checkpoint(tmp_path, step))
        rotate_checkpoints(tmp_path, 2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".tmp-step_000070-abcd1234", "latest", "notes.txt", "step_000001.bak", "step_000005",
                    "step_000040", "step_000050"]
    assert find_resume_checkpoint(tmp_path).step == 50


def test_zero_deletes_nothing(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        write_latest(tmp_path, fake_checkpoint(tmp_path, step))
    assert rotate_checkpoints(tmp_path, 0) == []
    assert len(list(tmp_path.glob("step_*"))) == 3


def test_a_failed_deletion_logs_one_line_and_does_not_raise(tmp_path: Path, caplog, monkeypatch) -> None:
    for step in (10, 20, 30):
        write_latest(tmp_path, fake_checkpoint(tmp_path, step))
    real_rename = Path.rename

    def refuse_first(self: Path, target):
        if self.name == "step_000010":
            raise PermissionError(13, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse_first)
    with caplog.at_level(logging.WARNING):
        deleted = rotate_checkpoints(tmp_path, 1)
    assert [p.name for p in deleted] == ["step_000020"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000010", "step_000030"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "step_000010" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()


def test_a_save_directory_this_process_cannot_see_deletes_nothing(tmp_path: Path) -> None:
    assert rotate_checkpoints(tmp_path / "elsewhere", 2) == []


# ---------------------------------------------------------------------------------------------- the flag


def test_the_flag_defaults_to_keep_all_and_needs_save() -> None:
    assert parse_args(["--hf-checkpoint", "m"]).keep_checkpoints == 0
    assert parse_args(["--hf-checkpoint", "m", "--save", "/c", "--keep-checkpoints", "3"]).keep_checkpoints == 3
    with pytest.raises(ConfigError, match="--keep-checkpoints 3 needs --save DIR"):
        parse_args(["--hf-checkpoint", "m", "--keep-checkpoints", "3"])
    with pytest.raises(ConfigError, match="--keep-checkpoints: must be an integer >= 0, got '-1'"):
        parse_args(["--hf-checkpoint", "m", "--keep-checkpoints", "-1"])
