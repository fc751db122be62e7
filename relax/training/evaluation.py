"""Evaluation metrics: unbiased pass@k, mean reward and truncation ratio, per eval dataset.

pass@k uses the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on
Code"): with ``n`` samples of which ``c`` are correct, ``1 - C(n-c, k) / C(n, k)``, computed as the
product ``prod_{i=n-c+1}^{n} (1 - k/i)`` so that large ``n`` neither overflows nor loses precision.
Estimating pass@k as "any of the first k correct" would be noisier and depend on sample order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relax.data.sample import PromptGroup

__all__ = ["EvalReport", "default_ks", "evaluate_datasets", "evaluate_groups", "pass_at_k", "summarize_eval"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` (``c``
    correct) is correct."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, plus ``n`` itself: the usual pass@k columns."""
    ks = []
    k = 1
    while k <= n:
        ks.append(k)
        k *= 2
    if n >= 1 and ks[-1] != n:
        ks.append(n)
    return ks


@dataclass(frozen=True)
class EvalReport:
    """Metrics of one eval dataset."""

    name: str
    num_prompts: int
    num_samples: int
    mean_reward: float
    pass_at_k: dict[int, float]
    truncation_ratio: float  # share of responses that hit the length limit
    mean_response_length: float | None = None

    def to_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat ``{prefix}/{name}/metric`` names for TensorBoard / JSONL / Prometheus."""
        base = f"{prefix}/{self.name}"
        out = {
            f"{base}/mean_reward": self.mean_reward,
            f"{base}/truncation_ratio": self.truncation_ratio,
            f"{base}/num_samples": float(self.num_samples),
        }
        if self.mean_response_length is not None:
            out[f"{base}/mean_response_length"] = self.mean_response_length
        out.update({f"{base}/pass@{k}": v for k, v in self.pass_at_k.items()})
        return out


def summarize_eval(
    name: str,
    rewards: Sequence[Sequence[float]],
    truncated: Sequence[Sequence[bool]] | None = None,
    *,
    ks: Sequence[int] | None = None,
    correct_threshold: float = 1.0,
    response_lengths: Sequence[Sequence[int]] | None = None,
) -> EvalReport:
    """Metrics from per-prompt lists of rewards (and truncation flags).

    A sample counts as correct when its reward is ``>= correct_threshold``: 1.0 fits ``math`` (1/0) and
    ``dapo`` (+1/-1) rewards. pass@k is averaged over prompts and reported for each ``k`` no larger than
    the smallest group (default ``default_ks`` of it); asking for a larger ``k`` is an error.
    """
    if not rewards:
        raise ValueError(f"eval dataset {name!r} has no prompts")
    if any(len(g) == 0 for g in rewards):
        raise ValueError(f"eval dataset {name!r} has a prompt without samples")
    if truncated is not None and [len(g) for g in truncated] != [len(g) for g in rewards]:
        raise ValueError(f"eval dataset {name!r}: truncation flags do not match the rewards' shape")
    n_min = min(len(g) for g in rewards)
    ks = list(default_ks(n_min) if ks is None else ks)
    too_big = [k for k in ks if k > n_min or k < 1]
    if too_big:
        raise ValueError(f"eval dataset {name!r}: pass@k needs 1 <= k <= {n_min} (samples per prompt), got {too_big}")

    flat = [float(r) for g in rewards for r in g]
    pass_k = {
        k: sum(pass_at_k(len(g), sum(r >= correct_threshold for r in g), k) for g in rewards) / len(rewards) for k in ks
    }
    trunc = 0.0 if truncated is None else sum(bool(t) for g in truncated for t in g) / len(flat)
    mean_len = None
    if response_lengths is not None:
        lengths = [n for g in response_lengths for n in g]
        mean_len = sum(lengths) / len(lengths) if lengths else 0.0
    return EvalReport(
        name=name,
        num_prompts=len(rewards),
        num_samples=len(flat),
        mean_reward=sum(flat) / len(flat),
        pass_at_k=pass_k,
        truncation_ratio=trunc,
        mean_response_length=mean_len,
    )


def evaluate_groups(
    name: str,
    groups: Sequence[PromptGroup],
    *,
    ks: Sequence[int] | None = None,
    correct_threshold: float = 1.0,
) -> EvalReport:
    """Metrics of one eval dataset from its scored prompt groups."""
    return summarize_eval(
        name,
        [g.rewards for g in groups],
        [[s.truncated for s in g.samples] for g in groups],
        ks=ks,
        correct_threshold=correct_threshold,
        response_lengths=[[s.response_length for s in g.samples] for g in groups],
    )


def evaluate_datasets(
    results: Mapping[str, Sequence[PromptGroup]],
    *,
    ks: Sequence[int] | None = None,
    correct_threshold: float = 1.0,
) -> dict[str, EvalReport]:
    """One report per eval dataset (``--eval-prompt-data NAME PATH`` pairs), in the given order."""
    return {
        name: evaluate_groups(name, groups, ks=ks, correct_threshold=correct_threshold)
        for name, groups in results.items()
    }
