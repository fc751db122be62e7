"""How a rank's shard of samples becomes padded micro-batch tensors (pure: tensors only, no distributed state).

How the global batch is cut into shards, and the denominator every micro-batch's loss is divided by, are
``training.sharding``'s (torch-free, so the rollout manager can cut it too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MicroBatch", "collate"]


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
