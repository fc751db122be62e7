"""pass@k (unbiased estimator), mean reward and truncation ratio per eval dataset."""

from __future__ import annotations

from math import comb

import pytest

from relax.data.sample import FinishReason, PromptGroup, Sample
from relax.training.evaluation import (
    default_ks,
    evaluate_datasets,
    evaluate_groups,
    pass_at_k,
    summarize_eval,
)


@pytest.mark.parametrize(("n", "c", "k"), [(10, 3, 1), (10, 3, 5), (16, 0, 4), (16, 16, 4), (7, 2, 6), (5, 1, 5)])
def test_pass_at_k_matches_binomial_formula(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_special_cases() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = fraction correct
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples
    # large n: the product form stays finite where C(n, k) as a float would overflow
    assert 0.0 < pass_at_k(5000, 1, 1000) == pytest.approx(0.2)
    for bad in ((0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_default_ks() -> None:
    assert default_ks(1) == [1]
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(6) == [1, 2, 4, 6]


def test_summarize_eval() -> None:
    r = summarize_eval(
        "aime",
        rewards=[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        truncated=[[False, True, False, False], [True, True, False, False]],
        ks=[1, 4],
    )
    assert (r.num_prompts, r.num_samples) == (2, 8)
    assert r.mean_reward == pytest.approx(1 / 8)
    assert r.pass_at_k == {1: pytest.approx(0.125), 4: pytest.approx(0.5)}
    assert r.truncation_ratio == pytest.approx(3 / 8)
    m = r.to_metrics()
    assert m["eval/aime/pass@4"] == pytest.approx(0.5) and m["eval/aime/truncation_ratio"] == pytest.approx(0.375)


def test_dapo_style_rewards_and_threshold() -> None:
    r = summarize_eval("d", [[1.0, -1.0], [-1.0, -1.0]])
    assert r.mean_reward == pytest.approx(-0.5) and r.pass_at_k[1] == pytest.approx(0.25)
    partial = summarize_eval("p", [[0.5, 0.5]], correct_threshold=0.5)
    assert partial.pass_at_k == {1: 1.0, 2: 1.0}


def test_summarize_errors() -> None:
    with pytest.raises(ValueError, match="no prompts"):
        summarize_eval("x", [])
    with pytest.raises(ValueError, match="without samples"):
        summarize_eval("x", [[]])
    with pytest.raises(ValueError, match="1 <= k <= 2"):
        summarize_eval("x", [[1.0, 0.0], [1.0, 0.0, 1.0]], ks=[3])
    with pytest.raises(ValueError, match="shape"):
        summarize_eval("x", [[1.0, 0.0]], [[True]])


def _group(gid: str, rewards: list[float], finish: list[str], lengths: list[int]) -> PromptGroup:
    return PromptGroup.from_samples(
        [
            Sample(
                0, gid, i, [1], list(range(n)), "x", "1", weight_version=0, rollout_step=0, finish_reason=f, reward=r
            )
            for i, (r, f, n) in enumerate(zip(rewards, finish, lengths, strict=True))
        ]
    )


def test_evaluate_groups_and_datasets() -> None:
    a = [_group("a0", [1.0, 0.0], ["stop", "length"], [2, 4]), _group("a1", [1.0, 1.0], ["stop", "stop"], [1, 1])]
    b = [_group("b0", [0.0, 0.0, 0.0], [FinishReason.LENGTH] * 3, [3, 3, 3])]
    reports = evaluate_datasets({"math500": a, "aime": b})
    assert list(reports) == ["math500", "aime"]
    ra = reports["math500"]
    assert ra.mean_reward == pytest.approx(0.75) and ra.truncation_ratio == pytest.approx(0.25)
    assert ra.pass_at_k == {1: pytest.approx(0.75), 2: 1.0} and ra.mean_response_length == pytest.approx(2.0)
    rb = reports["aime"]
    assert rb.pass_at_k == {1: 0.0, 2: 0.0, 3: 0.0} and rb.truncation_ratio == 1.0
    assert evaluate_groups("a", a, ks=[1]).pass_at_k == {1: pytest.approx(0.75)}
