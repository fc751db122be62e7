"""Batched forward passes with a KV cache over a Hugging Face causal LM.

The running batch is left-padded. A *prefill* re-encodes every row's full sequence (prompt plus
the tokens generated so far) into a fresh cache; a *decode* feeds one token per row. Rows that
finish are dropped from the cache in place (`batch_select_indices`), so only admissions and
weight changes cost a prefill. Re-encoding on admission keeps the code simple and exact; the
price is a larger forward when requests join, which is small for the models the built-in engine
is meant for (the tiny preset, small models on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache


@dataclass
class _BatchState:
    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, L] 1 = real token
    next_position: torch.Tensor  # [B] position id of the next token


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(model_path: str | Path, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return model.to(device).eval()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, pad_token_id: int) -> None:
        self.model = model
        self.device = device
        self.pad_token_id = pad_token_id
        self._state: _BatchState | None = None

    @property
    def has_cache(self) -> bool:
        return self._state is not None

    def invalidate(self) -> None:
        """Forget the cache; the next step must prefill (after admissions or new weights)."""
        self._state = None

    @torch.inference_mode()
    def prefill(self, sequences: list[list[int]]) -> torch.Tensor:
        """Encode full sequences into a fresh cache; returns next-token logits [B, V]."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        self._state = _BatchState(cache=cache, attention_mask=mask, next_position=positions[:, -1] + 1)
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        """Feed one token per row through the cache; returns next-token logits [B, V]."""
        assert self._state is not None, "decode without a prefilled batch"
        state = self._state
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).unsqueeze(-1)
        mask = torch.cat([state.attention_mask, torch.ones_like(ids)], dim=-1)
        positions = state.next_position.unsqueeze(-1)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=state.cache, use_cache=True
        )
        state.attention_mask = mask
        state.next_position = state.next_position + 1
        return out.logits[:, -1, :].float()

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished rows from the cached batch."""
        if self._state is None:
            return
        if not rows:
            self._state = None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        state = self._state
        state.cache.batch_select_indices(index)
        state.attention_mask = state.attention_mask[index]
        state.next_position = state.next_position[index]

    @torch.inference_mode()
    def load_weights_from(self, new_model: torch.nn.Module) -> None:
        """Copy another instance's weights into the served model.

        Keys and shapes are checked *before* anything is copied: `load_state_dict` copies every
        matching tensor before it reports a mismatch, which would leave a half-updated model.
        """
        problem = state_dict_mismatch(self.model.state_dict(), new_model.state_dict())
        if problem:
            raise ValueError(problem)
        self.model.load_state_dict(new_model.state_dict(), strict=True)
        self.invalidate()


def state_dict_mismatch(current: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> str | None:
    """A one-line description of why `new` cannot replace `current`, or None when it can."""
    missing = sorted(set(current) - set(new))
    unexpected = sorted(set(new) - set(current))
    if missing or unexpected:
        return f"missing tensors {missing[:3]}, unexpected tensors {unexpected[:3]}"
    for name, tensor in current.items():
        if tensor.shape != new[name].shape:
            return f"tensor {name} has shape {tuple(new[name].shape)}, the served model has {tuple(tensor.shape)}"
    return None
