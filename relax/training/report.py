"""What people see of a run: metrics to JSONL and TensorBoard, the end summary and a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per training step and mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: Path, tensorboard_dir: Path | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self.rows: list[dict[str, Any]] = []
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard_dir))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        row = {"step": step, "kind": kind, **metrics}
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value)):
                    self._tb.add_scalar(key, float(value), step)

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] == "train"]

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict[str, Any]], wall_seconds: float) -> dict[str, Any]:
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
    }


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    """Reward, response length and ACTIVE engines over training steps, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    panels = [("rollout/reward_mean", "mean reward"), ("rollout/response_len_mean", "response length (tokens)"),
              ("engines/active", "ACTIVE engines")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 7), sharex=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o", markersize=3)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("training step")
    fig.suptitle("Relax run")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
