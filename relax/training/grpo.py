"""GRPO math as pure torch functions: log-probs, the clipped policy loss with TIS (the advantages, computed
where the groups are scored, are plain Python: ``relax.training.advantages``).

Conventions: per-token tensors are ``[batch, response_len]`` and padded; ``loss_mask`` is 1 on tokens
that are trained on and 0 on padding (and on tokens the policy did not produce). Everything here is
device-agnostic and free of model code, so the exact numbers can be checked on tiny hand-made tensors.

Three log-probs meet in the loss, and it matters which is which:

* ``log_probs``         — the trainer's current policy, with gradient (changes during the step);
* ``old_log_probs``     — the trainer's recomputation before the update (PPO's pi_old);
* ``rollout_log_probs`` — what the inference engine reported while sampling (maybe stale weights,
  and always a different kernel stack).

PPO's ratio ``exp(log_probs - old_log_probs)`` is clipped (``eps_clip`` below, ``eps_clip_high``
above: DAPO's clip-higher). Truncated importance sampling corrects the gap between the engine that
sampled and the trainer: each token's loss is multiplied by the detached weight
``min(exp(old_log_probs - rollout_log_probs), C)`` (C = 2.0), as in "Your efficient RL framework
secretly brings you off-policy RL training" (Yao et al., 2025).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.config.flags import KLLossType
from relax.training.sharding import LossAggregation

__all__ = [
    "LossAggregation",
    "PolicyLossConfig",
    "aggregate",
    "entropy_from_logits",
    "kl_estimate",
    "masked_mean",
    "policy_loss",
    "token_log_probs",
]

#: Log-ratios are clamped before ``exp`` so one wild token cannot produce inf/nan.
_LOG_RATIO_LIMIT = 20.0


# --------------------------------------------------------------------------------------------------
# Log-probs and entropy


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.to(torch.float32)
    return logits if temperature == 1.0 else logits / temperature


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` gathered at ``targets``: ``[..., V]`` and ``[...]`` -> ``[...]``.

    The engine samples from ``softmax(logits / T)`` and reports the log-prob of the sampled token
    under that distribution, so the trainer must scale by the same rollout temperature for the two
    to be comparable (and for TIS to be ~1 on-policy). Computed in float32. For a causal LM the caller
    aligns ``logits[:, :-1]`` with ``input_ids[:, 1:]``.
    """
    scaled = _scaled(logits, temperature)
    picked = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits / T)``: ``[..., V]`` -> ``[...]``."""
    scaled = _scaled(logits, temperature)
    log_p = torch.log_softmax(scaled, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                kind: KLLossType = KLLossType.LOW_VAR_KL) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (``--kl-loss-type``), with the log ratio
    ``r = logp - ref`` (clamped to +-20 so ``exp`` stays finite):

    * ``kl`` / ``k1``: ``r`` (unbiased; negative on some tokens);
    * ``abs``: ``|r|``;
    * ``k2`` / ``mse``: ``r**2 / 2``;
    * ``k3``: ``e^-r + r - 1`` (unbiased, never negative);
    * ``low_var_kl``: ``k3`` clamped to [-10, 10].
    """
    r = (log_probs - ref_log_probs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    kind = KLLossType(kind)
    if kind in (KLLossType.KL, KLLossType.K1):
        return r
    if kind is KLLossType.ABS:
        return r.abs()
    if kind in (KLLossType.K2, KLLossType.MSE):
        return 0.5 * r.square()
    k3 = torch.exp(-r) + r - 1.0
    return k3.clamp(-10.0, 10.0) if kind is KLLossType.LOW_VAR_KL else k3


# --------------------------------------------------------------------------------------------------
# Aggregation


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    *,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` ``[B, T]`` to a scalar.

    ``TOKEN_MEAN`` = sum over loss tokens / number of loss tokens: long responses weigh more.
    ``SAMPLE_MEAN`` = per-sample mean over its loss tokens, summed / number of samples that have loss
    tokens: every response weighs the same.

    ``denominator`` replaces the count (tokens or samples) in the division. A trainer that splits a
    global batch into micro-batches and ranks passes the *global* count, so that the summed gradients
    equal those of the global mean exactly.
    """
    mask = mask.to(values.dtype)
    if mode is LossAggregation.TOKEN_MEAN:
        total = (values * mask).sum()
        count = mask.sum().clamp_min(1.0) if denominator is None else denominator
    elif mode is LossAggregation.SAMPLE_MEAN:
        tokens = mask.sum(dim=-1)
        per_sample = (values * mask).sum(dim=-1) / tokens.clamp_min(1.0)
        total = per_sample.sum()
        count = (tokens > 0).sum().to(values.dtype).clamp_min(1.0) if denominator is None else denominator
    else:  # pragma: no cover - enum exhausted
        raise ValueError(f"unknown aggregation {mode!r}")
    return total / count


# --------------------------------------------------------------------------------------------------
# Policy loss


@dataclass(frozen=True)
class PolicyLossConfig:
    """The loss's knobs, named after their flags."""

    eps_clip: float = 0.2  # --eps-clip: lower clip, ratio >= 1 - eps_clip
    eps_clip_high: float | None = None  # --eps-clip-high: upper clip, ratio <= 1 + eps_clip_high
    use_tis: bool = False  # --use-tis
    tis_clip: float = 2.0  # C in min(ratio, C)
    kl_coef: float = 0.0  # --kl-loss-coef (against the reference policy)
    kl_type: KLLossType = KLLossType.LOW_VAR_KL  # --kl-loss-type: the estimator (kl_estimate)
    log_kl: bool = False  # --use-kl-loss: the KL to the reference is measured (metric kl) even at coef 0
    entropy_coef: float = 0.0  # --entropy-coef (bonus: subtracted from the loss)
    aggregation: LossAggregation = LossAggregation.SAMPLE_MEAN  # TOKEN_MEAN with --calculate-per-token-loss

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_clip < 1.0:
            raise ValueError(f"eps_clip must be in [0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high < 0:
            raise ValueError(f"eps_clip_high must be >= 0, got {self.eps_clip_high}")
        if self.tis_clip <= 0:
            raise ValueError(f"tis_clip must be > 0, got {self.tis_clip}")

    @property
    def clip_low(self) -> float:
        return 1.0 - self.eps_clip

    @property
    def clip_high(self) -> float:
        return 1.0 + (self.eps_clip if self.eps_clip_high is None else self.eps_clip_high)


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    rollout_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss (to minimise) and its metrics.

    ``advantages`` is per sample ``[B]`` (broadcast over tokens) or per token ``[B, T]``. With
    ``config.use_tis`` the ``rollout_log_probs`` are required; with ``kl_coef`` the ``ref_log_probs``;
    with ``entropy_coef`` the per-token ``entropy`` (from ``entropy_from_logits``, with gradient).

    Metrics (token means over the loss mask, plain floats): ``pg_loss``, ``clip_frac``
    (``clip_frac_low`` + ``clip_frac_high``: tokens whose gradient the clip removed), ``approx_kl``
    (k3 estimate of KL(pi_old || pi)), ``ratio_mean``; with rollout log-probs ``tis_mean``,
    ``tis_clip_frac`` (tokens whose weight was truncated at C) and ``rollout_kl`` (k3 estimate of the
    engine-vs-trainer mismatch); ``entropy``, ``kl`` and ``loss`` when present.
    """
    if log_probs.shape != old_log_probs.shape or log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: log_probs {tuple(log_probs.shape)}, old_log_probs "
            f"{tuple(old_log_probs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if advantages.dim() == log_probs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(log_probs.dtype).expand_as(log_probs)
    mask = loss_mask.to(log_probs.dtype)
    mode = config.aggregation

    log_ratio = (log_probs - old_log_probs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(config.clip_low, config.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    tis_weight = raw_tis = None
    if rollout_log_probs is not None:
        if rollout_log_probs.shape != log_probs.shape:
            raise ValueError(f"rollout_log_probs shape {tuple(rollout_log_probs.shape)} != {tuple(log_probs.shape)}")
        rollout_log_ratio = (old_log_probs - rollout_log_probs).detach()
        raw_tis = torch.exp(rollout_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
        tis_weight = raw_tis.clamp(max=config.tis_clip)
    if config.use_tis:
        if tis_weight is None:
            raise ValueError("use_tis needs rollout_log_probs")
        pg = pg * tis_weight

    pg_loss = aggregate(pg, mask, mode, denominator=denominator)
    loss = pg_loss

    kl = None
    if config.kl_coef or config.log_kl:
        if ref_log_probs is None:
            raise ValueError("the KL term (kl_coef > 0 or log_kl) needs ref_log_probs")
        kl = kl_estimate(log_probs, ref_log_probs, config.kl_type)
        if config.kl_coef:
            loss = loss + config.kl_coef * aggregate(kl, mask, mode, denominator=denominator)
    if config.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        loss = loss - config.entropy_coef * aggregate(entropy, mask, mode, denominator=denominator)

    with torch.no_grad():
        adv_pos, adv_neg = advantages > 0, advantages < 0
        clipped_high = (adv_pos & (ratio > config.clip_high)).to(mask.dtype)
        clipped_low = (adv_neg & (ratio < config.clip_low)).to(mask.dtype)
        metrics = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "clip_frac_high": float(masked_mean(clipped_high, mask)),
            "clip_frac_low": float(masked_mean(clipped_low, mask)),
            "approx_kl": float(masked_mean(ratio - 1.0 - log_ratio, mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
        }
        metrics["clip_frac"] = metrics["clip_frac_high"] + metrics["clip_frac_low"]
        if raw_tis is not None and tis_weight is not None:
            metrics["tis_mean"] = float(masked_mean(tis_weight, mask))
            metrics["tis_clip_frac"] = float(masked_mean((raw_tis > config.tis_clip).to(mask.dtype), mask))
            # k3 of KL(engine || trainer) on engine-sampled tokens: the mismatch TIS corrects.
            d = (old_log_probs - rollout_log_probs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)  # type: ignore[operator]
            metrics["rollout_kl"] = float(masked_mean(torch.exp(d) - d - 1.0, mask))
        if entropy is not None:
            metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if kl is not None:
            metrics["kl"] = float(masked_mean(kl.detach(), mask))
    return loss, metrics
