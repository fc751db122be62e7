"""GRPO math checked against hand-computed numbers on tiny tensors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from relax.config.flags import KLLossType
from relax.training.grpo import (
    LossAggregation,
    PolicyLossConfig,
    aggregate,
    entropy_from_logits,
    kl_estimate,
    policy_loss,
    token_log_probs,
)

torch.set_num_threads(1)
T = torch.tensor


# ---- log-probs -------------------------------------------------------------------------------------


def test_token_log_probs_with_temperature() -> None:
    logits = T([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    targets = T([[0, 2]])
    lp = token_log_probs(logits, targets, temperature=2.0)
    expected0 = 1.0 - math.log(math.e + math.exp(0.5) + 1.0)  # logits / 2 = [1, .5, 0]
    assert lp.shape == (1, 2)
    assert lp[0, 0].item() == pytest.approx(expected0, abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(-math.log(3.0), abs=1e-6)


def test_log_probs_match_the_sampling_distribution() -> None:
    """What an engine samples from softmax(logits/T) and reports must equal the trainer's number."""
    torch.manual_seed(0)
    logits = torch.randn(4, 7, 11, dtype=torch.bfloat16)
    temp = 0.7
    probs = torch.softmax(logits.float() / temp, dim=-1)
    sampled = torch.multinomial(probs.view(-1, 11), 1).view(4, 7)
    engine_lp = torch.log(probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1))
    assert torch.allclose(token_log_probs(logits, sampled, temp), engine_lp, atol=1e-5)
    all_lp = token_log_probs(logits[..., None, :].expand(4, 7, 11, 11), torch.arange(11).expand(4, 7, 11), temp)
    assert torch.allclose(all_lp.exp().sum(-1), torch.ones(4, 7), atol=1e-5)
    with pytest.raises(ValueError):
        token_log_probs(logits, sampled, 0.0)


def test_entropy_from_logits() -> None:
    ent = entropy_from_logits(torch.zeros(2, 5))
    assert torch.allclose(ent, torch.full((2,), math.log(5)))
    assert entropy_from_logits(T([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)


# ---- policy loss -----------------------------------------------------------------------------------


def _lp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.zeros(len(ratios), 1)
    new = torch.log(T(ratios)).unsqueeze(-1).requires_grad_(True)
    return new, old


def test_clipping_both_sides_with_clip_higher() -> None:
    cfg = PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28, aggregation=LossAggregation.TOKEN_MEAN)
    new, old = _lp([1.5, 0.5, 0.5, 1.5])
    adv = T([1.0, 1.0, -1.0, -1.0])  # per sample, broadcast over tokens
    loss, m = policy_loss(new, old, adv, torch.ones(4, 1), cfg)
    # A>0,r=1.5 -> clipped at 1+0.28; A>0,r=.5 -> unclipped; A<0,r=.5 -> clipped at 1-0.2; A<0,r=1.5 -> unclipped
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4)
    assert (m["clip_frac"], m["clip_frac_high"], m["clip_frac_low"]) == (0.5, 0.25, 0.25)
    loss.backward()
    # clipped tokens get no gradient; unclipped: d(-A r)/dlogp = -A r, over 4 tokens
    assert torch.allclose(new.grad.squeeze(-1), T([0.0, -0.5 / 4, 0.0, 1.5 / 4]))
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 0.5, 1.5)) / 4)


def test_symmetric_clip_by_default() -> None:
    cfg = PolicyLossConfig(eps_clip=0.2)
    assert (cfg.clip_low, cfg.clip_high) == (0.8, 1.2)
    new, old = _lp([1.5])
    loss, _ = policy_loss(new, old, T([1.0]), torch.ones(1, 1), cfg)
    assert loss.item() == pytest.approx(-1.2)


def test_tis_truncation_and_detach() -> None:
    cfg = PolicyLossConfig(use_tis=True, tis_clip=2.0, aggregation=LossAggregation.TOKEN_MEAN)
    new = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.log(T([[2.0, 1 / 3]])).requires_grad_(True)  # old - rollout = log .5, log 3
    loss, m = policy_loss(new, old, T([1.0]), torch.ones(1, 2), cfg, rollout_log_probs=rollout)
    # weights min(.5, 2) = .5 and min(3, 2) = 2; on-policy ratio 1, A = 1
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert m["tis_mean"] == pytest.approx(1.25) and m["tis_clip_frac"] == 0.5
    assert m["rollout_kl"] == pytest.approx(((0.5 - 1 - math.log(0.5)) + (3 - 1 - math.log(3))) / 2, rel=1e-5)
    loss.backward()
    assert torch.allclose(new.grad, T([[-0.5 / 2, -2.0 / 2]]))
    assert rollout.grad is None  # the weight is detached


def test_tis_metrics_without_tis_leave_loss_alone() -> None:
    new, old = torch.zeros(1, 2), torch.zeros(1, 2)
    rollout = torch.log(T([[2.0, 1 / 3]]))
    loss, m = policy_loss(new, old, T([1.0]), torch.ones(1, 2), rollout_log_probs=rollout)
    assert loss.item() == pytest.approx(-1.0) and "tis_mean" in m
    with pytest.raises(ValueError, match="use_tis needs rollout_log_probs"):
        policy_loss(new, old, T([1.0]), torch.ones(1, 2), PolicyLossConfig(use_tis=True))


def test_aggregation_token_mean_vs_sample_mean() -> None:
    values = T([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    mask = T([[1, 0, 0], [1, 1, 1]])
    assert aggregate(values, mask, LossAggregation.TOKEN_MEAN).item() == pytest.approx((1 + 9) / 4)
    assert aggregate(values, mask, LossAggregation.SAMPLE_MEAN).item() == pytest.approx((1 + 3) / 2)
    # a sample without loss tokens does not dilute the sample mean
    mask0 = T([[0, 0, 0], [1, 1, 1]])
    assert aggregate(values, mask0, LossAggregation.SAMPLE_MEAN).item() == pytest.approx(3.0)


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_global_denominator_makes_micro_batches_exact(mode: LossAggregation) -> None:
    torch.manual_seed(1)
    new = torch.randn(4, 5, requires_grad=True)
    old = new.detach() + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    cfg = PolicyLossConfig(aggregation=mode)
    full, _ = policy_loss(new, old, adv, mask, cfg)
    denom = mask.sum() if mode is LossAggregation.TOKEN_MEAN else 4.0
    parts = [
        policy_loss(new[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], cfg, denominator=denom)[0]
        for i in (0, 2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-6)


def test_padding_is_ignored() -> None:
    new = T([[0.0, 5.0]], requires_grad=True)
    loss, _ = policy_loss(new, torch.zeros(1, 2), T([1.0]), T([[1, 0]]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and new.grad[0, 1].item() == 0.0


@pytest.mark.parametrize(("kind", "formula"), [
    ("kl", lambda r: r), ("k1", lambda r: r), ("abs", abs), ("k2", lambda r: r * r / 2), ("mse", lambda r: r * r / 2),
    ("k3", lambda r: math.exp(-r) + r - 1), ("low_var_kl", lambda r: min(10.0, math.exp(-r) + r - 1)),
])
def test_every_kl_type_is_its_formula(kind: str, formula: Any) -> None:
    """r = logp - ref per token; k3 is e^-r + r - 1 (Schulman's), low_var_kl the same clamped at 10."""
    log_ratios = [-12.0, -0.7, 0.0, 0.3, 2.5]
    ref = torch.full((1, len(log_ratios)), -1.5)
    logp = ref + T([log_ratios])
    got = kl_estimate(logp, ref, KLLossType(kind))[0].tolist()
    assert got == pytest.approx([formula(r) for r in log_ratios], rel=1e-5, abs=1e-6)


def test_the_kl_type_reaches_the_loss() -> None:
    logp, ref = T([[-0.2]]), T([[-1.2]])  # r = 1
    for kind, expected in (("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1.0))):
        cfg = PolicyLossConfig(kl_coef=1.0, kl_type=KLLossType(kind))
        _, m = policy_loss(logp, logp, T([0.0]), torch.ones(1, 1), cfg, ref_log_probs=ref)
        assert m["kl"] == pytest.approx(expected, rel=1e-5), kind


def test_kl_and_entropy_terms() -> None:
    new, old = torch.zeros(1, 1, requires_grad=True), torch.zeros(1, 1)
    ref = torch.log(T([[0.5]]))
    expected_kl = 0.5 - math.log(0.5) - 1  # k3 with d = ref - logp = log .5
    assert kl_estimate(new.detach(), ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    ent = T([[2.0]])
    loss, m = policy_loss(new, old, T([1.0]), torch.ones(1, 1), cfg, ref_log_probs=ref, entropy=ent)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * expected_kl - 0.01 * 2.0)
    assert m["kl"] == pytest.approx(expected_kl) and m["entropy"] == 2.0 and m["pg_loss"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(new, old, T([1.0]), torch.ones(1, 1), PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(new, old, T([1.0]), torch.ones(1, 1), PolicyLossConfig(entropy_coef=0.1))


def test_extreme_ratios_stay_finite() -> None:
    new = T([[80.0, -80.0]], requires_grad=True)
    loss, m = policy_loss(new, torch.zeros(1, 2), T([-1.0]), torch.ones(1, 2))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all() and math.isfinite(m["approx_kl"])


def test_shape_and_config_errors() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 2), T([1.0, 1.0]), torch.ones(2, 3))
    with pytest.raises(ValueError):
        PolicyLossConfig(eps_clip=1.5)
    with pytest.raises(ValueError):
        PolicyLossConfig(tis_clip=0.0)
