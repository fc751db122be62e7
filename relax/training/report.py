"""What people see of a run: metrics to JSONL and TensorBoard, the end summary and a PNG plot.

A run may be several *segments*: it crashes (or is stopped) and resumes from its last checkpoint into the same
output directory. ``metrics.jsonl`` stays one row per step across them: on resume from the checkpoint of step
k, the rows the earlier segment logged after k (work that the checkpoint does not hold and that is done again)
are dropped before the new segment appends (``MetricsLog.resume``), and the rows up to k are loaded, so the
summary covers the whole run, not only its last segment.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from relax.training.durable import atomic_write_text

log = logging.getLogger("relax.train")

RUN_SECONDS = "time/run_s"
"""Per train row: the run's wall seconds when the row was logged, over every segment up to it (see ``MetricsLog``)."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of the JSONL file ``path`` (none when it is missing); a line that does not parse into an
    object, what a crash in mid-write leaves, is skipped."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def keep_rows(path: Path, keep: Callable[[dict[str, Any]], bool]) -> tuple[list[dict[str, Any]], int]:
    """Rewrite the JSONL file ``path`` with only the rows ``keep`` accepts; returns ``(kept rows, dropped)``.

    Atomic (``durable.atomic_write_text``): a crash leaves the old file or the new one. A line that does
    not parse, or a row ``keep`` cannot judge (a missing or odd field), is dropped: it is what a crash in
    mid-write leaves. A missing file stays missing.
    """
    if not path.exists():
        return [], 0
    lines = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    kept: list[dict[str, Any]] = []
    for row in read_rows(path):
        try:
            ok = bool(keep(row))
        except (KeyError, TypeError, ValueError):
            ok = False
        if ok:
            kept.append(row)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))
    return kept, lines - len(kept)


#: Per-sample records of a run directory; their ``step`` counts from 0 (``metrics.jsonl`` counts from 1).
SAMPLE_RECORDS = ("sample_versions.jsonl", "samples.jsonl")


def resume_records(run_dir: Path, start_step: int) -> int:
    """A segment resumes after ``start_step`` steps: drop the per-sample records of the steps it runs again.

    The steps the checkpoint holds (0-based ``step < start_step``) stay; what a crashed segment wrote after
    them goes, or the run's records would count those samples twice. Returns how many rows were dropped.
    Call it while no writer holds the files open (the driver closes its log first).
    """
    dropped = 0
    for name in SAMPLE_RECORDS:
        dropped += keep_rows(run_dir / name, lambda row: int(row["step"]) < start_step)[1]
    if dropped:
        log.info("resume: dropped %d per-sample record(s) of steps from %d on", dropped, start_step)
    return dropped


class MetricsLog:
    """Appends one JSON object per training step and mirrors scalars to TensorBoard.

    Every train row carries ``time/run_s``: the wall time of the run so far, i.e. this segment's seconds since
    the log was opened plus ``prior_wall_s``, the earlier segments' wall time up to the checkpoint this segment
    resumed from (the ``time/run_s`` of the last row kept by ``resume``). ``wall_seconds()`` is the same count
    now, the denominator of ``summarize``'s ``samples_per_second``.
    """

    def __init__(self, out_dir: Path, tensorboard_dir: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self.last_row: dict[str, Any] | None = None  # the rows themselves live in metrics.jsonl only
        self._clock = clock
        self._began = clock()
        self.prior_wall_s = 0.0
        self._tensorboard_dir = tensorboard_dir
        self._tb = self._open_tensorboard() if tensorboard_dir is not None else None

    def _open_tensorboard(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self._tensorboard_dir), purge_step=purge_step)

    def wall_seconds(self) -> float:
        """The run's wall time so far: earlier segments up to the resumed checkpoint, plus this segment's."""
        return self.prior_wall_s + (self._clock() - self._began)

    def resume(self, checkpoint_step: int) -> int:
        """This segment continues the run from the checkpoint taken after ``checkpoint_step`` steps.

        Rows logged after that step (by a segment that went on past its last checkpoint) are dropped from
        ``metrics.jsonl`` (rewritten atomically: a crash leaves the old file or the new one) and from
        TensorBoard (``purge_step``), because this segment logs those steps again; the rows up to it are kept
        and loaded into ``rows``, so the summary covers the whole run. A line that does not parse (a crash in
        mid-write) is dropped too. Returns how many rows were dropped.
        """
        self._file.close()
        try:
            kept, dropped = keep_rows(self.path, lambda row: int(row["step"]) <= checkpoint_step)
        finally:
            self._file = self.path.open("a", encoding="utf-8")
        self.last_row = kept[-1] if kept else None
        self.prior_wall_s = _prior_wall_seconds([r for r in kept if r.get("kind") == "train"])
        self._began = self._clock()
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tensorboard(purge_step=checkpoint_step + 1)
        if dropped:
            log.info("metrics: resumed at step %d; dropped %d row(s) logged after it, kept %d", checkpoint_step,
                     dropped, len(kept))
        return dropped

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        row = {"step": step, "kind": kind, **metrics}
        if kind == "train":
            row[RUN_SECONDS] = self.wall_seconds()
        self.last_row = row
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value)):
                    self._tb.add_scalar(key, float(value), step)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every row logged so far, read back from metrics.jsonl (for the end-of-run summary and plot): a run of
        days keeps no row in memory (measured: the list grew the driver by ~1 MB a minute)."""
        if not self._file.closed:
            self._file.flush()
        return read_rows(self.path)

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] == "train"]

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _prior_wall_seconds(train_rows: list[dict[str, Any]]) -> float:
    """The earlier segments' wall time up to the last kept row: its ``time/run_s``.

    Rows written before ``time/run_s`` existed have only their step times; their sum is then the best lower
    bound there is (it leaves out start-up, evaluation and checkpoint time of those segments).
    """
    if not train_rows:
        return 0.0
    last = train_rows[-1].get(RUN_SECONDS)
    if isinstance(last, int | float) and not isinstance(last, bool) and math.isfinite(float(last)):
        return float(last)
    return float(sum(r.get("time/step_s", 0.0) for r in train_rows))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


#: The rollout's run-long migration counters (``RunStatus.migration``) -> their per-step train-row keys.
MIGRATION_KEYS = {
    "migrated_requests": "rollout/migrated_requests",
    "tokens_kept": "rollout/migration_tokens_kept",
    "tokens_regenerated": "rollout/migration_tokens_regenerated",
}


def migration_row(before: dict[str, Any], now: dict[str, Any]) -> dict[str, int]:
    """What the step added to the manager's migration counters (requests continued on another engine after theirs
    failed or left, and their tokens kept or generated again). Per step rather than run-long, because a resumed
    run's manager counts from 0 again while the metrics log goes on: the summary's sums stay right across
    segments."""
    return {key: int(now.get(name, 0)) - int(before.get(name, 0)) for name, key in MIGRATION_KEYS.items()}


def summarize(rows: list[dict[str, Any]], wall_seconds: float,
              status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The end-of-run summary over ``rows``, the train rows of the whole run (every segment, one row a step).

    ``wall_seconds`` is the whole run's wall time (``MetricsLog.wall_seconds``: each earlier segment up to the
    checkpoint the next one resumed from, plus the last segment in full), so ``samples_per_second`` divides the
    samples of every step by the time they took end to end, start-ups included. The time a crashed segment spent
    on steps after its last checkpoint is not counted: those steps were dropped and their samples with them.
    ``status`` (the rollout's last ``RunStatus``) adds what happened to the data: prompts dropped at load as
    unservable, groups an engine refused.
    """
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    samples = sum(r.get("rollout/samples", 0) for r in rows)
    k = min(5, len(rewards))
    return {
        "training_steps": len(rows),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_first5_mean": _mean(rewards[:k]) if rewards else None,
        "reward_last5_mean": _mean(rewards[-k:]) if rewards else None,
        "samples_per_second": samples / wall_seconds if wall_seconds > 0 else None,
        "staleness_mean": _mean([r["staleness/mean"] for r in rows if "staleness/mean" in r]),
        "staleness_max": max((r["staleness/max"] for r in rows if "staleness/max" in r), default=None),
        "trainer_idle_fraction": _mean([r["time/trainer_wait_fraction"] for r in rows
                                        if "time/trainer_wait_fraction" in r]),
        "wall_seconds": wall_seconds,
        **{key.removeprefix("rollout/"): sum(int(r.get(key, 0)) for r in rows) for key in MIGRATION_KEYS.values()},
        "data/dropped_prompts": int((status or {}).get("dropped_prompts", 0)),
        "data/refused_groups": int((status or {}).get("refused_groups", 0)),
    }


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    """Reward, response length and ACTIVE engines over training steps, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    panels = [("rollout/reward_mean", "mean reward"), ("rollout/response_len_mean", "response length (tokens)"),
              ("engines/active", "ACTIVE engines")]
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 7), sharex=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o", markersize=3)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    # Counts start at 0: autoscaled, a constant length of 4 tokens is drawn as spikes around 4 (matplotlib zooms
    # into +-0.05); engines come in whole numbers.
    for ax in axes[1:]:
        ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("training step")
    fig.suptitle("Relax run")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
