"""GRPO's group-relative advantages against hand-computed numbers and the torch formula."""

from __future__ import annotations

import math

import pytest

from relax.data.sample import PromptGroup, Sample
from relax.training.advantages import assign_group_advantages, group_advantages


def test_mean_and_unbiased_std() -> None:
    # mean 0.5, unbiased std sqrt(1/3)
    scale = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([scale, -scale, -scale, scale], rel=1e-12)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=False) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 0.0, -1.0]) == pytest.approx([1 / (1 + 1e-6), 0.0, -1 / (1 + 1e-6)], rel=1e-12)


def test_a_group_without_signal_gets_exactly_zero() -> None:
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]  # not tiny / eps
    assert group_advantages([-1.0, -1.0], scale_by_std=False) == [0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]  # single sample: no baseline
    assert group_advantages([]) == []


def test_the_same_numbers_as_the_torch_formula() -> None:
    import torch

    rewards = [0.3, 1.0, 0.0, 0.7, 0.7, 0.1, 0.9, 0.2]
    r = torch.tensor(rewards, dtype=torch.float64)
    expected = ((r - r.mean()) / (r.std(unbiased=True) + 1e-6)).tolist()
    assert group_advantages(rewards) == pytest.approx(expected, rel=1e-12)


def _group(rewards: list[float], gid: str = "g") -> PromptGroup:
    return PromptGroup.from_samples(
        [Sample(0, gid, i, [1], [2], "x", "1", weight_version=0, rollout_step=0, reward=r)
         for i, r in enumerate(rewards)]
    )


def test_groups_of_different_sizes() -> None:
    out = assign_group_advantages([_group([1.0, -1.0]), _group([0.0, 0.0, 0.0], "h")], scale_by_std=False)
    assert [s.advantage for s in out[0]] == [1.0, -1.0]
    assert [s.advantage for s in out[1]] == [0.0, 0.0, 0.0]
    unscored = PromptGroup.from_samples([Sample(0, "u", 0, [1], [2], "x", "1", weight_version=0, rollout_step=0)])
    with pytest.raises(ValueError, match="no reward"):
        assign_group_advantages([unscored])
