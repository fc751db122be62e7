"""How a global batch is cut for the trainer ranks, with no tensor: even shards, one micro-batch count for all
ranks, the global loss denominator, and the checks a batch passes before any rank sees it.

Torch-free on purpose: the rollout manager cuts the batch when it hands samples to the ranks by reference
(``rollout.dispatch.handoff``), and its process does not import torch (``tests/unit/test_manager_imports.py``).
The partial losses of the micro-batches, each divided by the *global* ``loss_denominator``, add up to the loss
of the whole batch (``training.batching`` makes the tensors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

__all__ = ["BatchPlan", "LossAggregation", "ShardedBatch", "check_samples", "loss_denominator", "micro_batch_count",
           "micro_batches", "num_micro_batches", "pack_by_tokens", "sample_tokens", "shard_batch", "split_by_tokens",
           "split_evenly"]

T = TypeVar("T")


class LossAggregation(str, Enum):
    TOKEN_MEAN = "token_mean"  # every token of the batch weighs the same (--calculate-per-token-loss)
    SAMPLE_MEAN = "sample_mean"  # mean over each sample's tokens, then mean over samples


def split_evenly(items: Sequence[T], n: int) -> list[list[T]]:
    """``n`` contiguous chunks whose sizes differ by at most one (the first ones are longer)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def _num_loss_tokens(sample: Mapping[str, Any]) -> int:
    mask = sample.get("loss_mask")
    return len(sample["response_token_ids"]) if mask is None else int(sum(mask))


def loss_denominator(samples: Sequence[Mapping[str, Any]], aggregation: LossAggregation) -> float:
    """The count the whole batch's loss is divided by: what ``grpo.aggregate`` would use on one big batch."""
    if aggregation is LossAggregation.TOKEN_MEAN:
        count = sum(_num_loss_tokens(s) for s in samples)
    else:
        count = sum(1 for s in samples if _num_loss_tokens(s) > 0)
    return float(max(count, 1))


def check_samples(samples: Sequence[Mapping[str, Any]], *, need_advantages: bool = True,
                  need_rollout_log_probs: bool = False) -> None:
    """Raise ``ValueError`` for a sample the trainer cannot use, *before* it reaches the ranks.

    A rank that rejects its shard mid-step leaves the other ranks waiting in a collective, which breaks
    the group; the driver checks the whole batch first so bad input costs an exception, not the group.
    """
    for s in samples:
        who = f"sample {s.get('group_id')}/{s.get('sample_index')}"
        n = len(s["response_token_ids"])
        if not s["prompt_token_ids"]:
            raise ValueError(f"{who} has an empty prompt")
        if need_advantages and s.get("advantage") is None:
            raise ValueError(f"{who} has no advantage")
        mask = s.get("loss_mask")
        if mask is not None and len(mask) != n:
            raise ValueError(f"{who}: loss_mask has {len(mask)} entries for {n} response tokens")
        rollout = s.get("rollout_log_probs") or ()
        if (need_rollout_log_probs or rollout) and len(rollout) != n:
            raise ValueError(f"{who}: {len(rollout)} rollout log-probs for {n} response tokens"
                             + (" (use_tis needs them)" if need_rollout_log_probs else ""))


def num_micro_batches(shard_sizes: Sequence[int], micro_batch_size: int | None) -> int:
    """Micro-batches every rank runs: enough for the largest shard (all ranks must run the same number)."""
    largest = max(shard_sizes, default=0)
    if micro_batch_size is None or largest == 0:
        return 1
    return math.ceil(largest / micro_batch_size)


@dataclass(frozen=True)
class BatchPlan:
    """How the trainer group takes a global batch: what whoever shards it (the driver, or the rollout manager
    handing the ranks their shares directly) must know of the group."""

    world_size: int
    micro_batch_size: int | None = None
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    need_rollout_log_probs: bool = False
    #: tokens per micro-batch, padding included (``--use-dynamic-batch-size --max-tokens-per-gpu``); None: by count
    max_tokens: int | None = None
    #: ``--balance-data``: samples go to ranks so that their token counts are even, not their sample counts
    balance_tokens: bool = False


@dataclass(frozen=True)
class ShardedBatch:
    """A checked global batch cut into one shard per rank, with what every rank's step needs to agree on."""

    shards: list[list[Mapping[str, Any]]]
    denominator: float
    num_micro_batches: int
    aggregation: LossAggregation


def shard_batch(samples: Sequence[Mapping[str, Any]], plan: BatchPlan,
                aggregation: LossAggregation | None = None) -> ShardedBatch:
    """Check the batch (:func:`check_samples`), then its global loss denominator, even shards and the micro-batch
    count every rank runs. ``aggregation`` overrides the plan's for this batch."""
    if not samples:
        raise ValueError("train_step needs at least one sample")
    check_samples(samples, need_rollout_log_probs=plan.need_rollout_log_probs)
    agg = aggregation or plan.aggregation
    split = split_by_tokens if plan.balance_tokens else split_evenly
    shards = split(list(samples), plan.world_size)  # the callers' dicts, not copies: a step's batch is large
    return ShardedBatch(shards=shards, denominator=loss_denominator(samples, agg),
                        num_micro_batches=micro_batch_count(shards, plan), aggregation=agg)


def split_by_tokens(samples: Sequence[Mapping[str, Any]], n: int) -> list[list[Any]]:
    """``n`` shards with even token counts (``--balance-data``): longest first, each to the shard with the fewest
    tokens so far (then the fewest samples). The step's gradient is the same whatever the split (every loss is
    divided by the global denominator); what changes is that no rank waits on another's longer shard."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    shards: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(samples)), key=lambda k: (-sample_tokens(samples[k]), k)):
        rank = min(range(n), key=lambda r: (load[r], len(shards[r]), r))
        shards[rank].append(i)
        load[rank] += sample_tokens(samples[i])
    return [[samples[i] for i in sorted(shard)] for shard in shards]


def sample_tokens(sample: Mapping[str, Any]) -> int:
    """The positions a sample takes in a micro-batch: prompt and response."""
    return len(sample["prompt_token_ids"]) + len(sample["response_token_ids"])


def pack_by_tokens(lengths: Sequence[int], budget: int, max_count: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` packed into micro-batches whose padded size (count x longest, what the tensors
    hold) is at most ``budget`` tokens, and at most ``max_count`` samples when given. Longest first, each into
    the first micro-batch it fits, so similar lengths share one and little is padding. A sample longer than the
    budget gets a micro-batch of its own. Each micro-batch lists its indices in order."""
    packs: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for pack in packs:  # a pack's first index is its longest: lengths arrive in decreasing order
            fits = (len(pack) + 1) * lengths[pack[0]] <= budget
            if fits and (max_count is None or len(pack) < max_count):
                pack.append(i)
                break
        else:
            packs.append([i])
    return [sorted(pack) for pack in packs]


def micro_batches(shard: Sequence[Mapping[str, Any]], plan: BatchPlan) -> list[list[int]]:
    """How one rank cuts its shard: by the token budget when there is one, else into even micro-batches of at
    most ``micro_batch_size`` samples (one when unset). Empty for an empty shard."""
    if not shard:
        return []
    if plan.max_tokens is not None:
        return pack_by_tokens([sample_tokens(s) for s in shard], plan.max_tokens, plan.micro_batch_size)
    return split_evenly(list(range(len(shard))), num_micro_batches([len(shard)], plan.micro_batch_size))


def micro_batch_count(shards: Sequence[Sequence[Mapping[str, Any]]], plan: BatchPlan) -> int:
    """The micro-batches every rank runs (FSDP's collectives need the same number): the most any rank needs;
    a rank with fewer runs empty ones."""
    return max([len(micro_batches(shard, plan)) for shard in shards] + [1])
