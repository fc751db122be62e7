"""The learning-rate schedule has Megatron's meanings (``training.lr_schedule``)."""

from __future__ import annotations

import math

import pytest

from relax.config.flags import LRDecayStyle, parse_args
from relax.training.actor import TrainerConfig
from relax.training.lr_schedule import LRSchedule


def test_warmup_is_a_linear_ramp_from_zero_then_the_peak_stays_without_decay() -> None:
    s = LRSchedule(lr=2e-5, warmup_iters=4)
    assert [s.at(k) for k in range(7)] == pytest.approx([0.0, 5e-6, 1e-5, 1.5e-5, 2e-5, 2e-5, 2e-5])


def test_cosine_and_linear_decay_from_the_end_of_warmup_to_min_lr() -> None:
    cosine = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=10, style=LRDecayStyle.COSINE)
    linear = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=10, style=LRDecayStyle.LINEAR)
    for k in range(2, 10):
        ratio = (k - 2) / 8
        assert cosine.at(k) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * ratio) + 1))
        assert linear.at(k) == pytest.approx(0.1 + 0.9 * (1 - ratio))
    assert cosine.at(6) == pytest.approx(0.55) and linear.at(6) == pytest.approx(0.55)  # half way
    assert cosine.at(10) == cosine.at(500) == linear.at(11) == 0.1  # min_lr from decay_iters on
    assert cosine.at(1) == linear.at(1) == 0.5  # the warm-up ramp first


def test_the_flags_reach_the_trainer_and_decay_defaults_to_the_run_length() -> None:
    args = parse_args(["--hf-checkpoint", "/m", "--lr", "1e-5", "--min-lr", "1e-6", "--lr-warmup-iters", "10",
                       "--lr-decay-style", "cosine"])
    schedule = TrainerConfig.from_args(args, lr_decay_iters=args.lr_decay_iters or 100).lr_schedule()
    assert schedule == LRSchedule(lr=1e-5, min_lr=1e-6, warmup_iters=10, decay_iters=100, style=LRDecayStyle.COSINE)
    args = parse_args(["--hf-checkpoint", "/m", "--lr-decay-iters", "40"])
    assert TrainerConfig.from_args(args, lr_decay_iters=args.lr_decay_iters or 100).lr_decay_iters == 40
