"""What interrupted saves leave in a --save directory: which names they are (pure), their removal once the run
holds the directory (on a temporary directory), and the refusal that keeps another live run's writes safe."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax.training import durable
from relax.training.checkpoint import (
    LATEST_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    checkpoint_name,
    find_resume_checkpoint,
    read_latest,
    remove_save_leftovers,
    rotate_checkpoints,
    write_latest,
)
from relax.training.checkpoint_rotation import format_size, interrupted_save_leftovers
from relax.weights.buckets import WEIGHTS_FILE, atomic_dir

TMP, OLD, LATEST_TMP = ".tmp-step_000040-0a1b2c3d", ".old-step_000010-deadbeef", ".latest.tmp-ab12cd34"

# ---------------------------------------------------------------------------------------------- the names


def test_each_kind_of_leftover_is_one_and_nothing_else_is() -> None:
    keep = ["step_000030", "latest", "notes.txt", ".relax-owner", "step_000010.bak", ".tmp-notes", ".old-config",
            ".tmp-step_000040", ".tmp-step_40-0a1b2c3d", ".tmp-step_000040-0A1B2C3D", ".tmp-step_000040-0a1b2c3d.x",
            ".latest.tmp", ".latest.tmp-ab12cd3", "latest.tmp-ab12cd34", ".metrics.jsonl.tmp-ab12cd34",
            ".tmp-latest-ab12cd34", "x.tmp-step_000040-0a1b2c3d"]
    assert interrupted_save_leftovers([*keep, TMP, LATEST_TMP, OLD]) == sorted([TMP, OLD, LATEST_TMP])
    assert interrupted_save_leftovers([".tmp-step_1000000-0a1b2c3d"]) == [".tmp-step_1000000-0a1b2c3d"]
    assert interrupted_save_leftovers(keep) == []


def test_the_names_the_saves_write_are_the_ones_recognised(tmp_path: Path, monkeypatch) -> None:
    """The names come from the producers themselves, so a change of their naming fails here."""
    produced: list[str] = []
    atomic_dir(tmp_path / "written" / checkpoint_name(40), lambda tmp: produced.append(tmp.name))  # a checkpoint

    real_replace = os.replace

    def spy(src, dst):
        produced.append(Path(src).name)
        return real_replace(src, dst)

    monkeypatch.setattr(durable.os, "replace", spy)
    write_latest(tmp_path, tmp_path / checkpoint_name(40))  # the pointer's update
    monkeypatch.undo()
    for step in (50, 60):
        write_latest(tmp_path, fake_checkpoint(tmp_path, step))

    def killed_before_delete(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("relax.training.checkpoint.shutil.rmtree", killed_before_delete)
    rotate_checkpoints(tmp_path, 1)  # a rotation that renamed step 50 aside but could not delete it
    produced += [p.name for p in tmp_path.iterdir() if p.name.startswith(".old-")]

    assert [name.split("-")[0] for name in produced] == [".tmp", ".latest.tmp", ".old"]
    assert interrupted_save_leftovers(produced) == sorted(produced)


def test_sizes_read_as_an_operator_reads_a_disk() -> None:
    assert [format_size(n) for n in (0, 999, 1000, 1_234_567, 999_960, 48_000_000_000, 3 * 10**12, 2 * 10**15)] == [
        "0 B", "999 B", "1.0 kB", "1.2 MB", "1.0 MB", "48.0 GB", "3.0 TB", "2000.0 TB"]


# ---------------------------------------------------------------------------------------------- the removal


def fake_checkpoint(root: Path, step: int) -> Path:
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / WEIGHTS_FILE).write_bytes(b"w")
    (path / STATE_FILE).write_text(json.dumps({"format_version": 1, "step": step, "world_size": 1}))
    (path / OPTIMIZER_FILE).write_bytes(b"o")
    return path


def leftovers(root: Path) -> None:
    """One of each kind, as a directory or a file, holding 1050 + 200 + 34 + 16 bytes in all."""
    (root / TMP / "nested").mkdir(parents=True)
    (root / TMP / WEIGHTS_FILE).write_bytes(b"x" * 1050)  # a trainer killed while writing
    (root / TMP / "nested" / "part").write_bytes(b"x" * 200)
    (root / OLD).write_bytes(b"x" * 34)  # a rotation killed between rename and delete (a file here)
    (root / LATEST_TMP).write_text("step_000030\n" + "x" * 4)  # an interrupted pointer update


def test_each_kind_goes_and_everything_else_stays_with_one_line(tmp_path: Path, caplog) -> None:
    write_latest(tmp_path, fake_checkpoint(tmp_path, 30))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".tmp-notes").mkdir()
    (tmp_path / "step_000010.bak").mkdir()
    leftovers(tmp_path)
    with caplog.at_level(logging.INFO, logger="relax.training.checkpoint"):
        removed = remove_save_leftovers(tmp_path)
    assert removed == sorted([TMP, OLD, LATEST_TMP])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-notes", LATEST_FILE, "notes.txt", "step_000010.bak",
                                                          "step_000030"]
    assert read_latest(tmp_path) == "step_000030" and find_resume_checkpoint(tmp_path).step == 30
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.getMessage() == (
        f"save dir {tmp_path}: removed 3 leftovers of interrupted saves ({', '.join(sorted([TMP, OLD, LATEST_TMP]))})"
        " 1.3 kB")


def test_nothing_to_remove_logs_nothing(tmp_path: Path, caplog) -> None:
    write_latest(tmp_path, fake_checkpoint(tmp_path, 30))
    with caplog.at_level(logging.DEBUG):
        assert remove_save_leftovers(tmp_path) == []
        assert remove_save_leftovers(tmp_path / "not-here") == []  # a --save this process cannot see
    assert caplog.records == []


def test_a_leftover_that_is_a_link_goes_but_not_what_it_points_at(tmp_path: Path, caplog) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    save = tmp_path / "save"
    save.mkdir()
    (save / OLD).symlink_to(elsewhere, target_is_directory=True)
    with caplog.at_level(logging.INFO):
        assert remove_save_leftovers(save) == [OLD]
    assert list(save.iterdir()) == [] and (elsewhere / "keep").is_dir()


def test_one_that_cannot_be_removed_is_one_warning_and_the_rest_go(tmp_path: Path, caplog, monkeypatch) -> None:
    leftovers(tmp_path)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("relax.training.checkpoint.shutil.rmtree", refuse)
    with caplog.at_level(logging.INFO):
        assert remove_save_leftovers(tmp_path) == sorted([OLD, LATEST_TMP])
    assert [p.name for p in tmp_path.iterdir()] == [TMP]
    info, warning = caplog.records
    assert info.getMessage().endswith("removed 2 leftovers of interrupted saves (.latest.tmp-ab12cd34, "
                                      ".old-step_000010-deadbeef) 50 B")
    assert warning.levelno == logging.WARNING and "\n" not in warning.getMessage()
    assert f"could not remove 1 leftover of interrupted saves: {TMP} (Permission denied)" in warning.getMessage()


# ---------------------------------------------------------------------------------------------- the claim


HOLDER = r"""
import sys
from pathlib import Path
from relax.cluster import scratch
assert scratch.claim(Path(sys.argv[1])) is None
print("held", flush=True)
sys.stdin.read()
"""


def test_leftovers_go_only_once_the_run_holds_the_save_dir(tmp_path: Path, capsys, caplog) -> None:
    from relax.entrypoints.train import _claim_save_dir

    save = tmp_path / "save"
    save.mkdir()
    leftovers(save)
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(save)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:  # a live run saves there: its .tmp-step_* may be a write in progress
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as exit_info:
            _claim_save_dir(str(save))
    finally:
        other.kill()
        other.wait(timeout=30)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err
    assert err.endswith(f"--save: {save.resolve()} is in use by another live run (pid {other.pid}); give this run "
                        "its own --save directory")
    assert sorted(p.name for p in save.iterdir()) == sorted([".relax-owner", TMP, OLD, LATEST_TMP])  # untouched

    with caplog.at_level(logging.INFO):  # that run is gone (the kernel dropped its lock): ours now, swept
        _claim_save_dir(str(save))
    assert [p.name for p in save.iterdir()] == [".relax-owner"]
    assert "removed 3 leftovers of interrupted saves" in caplog.text
