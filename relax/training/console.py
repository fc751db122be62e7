"""The driver's one console line per training step (pure: formatting and the ETA rule).

Why one line: an operator follows a run from its log; the per-step lines of every actor (rollout step generated,
trainer ranks, weight loads) are debug lines now, and this line carries what they need at a glance: progress,
reward, staleness, the pool's size, the step time and when the run will end. On a terminal it starts with a
progress bar; in a file or a job log it carries no terminal codes at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StepLine", "eta_seconds", "format_duration"]

#: The ETA averages the newest steps only: step times change as the pool grows and shrinks.
ETA_WINDOW = 10
BAR_WIDTH = 20


def eta_seconds(step_times: Sequence[float], steps_left: int) -> float | None:
    """Seconds until the run ends: the mean of the newest ``ETA_WINDOW`` step times x the steps left."""
    recent = [t for t in step_times[-ETA_WINDOW:] if math.isfinite(t) and t >= 0]
    if not recent or steps_left < 0:
        return None
    return sum(recent) / len(recent) * steps_left


def format_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass(frozen=True)
class StepLine:
    step: int  # steps done, 1-based
    total: int
    reward: float | None
    staleness_max: float | None
    active_engines: int | None
    step_s: float
    eta_s: float | None

    def render(self, *, tty: bool) -> str:
        """``training step 12/100: reward 0.41, staleness max 1, 4 ACTIVE engines, 2.3s/step, ETA 3m22s``;
        on a terminal, a progress bar in front. Plain ASCII either way (no escape codes)."""
        text = (f"training step {self.step}/{self.total}: reward {_num(self.reward, '.3f')}, "
                f"staleness max {_num(self.staleness_max, 'g')}, {_num(self.active_engines, 'd')} ACTIVE engines, "
                f"{self.step_s:.1f}s/step, ETA {format_duration(self.eta_s)}")
        if not tty:
            return text
        done = 0 if self.total <= 0 else min(BAR_WIDTH, BAR_WIDTH * self.step // self.total)
        return f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] {text}"


def _num(value: float | int | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(int(value) if spec == "d" else value, spec)
