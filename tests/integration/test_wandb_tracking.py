"""--use-wandb with the real wandb package, offline (no network): the tracking module driven as the driver drives
it (start -> rows of the real metric keys through MetricsLog -> summary and plot -> finish), then a resumed
segment that continues the same W&B run. What W&B wrote is read back from its offline run directories
(``<output-dir>/wandb/offline-run-*/``: the ``.wandb`` transaction log that ``wandb sync`` uploads, and the
media files): the keys, the steps, the run id reused on resume, and that no secret is anywhere on disk."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

from relax.config.flags import parse_args  # noqa: E402
from relax.training import tracking  # noqa: E402
from relax.training.report import MetricsLog, plot, summarize  # noqa: E402

KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B API key; must never reach a file


def _records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: W&B's LevelDB-style log (7-byte header ``:W&B``, then 32 KiB blocks of
    chunks: crc32 u32, length u16, type u8 full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def _read_run(run_dir: Path) -> dict[str, Any]:
    (log_file,) = run_dir.glob("run-*.wandb")
    run: dict[str, Any] = {"history": [], "exit_code": None, "summary": {}}
    for record in _records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, group=record.run.run_group,
                       name=record.run.display_name,
                       config={u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "history":
            run["history"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            run["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json)
                                   for u in record.summary.update})
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


TRAIN_KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/samples", "train/loss",
              "train/grad_norm", "staleness/mean", "staleness/max", "time/step_s", "time/trainer_wait_fraction",
              "engines/active", "engines/weight_version")


def _train_row(step: int) -> dict[str, Any]:
    row: dict[str, Any] = {key: 0.1 * step + i for i, key in enumerate(TRAIN_KEYS)}
    row["engines/active"] = 2
    return row


def test_offline_run_logs_every_row_then_a_resume_continues_the_same_run(tmp_path: Path, monkeypatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    out = tmp_path / "run"
    argv = ["--use-wandb", "--wandb-mode", "offline", "--wandb-key", KEY, "--wandb-project", "relax-test",
            "--wandb-group", "ci", "--output-dir", str(out), "--rollout-batch-size", "4"]
    monkeypatch.setattr(sys, "argv", ["relax-train", *argv])  # W&B records the command line in its metadata
    args = parse_args(argv)

    # First segment: as Driver.run does it.
    metrics = MetricsLog(out)
    first = tracking.start(args, out, resuming=False)
    assert isinstance(first, tracking.WandbTracking)
    metrics.log(0, {"eval/tiny/pass@1": 0.25, "time/eval_s": 1.5}, kind="eval")  # evaluation before training
    first.log(metrics.rows[-1])
    for step in (1, 2, 3):
        metrics.log(step, _train_row(step))
        first.log(metrics.rows[-1])
    metrics.log(3, {"eval/tiny/pass@1": 0.5, "time/eval_s": 1.25}, kind="eval")  # --eval-interval 3
    first.log(metrics.rows[-1])
    summary = summarize(metrics.train_rows, metrics.wall_seconds())
    first.end(summary, plot(metrics.train_rows, out / "training.png"))
    first.finish()
    metrics.close()
    run_id = first.run_id
    assert (out / tracking.RUN_ID_FILE).read_text().strip() == run_id

    # Second segment: resumed from the checkpoint of step 2 (step 3 is done again), same output directory.
    metrics = MetricsLog(out)
    metrics.resume(2)
    second = tracking.start(args, out, resuming=True)
    assert isinstance(second, tracking.WandbTracking) and second.run_id == run_id
    for step in (3, 4):
        metrics.log(step, _train_row(step))
        second.log(metrics.rows[-1])
    second.finish()  # never reached end(): a crash, marked failed
    metrics.close()

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith("-" + run_id) for r in runs)
    one, two = (_read_run(r) for r in runs)
    assert one["id"] == two["id"] == run_id
    assert one["project"] == "relax-test" and one["group"] == "ci" and one["name"] == "run"

    config = one["config"]
    assert config["rollout_batch_size"] == 4 and config["wandb_project"] == "relax-test"
    assert "wandb_key" not in config and tracking.MASK in config["argv"]

    steps = [h["_step"] for h in one["history"]]
    assert steps == [0, 1, 2, 3]
    by_step = {h["_step"]: h for h in one["history"]}
    assert by_step[0]["eval/tiny/pass@1"] == 0.25
    assert set(TRAIN_KEYS) | {"time/run_s", "eval/tiny/pass@1", "time/eval_s"} <= set(by_step[3])
    assert by_step[2]["rollout/reward_mean"] == pytest.approx(0.2) and by_step[2]["engines/active"] == 2
    assert "step" not in by_step[2] and "kind" not in by_step[2]
    assert by_step[3][f"{tracking.PLOT_KEY}/_type"] == "image-file"  # the plot, at the last step
    assert (runs[0] / "files" / by_step[3][f"{tracking.PLOT_KEY}/path"]).is_file()
    assert one["summary"]["summary/training_steps"] == 3
    assert one["exit_code"] == 0

    assert [h["_step"] for h in two["history"]] == [3, 4]
    assert two["history"][-1]["rollout/reward_mean"] == pytest.approx(0.4)
    assert two["exit_code"] == 1

    for path in tmp_path.rglob("*"):  # the key is nowhere: not in the config, the metadata, W&B's logs
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
