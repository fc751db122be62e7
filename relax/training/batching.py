"""How samples become micro-batches for a trainer rank (pure: tensors only, no distributed state).

A global batch is split evenly over ranks (``split_evenly``); every rank runs the same number of
micro-batches (``num_micro_batches``) so FSDP's collectives stay in step; the loss of each micro-batch is
divided by the *global* ``loss_denominator`` so the partial losses add up to the loss of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from relax.training.grpo import LossAggregation

__all__ = ["MicroBatch", "check_samples", "collate", "loss_denominator", "num_micro_batches", "split_evenly"]

T = TypeVar("T")


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
class MicroBatch:
    """Padded tensors of a few samples, response-aligned.

    ``input_ids`` are prompt+response, right-padded to ``L``. The model computes logits only for the last
    ``logits_to_keep`` positions (from the earliest position that predicts a response token), and
    ``logit_index[i, t]`` is the kept position whose logits predict response token ``t`` of sample ``i``.
    Per-token tensors are ``[B, T]`` with ``T`` the longest response (at least 1).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    logit_index: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    response_lengths: tuple[int, ...]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def collate(
    samples: Sequence[Mapping[str, Any]], pad_token_id: int, device: torch.device | str = "cpu",
    *, need_advantages: bool = True, need_rollout_log_probs: bool = False,
) -> MicroBatch:
    """``Sample.to_dict()`` records -> one ``MicroBatch``.

    Rollout log-probs are kept only if every sample has them (they may be absent when the engine did
    not report them); ``need_rollout_log_probs`` (TIS) makes their absence an error.
    """
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    prompts = [list(s["prompt_token_ids"]) for s in samples]
    responses = [list(s["response_token_ids"]) for s in samples]
    for s, p in zip(samples, prompts, strict=True):
        if not p:
            raise ValueError(f"sample {s.get('group_id')}/{s.get('sample_index')} has an empty prompt")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    seq_len = max(lengths)
    width = max(1, max(len(r) for r in responses))
    start = min(len(p) for p in prompts) - 1  # first kept logit position
    b = len(samples)

    input_ids = torch.full((b, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, seq_len), dtype=torch.long)
    logit_index = torch.zeros((b, width), dtype=torch.long)
    targets = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.float32)
    rollout = torch.zeros((b, width), dtype=torch.float32)
    have_rollout = all(len(s.get("rollout_log_probs") or ()) == len(r) for s, r in zip(samples, responses,
                                                                                       strict=True))
    for i, (s, p, r) in enumerate(zip(samples, prompts, responses, strict=True)):
        n = len(r)
        input_ids[i, : len(p) + n] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + n] = 1
        if n == 0:
            continue
        logit_index[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n) - start
        targets[i, :n] = torch.tensor(r, dtype=torch.long)
        mask = s.get("loss_mask")
        loss_mask[i, :n] = torch.tensor([1.0] * n if mask is None else [float(m) for m in mask])
        if have_rollout:
            rollout[i, :n] = torch.tensor([float(x) for x in s["rollout_log_probs"]])

    if need_rollout_log_probs and not have_rollout:
        raise ValueError("use_tis needs rollout_log_probs for every response token of every sample")
    if need_advantages:
        missing = [f"{s.get('group_id')}/{s.get('sample_index')}" for s in samples if s.get("advantage") is None]
        if missing:
            raise ValueError(f"samples without an advantage: {missing[:3]}")
        advantages = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float32)
    else:
        advantages = torch.zeros(b, dtype=torch.float32)
    dev = torch.device(device)
    return MicroBatch(
        input_ids=input_ids.to(dev),
        attention_mask=attention_mask.to(dev),
        logits_to_keep=seq_len - start,
        logit_index=logit_index.to(dev),
        targets=targets.to(dev),
        loss_mask=loss_mask.to(dev),
        advantages=advantages.to(dev),
        rollout_log_probs=rollout.to(dev) if have_rollout else None,
        response_lengths=tuple(len(r) for r in responses),
    )
