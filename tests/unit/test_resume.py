"""Resuming after a crash: which checkpoint ``--load`` picks, and one metrics row per step across segments.

Checkpoints are written by the real ``write_checkpoint`` (tiny tensors), so "complete" means what a finished
atomic write leaves; the interrupted write is the ``.tmp-*`` sibling that ``atomic_dir`` fills before its rename.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax.training.checkpoint import (
    LATEST_FILE,
    OPTIMIZER_FILE,
    TrainerCheckpoint,
    checkpoint_name,
    find_resume_checkpoint,
    is_complete,
    read_latest,
    repair_latest,
    write_checkpoint,
    write_latest,
)
from relax.training.report import RUN_SECONDS, MetricsLog, keep_rows, migration_row, resume_records, summarize
from relax.weights.buckets import WEIGHTS_FILE


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    return model


def save(root: Path, hf_dir: Path, step: int) -> Path:
    return write_checkpoint(root / checkpoint_name(step), model_state={"w": torch.full((2,), float(step))},
                            optimizer_state={"state": {}}, hf_dir=hf_dir,
                            state=TrainerCheckpoint(step, 1, {"step": step, "cursor": {"epoch": 0, "offset": step}}))


# -- which checkpoint ---------------------------------------------------------------------------------------


def test_resume_takes_the_newest_complete_checkpoint_over_a_stale_pointer(tmp_path: Path, hf_dir: Path) -> None:
    root = tmp_path / "ckpt"
    write_latest(root, save(root, hf_dir, 10))
    save(root, hf_dir, 20)  # the run died before it replaced the pointer
    unfinished = root / ".tmp-step_000030-1a2b3c4d"  # and then in the middle of the next save
    unfinished.mkdir()
    (unfinished / WEIGHTS_FILE).write_bytes(b"half")
    (unfinished / OPTIMIZER_FILE).write_bytes(b"")
    partial = root / checkpoint_name(40)  # copied in by hand, without its state file
    partial.mkdir()
    (partial / WEIGHTS_FILE).write_bytes(b"")
    assert read_latest(root) == "step_000010"

    choice = find_resume_checkpoint(root)

    assert choice.path == root / "step_000020" and choice.step == 20
    assert "stale" in choice.reason and "step_000010" in choice.reason
    assert ".tmp-step_000030-1a2b3c4d" in choice.reason and "step_000040" in choice.reason  # said, not used
    assert not is_complete(unfinished) and not is_complete(partial)

    # the resume makes the pointer right: it names the newest complete checkpoint from now on
    assert repair_latest(root, choice.path) and read_latest(root) == "step_000020"
    assert not repair_latest(root, choice.path)  # already right: untouched
    assert not repair_latest(tmp_path / "elsewhere", choice.path)  # a checkpoint of another directory


def test_a_missing_pointer_or_an_explicit_checkpoint(tmp_path: Path, hf_dir: Path) -> None:
    root = tmp_path / "ckpt"
    older = save(root, hf_dir, 10)
    save(root, hf_dir, 20)
    choice = find_resume_checkpoint(root)
    assert choice.path == root / "step_000020" and "missing" in choice.reason
    assert find_resume_checkpoint(older).path == older  # naming a checkpoint resumes from exactly that one
    assert find_resume_checkpoint(tmp_path / "nothing").path is None


def test_the_pointer_is_replaced_whole_and_never_names_an_unfinished_checkpoint(tmp_path: Path,
                                                                                hf_dir: Path) -> None:
    root = tmp_path / "ckpt"
    write_latest(root, save(root, hf_dir, 10))
    write_latest(root, save(root, hf_dir, 20))
    assert (root / LATEST_FILE).read_text() == "step_000020\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000010", "step_000020"]  # no temp left
    (root / "step_000030").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        write_latest(root, root / "step_000030")
    assert read_latest(root) == "step_000020"


# -- metrics across segments ------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def train_row(reward: float) -> dict[str, float]:
    return {"rollout/reward_mean": reward, "rollout/samples": 8, "time/step_s": 10.0}


def test_a_resumed_run_logs_each_step_once_and_summarizes_the_whole_run(tmp_path: Path) -> None:
    clock = Clock()
    first = MetricsLog(tmp_path, clock=clock)
    first.log(0, {"eval/reward": 0.0}, kind="eval")
    for step in range(1, 6):  # steps 1..5 logged; the last checkpoint was after step 3
        clock.now += 10.0
        first.log(step, train_row(reward=step / 10))
    first.close()
    with first.path.open("a") as f:
        f.write('{"step": 6, "kind": "tr')  # killed in mid-write

    clock.now = 1000.0  # a new process: its own clock
    second = MetricsLog(tmp_path, clock=clock)
    assert second.resume(3) == 3  # steps 4, 5 and the torn line
    clock.now += 5.0  # start-up of the resumed segment
    for step in range(4, 7):
        clock.now += 10.0
        second.log(step, train_row(reward=step / 10))
    clock.now += 5.0
    wall = second.wall_seconds()
    second.close()

    rows = [json.loads(line) for line in first.path.read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and [r["kind"] for r in rows].count("eval") == 1
    assert [r[RUN_SECONDS] for r in train] == [10.0, 20.0, 30.0, 45.0, 55.0, 65.0]  # one clock across segments
    assert wall == 70.0  # 30 s up to the checkpoint + the whole second segment (40 s)
    summary = summarize(second.train_rows, wall)
    assert summary["training_steps"] == 6
    assert summary["reward_first"] == 0.1 and summary["reward_last"] == 0.6
    assert summary["samples_per_second"] == pytest.approx(6 * 8 / 70.0)


def test_migrations_are_counted_per_step_so_the_summary_sums_them_across_a_resumed_run() -> None:
    """The manager's counters are run-long and start at 0 in a resumed segment; the rows take each step's
    increase, so the summary's totals are the whole run's."""
    first = [{}, {"migrated_requests": 2, "tokens_kept": 150, "tokens_regenerated": 0},
             {"migrated_requests": 3, "tokens_kept": 190, "tokens_regenerated": 7}]
    second = [{}, {"migrated_requests": 1, "tokens_kept": 40, "tokens_regenerated": 0}]  # a new manager
    rows = [migration_row(a, b) for a, b in zip(first, first[1:], strict=False)]
    rows += [migration_row(a, b) for a, b in zip(second, second[1:], strict=False)]
    assert rows[1] == {"rollout/migrated_requests": 1, "rollout/migration_tokens_kept": 40,
                       "rollout/migration_tokens_regenerated": 7}
    summary = summarize([{**train_row(0.0), **r} for r in rows], 30.0)
    assert (summary["migrated_requests"], summary["migration_tokens_kept"],
            summary["migration_tokens_regenerated"]) == (4, 230, 7)
    assert summarize([train_row(0.0)], 10.0)["migrated_requests"] == 0  # rows written before the counters


def test_per_sample_records_of_steps_done_again_are_dropped_on_resume(tmp_path: Path) -> None:
    """sample_versions.jsonl / samples.jsonl count steps from 0: resuming after 2 steps keeps steps 0 and 1
    (the steps the checkpoint holds), drops what the crashed segment wrote after them and any torn line."""
    rows = [{"step": s, "trainer_version": s} for s in (0, 1, 2, 3)]
    (tmp_path / "sample_versions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "trai')
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({**r, "text": "x"}) + "\n" for r in rows))
    assert resume_records(tmp_path, 2) == 3 + 2
    assert read_jsonl(tmp_path / "sample_versions.jsonl") == rows[:2]
    assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [0, 1]
    assert not list(tmp_path.glob(".*tmp*"))  # the rewrites' temp files are gone
    (tmp_path / "samples.jsonl").unlink()  # records are optional (--save-samples): a missing file stays missing
    assert resume_records(tmp_path, 1) == 1
    assert not (tmp_path / "samples.jsonl").exists()
    assert keep_rows(tmp_path / "absent.jsonl", lambda row: True) == ([], 0)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
