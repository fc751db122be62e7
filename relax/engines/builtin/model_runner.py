"""Batched forward passes with a KV cache over a causal LM (the native decoder, or transformers' model).

The running batch is left-padded. A *prefill* encodes full sequences (prompt plus the tokens generated
so far) into a fresh cache; a *decode* feeds one token per row. Rows that finish are dropped from the
cache in place (`batch_select_indices`). Requests that join a running batch are prefilled on their own
and their cache is *merged* into the batch's (`join`): both sides are left-padded to the same width
(masked out) and concatenated along the batch. So a join costs the newcomers' tokens only, not a
re-encoding of every running row, which on a real model (SmolLM2-135M on CPU) is what decides whether
continuous batching beats a static batch. Only weight changes and retracts re-encode the whole batch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from relax.engines.builtin.decoder import DecoderForCausalLM, KVCache, load_decoder, native_config, not_native
from relax.engines.builtin.model_impl import ModelImpl, ModelImplError

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class _BatchState:
    cache: Any  # decoder.KVCache, or transformers' DynamicCache (``layers[i].keys/values``)
    attention_mask: torch.Tensor  # [B, L] 1 = real token
    next_position: torch.Tensor  # [B] position id of the next token


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(model_path: str | Path, device: torch.device, impl: ModelImpl = ModelImpl.AUTO, *,
               dummy: bool = False) -> torch.nn.Module:
    """The checkpoint in fp32 on ``device``: natively where ``decoder`` implements its architecture exactly
    (Qwen3, Llama), else through transformers (any other architecture, at a few CPU-seconds more start-up).

    ``dummy``: the model built from ``config.json`` alone with placeholder weights, no weight file read (SGLang's
    ``--load-format dummy``): for an engine whose first refit overwrites every tensor anyway.
    Loaded on a thread of its own that ends with the load (``_on_a_passing_thread``)."""
    return _on_a_passing_thread(lambda: _load_model(Path(model_path), device, impl, dummy))


def _on_a_passing_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` run on a new thread that ends when it returns; its result, or its exception raised here.

    Why: the OpenMP runtime torch uses (libgomp) keeps a team of worker threads for every thread that ever ran a
    parallel op, for as long as that thread lives, and once those workers outnumber the cores it has every idle
    worker sleep almost at once instead of spinning briefly, so each parallel op of any team pays a wake-up. The
    engine steps on its own thread: a model loaded on the server's main thread left the main thread's team alive
    for good, and every decode step (~200 matmuls) paid those wake-ups. Measured on SmolLM2-135M, 2 cores, 16 rows:
    64 ms per decode step on the main thread, 86 ms on a second thread once the main one had run a parallel op,
    71 ms in the server with the load on a passing thread (178 → 209 tokens/s for the 16-way burst).
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="relax-model-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _load_model(model_dir: Path, device: torch.device, impl: ModelImpl, dummy: bool = False) -> torch.nn.Module:
    if dummy:
        return _dummy_model(model_dir, impl).to(device).eval()
    model = None if impl is ModelImpl.TRANSFORMERS else _load_native(model_dir, impl)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.to(device).eval()


def _dummy_model(model_dir: Path, impl: ModelImpl) -> torch.nn.Module:
    """The model ``config.json`` describes with placeholder weights: the native decoder where it implements the
    architecture (as for a real load), else transformers' model from the config (its own random init)."""
    raw = json.loads((model_dir / "config.json").read_text())
    config = None if impl is ModelImpl.TRANSFORMERS else native_config(raw)
    if config is not None:
        generation = model_dir / "generation_config.json"
        model = DecoderForCausalLM(config, json.loads(generation.read_text()) if generation.is_file() else None)
        with torch.no_grad():  # allocated, not initialised: placeholder values that can never make a NaN (the first
            for name, param in model.named_parameters():  # health generation runs on them); zeros are a memset,
                param.fill_(1.0 if param.dim() == 1 and "norm" in name else 0.0)  # random values cost ~1 s here
        return model
    if impl is ModelImpl.NATIVE:
        raise ModelImplError(f"--model-impl native cannot serve {model_dir}: {not_native(raw)}; "
                             "use --model-impl auto or transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=torch.float32)


def _load_native(model_dir: Path, impl: ModelImpl) -> torch.nn.Module | None:
    """The checkpoint in the native decoder, or None where transformers must serve it (``native``: refused)."""
    raw = json.loads((model_dir / "config.json").read_text())
    config = native_config(raw)
    try:
        if config is None:
            raise ValueError(not_native(raw))
        return load_decoder(model_dir, config)
    except (ValueError, FileNotFoundError) as exc:
        if impl is ModelImpl.NATIVE:
            raise ModelImplError(f"--model-impl native cannot serve {model_dir}: {exc}; "
                                 "use --model-impl auto or transformers") from None
        if config is not None:  # an architecture it implements, in files it cannot read as they are
            log.warning("the built-in decoder cannot load %s (%s); serving it with transformers", model_dir, exc)
        return None


def _new_cache(model: torch.nn.Module) -> Any:
    new_cache = getattr(model, "new_cache", None)
    if new_cache is not None:
        return new_cache()
    from transformers import DynamicCache

    return DynamicCache()


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
        logits, self._state = self._encode(sequences)
        return logits

    @torch.inference_mode()
    def join(self, sequences: list[list[int]]) -> torch.Tensor:
        """Encode ``sequences`` alone and append them as new rows of the cached batch (after its rows).

        Returns the newcomers' next-token logits [n, V]. Without a cached batch this is a prefill.
        """
        if self._state is None:
            return self.prefill(sequences)
        logits, new = self._encode(sequences)
        old = self._state
        width = max(old.attention_mask.shape[1], new.attention_mask.shape[1])
        if isinstance(old.cache, KVCache):  # the native cache pads and merges its preallocated buffers itself
            old.cache.merge(new.cache)
        else:
            for old_layer, new_layer in zip(old.cache.layers, new.cache.layers, strict=True):
                old_layer.keys = torch.cat([_left_pad(old_layer.keys, width), _left_pad(new_layer.keys, width)])
                old_layer.values = torch.cat([_left_pad(old_layer.values, width),
                                              _left_pad(new_layer.values, width)])
        old.attention_mask = torch.cat([_left_pad(old.attention_mask, width), _left_pad(new.attention_mask, width)])
        old.next_position = torch.cat([old.next_position, new.next_position])
        return logits

    def _encode(self, sequences: list[list[int]]) -> tuple[torch.Tensor, _BatchState]:
        """Encode ``sequences`` into a fresh cache, each distinct sequence once.

        Identical sequences in one prefill are the rule in RL rollouts (``n`` samples of a prompt, or a group of
        one prompt sent as separate requests, which arrive and are admitted together): their keys, values and
        logits are the same, so the distinct ones are encoded and the cache's rows are then repeated. A prefill
        is compute-bound on CPU (SmolLM2-135M: ~0.8 s for 16 rows of a 38-token prompt, a dozen decode steps).
        """
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(seq), len(distinct)) for seq in sequences]
        if len(distinct) == len(sequences):
            return self._encode_rows(sequences)
        logits, state = self._encode_rows([list(seq) for seq in distinct])
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        state.cache.batch_select_indices(index)
        state.attention_mask, state.next_position = state.attention_mask[index], state.next_position[index]
        return logits[index], state

    def _encode_rows(self, sequences: list[list[int]]) -> tuple[torch.Tensor, _BatchState]:
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        cache = _new_cache(self.model)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
            logits_to_keep=1,
        )
        state = _BatchState(cache=cache, attention_mask=mask, next_position=positions[:, -1] + 1)
        return out.logits[:, -1, :].float(), state

    @torch.inference_mode()
    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        """Feed one token per row through the cache; returns next-token logits [B, V]."""
        assert self._state is not None, "decode without a prefilled batch"
        state = self._state
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).unsqueeze(-1)
        mask = torch.cat([state.attention_mask, torch.ones_like(ids)], dim=-1)
        positions = state.next_position.unsqueeze(-1)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=state.cache, use_cache=True,
            logits_to_keep=1,
        )
        state.attention_mask = mask
        state.next_position = state.next_position + 1
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
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

    @torch.inference_mode()
    def copy_tensors(self, named: Mapping[str, torch.Tensor]) -> None:
        """Copy some named tensors into the served model in place (one bucket of a broadcast update).

        Every name and shape is checked before anything is copied, so a bad bucket leaves the model as it
        was. Names are the checkpoint's (a tied ``lm_head`` shares the embedding's storage and follows it).
        """
        current = self.model.state_dict()
        for name, tensor in named.items():
            target = current.get(name)
            if target is None:
                raise ValueError(f"tensor {name!r} is not a weight of the served model")
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, the served model has "
                                 f"{tuple(target.shape)}")
        for name, tensor in named.items():
            current[name].copy_(tensor)
        self.invalidate()


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the sequence dimension on the left to ``width`` with zeros (masked positions).

    Keys and values are [B, H, L, D] (sequence is dim -2); masks are [B, L] (dim -1).
    """
    missing = width - (tensor.shape[-2] if tensor.dim() == 4 else tensor.shape[-1])
    if missing <= 0:
        return tensor
    return F.pad(tensor, (0, 0, missing, 0)) if tensor.dim() == 4 else F.pad(tensor, (missing, 0))


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
