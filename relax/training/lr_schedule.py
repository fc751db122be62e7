"""The learning rate at each optimizer step, with Megatron's meanings (``--lr``, ``--min-lr``,
``--lr-warmup-iters``, ``--lr-decay-iters``, ``--lr-decay-style``). Pure: the trainer sets it before each step
from its step counter, which a checkpoint restores, so a resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relax.config.flags import LRDecayStyle

__all__ = ["LRSchedule"]


@dataclass(frozen=True)
class LRSchedule:
    lr: float  # the peak, reached at the end of warm-up
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # where decay reaches min_lr; None: no decay (constant after warm-up)
    style: LRDecayStyle = LRDecayStyle.CONSTANT

    def at(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0 for the first): a linear ramp from 0 over ``warmup_iters``
        steps, then constant, or decaying (linear or half a cosine) from ``lr`` at the end of warm-up to
        ``min_lr`` at ``decay_iters``, and ``min_lr`` after it."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.lr * step / self.warmup_iters
        style = LRDecayStyle(self.style)
        if style is LRDecayStyle.CONSTANT or self.decay_iters is None:
            return self.lr
        if step >= self.decay_iters:
            return self.min_lr
        span = self.decay_iters - self.warmup_iters
        ratio = (step - self.warmup_iters) / span if span > 0 else 1.0
        coeff = 1.0 - ratio if style is LRDecayStyle.LINEAR else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)
