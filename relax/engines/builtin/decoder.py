"""The built-in engine's own model: a Qwen3/Llama-family decoder in plain torch, loaded from safetensors.

Why not transformers' model classes: importing one costs an engine ~3 s of CPU before it serves (the model
module pulls in transformers' loading, kernel-hub and distributed-tensor machinery), and ``import
transformers`` itself ~2 s more — for a server whose whole forward pass is forty lines. Engines start far more
often than anything else in a run (every scale-out, every replacement), so SGLang too runs its own model
implementations and keeps transformers as a fallback (its ``--model-impl``). Here the same: architectures this
module implements exactly are served natively; any other checkpoint falls back to transformers
(``model_runner.load_model``).

The module tree and parameter names are the checkpoint's (``model.layers.N.self_attn.q_proj.weight``...), so
weight updates by name, ``state_dict`` comparisons and the trainer's checkpoints need no mapping. The math
follows transformers' implementations of the same architectures op for op (fp32 RMSNorm, default RoPE,
SDPA attention), so the engine's log-probs equal the trainer's to float rounding
(tests/unit/test_decoder.py compares both on the same weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NATIVE_MODEL_TYPES = ("qwen3", "llama")


@dataclass(frozen=True)
class DecoderConfig:
    """What the forward pass needs from a checkpoint's config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    architectures: tuple[str, ...]
    eos_token_id: int | list[int] | None

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's queries and keys before RoPE; Llama does not."""
        return self.model_type == "qwen3"


def not_native(raw: dict[str, Any]) -> str | None:
    """Why this module does not serve a checkpoint's config.json exactly, or None where it does."""
    if raw.get("model_type") not in NATIVE_MODEL_TYPES:
        return f"model_type {raw.get('model_type')!r} is not one of {', '.join(NATIVE_MODEL_TYPES)}"
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw.get('hidden_act')!r} is not silu"
    if raw.get("quantization_config"):
        return "the checkpoint is quantized"
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or []):
        return "it uses sliding-window attention"
    if raw.get("pretraining_tp", 1) != 1:
        return "pretraining_tp is not 1"
    rope = _rope(raw)
    if any(isinstance(value, dict) for value in rope.values()):
        return f"its RoPE parameters differ by layer type ({rope})"
    if rope.get("rope_type", rope.get("type", "default")) != "default" or rope.get("partial_rotary_factor", 1) != 1:
        return f"its RoPE is scaled or partial ({rope})"
    return None


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings transformers uses: ``rope_scaling`` first, then ``rope_parameters``."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return rope if isinstance(rope, dict) else {"rope_type": repr(rope)}


# transformers' config defaults where a config.json leaves a field out
_DEFAULTS = {"qwen3": {"head_dim": 128, "max_position_embeddings": 32768, "eos_token_id": None},
             "llama": {"head_dim": None, "max_position_embeddings": 2048, "eos_token_id": 2}}


def native_config(raw: dict[str, Any]) -> DecoderConfig | None:
    """The config of a checkpoint this module serves exactly, or None (then transformers serves it)."""
    if not_native(raw) is not None:
        return None
    theta = _rope(raw).get("rope_theta", raw.get("rope_theta", 10000.0))
    heads = int(raw["num_attention_heads"])
    defaults = _DEFAULTS[raw["model_type"]]
    return DecoderConfig(
        model_type=raw["model_type"], vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or defaults["head_dim"] or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=raw["model_type"] == "llama" and bool(raw.get("mlp_bias", False)),  # Qwen3's MLP has no biases
        max_position_embeddings=int(raw.get("max_position_embeddings") or defaults["max_position_embeddings"]),
        architectures=tuple(raw.get("architectures") or ()),
        eos_token_id=raw.get("eos_token_id", defaults["eos_token_id"]),
    )


class KVCache:
    """Keys and values per layer, [B, H_kv, L, D] views into buffers preallocated along L and written in place.

    Appending a decode step's keys with ``torch.cat`` copied the whole cache every step, for every layer: O(L²)
    bytes over a generation, ~10 % of a SmolLM2-135M decode step at 16 rows and L ≈ 100 on CPU. The buffers
    here grow by doubling (amortised O(L)) and a step writes only its own column. Columns up to ``length`` are
    the cache; the ones after it are unwritten capacity that no attention ever reads. Padding columns inside
    ``length`` (left padding of a joined batch) are zeros, never uninitialised memory: a masked column's weight
    is exactly 0, but 0 × NaN would still be NaN.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # columns written by every layer (a forward advances it once all layers have written)

    def past_length(self) -> int:
        return self.length

    def update(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new columns after ``length``; return that layer's keys and values so far (views)."""
        end = self.length + keys.shape[-2]
        buffer_k, buffer_v = self.keys[index], self.values[index]
        if buffer_k is None or buffer_k.shape[-2] < end:
            buffer_k, buffer_v = self._grown(index, keys, end)
        buffer_k[:, :, self.length : end].copy_(keys)
        buffer_v[:, :, self.length : end].copy_(values)
        return buffer_k[:, :, :end], buffer_v[:, :, :end]

    def advance(self, columns: int) -> None:
        """Every layer has written ``columns`` more columns (the end of a forward pass)."""
        self.length += columns

    def _grown(self, index: int, like: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s buffers with room for ``needed`` columns: doubled, so growth costs O(L) in all."""
        capacity = max(needed, 2 * (self.keys[index].shape[-2] if self.keys[index] is not None else 0))
        capacity = -(-capacity // 64) * 64
        grown = []
        for buffers in (self.keys, self.values):
            old = buffers[index]
            new = like.new_empty((like.shape[0], like.shape[1], capacity, like.shape[-1]))
            if old is not None:
                new[:, :, : self.length].copy_(old[:, :, : self.length])
            buffers[index] = new
            grown.append(new)
        return grown[0], grown[1]

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (finished rows dropped), capacity and all."""
        for buffers in (self.keys, self.values):
            for i, buffer in enumerate(buffers):
                if buffer is not None:
                    buffers[i] = buffer.index_select(0, index)

    def merge(self, other: KVCache) -> None:
        """Append ``other``'s rows after these, both left-padded (with zeros) to the longer of the two lengths."""
        width = max(self.length, other.length)
        for buffers, others in ((self.keys, other.keys), (self.values, other.values)):
            for i, (mine, theirs) in enumerate(zip(buffers, others, strict=True)):
                if mine is None or theirs is None:
                    raise ValueError("merging a cache that has not been written")
                capacity = max(mine.shape[-2], theirs.shape[-2], width)
                merged = mine.new_zeros((mine.shape[0] + theirs.shape[0], mine.shape[1], capacity, mine.shape[-1]))
                merged[: mine.shape[0], :, width - self.length : width] = mine[:, :, : self.length]
                merged[mine.shape[0] :, :, width - other.length : width] = theirs[:, :, : other.length]
                buffers[i] = merged
        self.length = width


def _inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Default RoPE's inverse frequencies, computed as transformers does (int64 arange, then float)."""
    dim = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _weight(*shape: int) -> nn.Parameter:
    """An uninitialised parameter: every weight comes from the checkpoint (``load_decoder``), so the random
    initialisation ``nn.Linear`` would do (seconds for a real model) is skipped."""
    return nn.Parameter(torch.empty(*shape))


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, bias: bool) -> None:
        super().__init__()
        self.weight = _weight(fan_out, fan_in)
        self.bias = _weight(fan_out) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, vocab: int, size: int) -> None:
        super().__init__()
        self.weight = _weight(vocab, size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _weight(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's own RMSNorm: one call instead of six Python-level ops, the same fp32 math (bit for bit on
            # CPU, measured on SmolLM2's shapes)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``rotate_half`` without its negation, which the forward's sine table carries instead (one op fewer per
    call and layer: ``-a * s == a * -s`` exactly, so the result is transformers' to the bit)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.index, self.heads, self.kv_heads, self.head_dim = index, cfg.num_attention_heads, \
            cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """``sin`` is signed for ``_swap_halves``; ``mask`` is additive (0 or -inf), built once per forward: a
        boolean mask is converted by SDPA itself, in every layer."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _swap_halves(q) * sin
        k = k * cos + _swap_halves(k) * sin
        k, v = cache.update(self.index, k, v)
        groups = self.heads // self.kv_heads
        scale = self.head_dim**-0.5
        if groups > 1 and length == 1:
            # a decode step: the query heads of one key-value head become that head's rows of queries, so the
            # cache is read as it is instead of copied ``groups`` times per layer and step (transformers' trick)
            q = q.reshape(batch, self.kv_heads, groups, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return self.o_proj(out.reshape(batch, 1, -1))
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class Output:
    logits: torch.Tensor


class DecoderForCausalLM(nn.Module):
    """``model(input_ids, attention_mask, position_ids, cache)`` as ``ModelRunner`` calls a causal LM."""

    def __init__(self, cfg: DecoderConfig, generation_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.generation_config = SimpleNamespace(**(generation_config or {}))
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache, logits_to_keep: int = 0, **_: Any) -> Output:
        """``attention_mask`` is [B, past + T] (1 = real token, left padding); ``position_ids`` [B, T]."""
        length = input_ids.shape[1]
        past = cache.past_length()
        x = self.model.embed_tokens(input_ids)
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's sign (see _swap_halves)
        # query t sits at column past + t: it sees real tokens up to itself; a padding query sees itself
        # only (a row with nothing to attend to would turn NaN and spread through the cache)
        columns = torch.arange(past + length, device=input_ids.device)
        query_columns = past + torch.arange(length, device=input_ids.device)
        causal = columns[None, :] <= query_columns[:, None]
        mask = (attention_mask[:, None, :].bool() & causal[None]) | (columns[None, :] == query_columns[:, None])
        blocked = ~mask[:, None]  # [B, 1, T, past + T]
        mask = torch.zeros(blocked.shape, dtype=x.dtype, device=x.device).masked_fill_(blocked, float("-inf"))
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache)
        cache.advance(length)
        x = self.model.norm(x)
        return Output(logits=self.lm_head(x[:, -logits_to_keep:, :] if logits_to_keep else x))


def parameter_shapes(raw: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """Every weight's shape of the checkpoint ``raw`` (its config.json) describes, without building any weight
    (meta device: milliseconds, no transformers import); None for an architecture this module does not serve."""
    cfg = native_config(raw)
    if cfg is None:
        return None
    with torch.device("meta"):  # the backbone alone: the RoPE table's math on meta would import torch's refs (~2 s)
        backbone = Backbone(cfg)
    shapes = {f"model.{name}": tuple(t.shape) for name, t in backbone.state_dict().items()}
    shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def _weight_files(model_dir: Path) -> list[Path]:
    """The files transformers would read: those of the index's weight map, else ``model.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


def load_decoder(model_dir: Path, config: DecoderConfig) -> DecoderForCausalLM:
    """The checkpoint's weights in a native decoder, fp32; names and shapes must match (else ValueError)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(model_dir):
        weights.update(load_file(str(file)))
    embed, head = weights.get("model.embed_tokens.weight"), weights.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        config = replace(config, tie_word_embeddings=False)  # transformers does not tie distinct tensors either
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    generation = model_dir / "generation_config.json"
    model = DecoderForCausalLM(config, json.loads(generation.read_text()) if generation.is_file() else None)
    expected = dict(model.named_parameters())
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not fit a {config.model_type} model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    misshapen = [f"{name} {tuple(weights[name].shape)} != {tuple(p.shape)}" for name, p in expected.items()
                 if weights[name].shape != p.shape]
    if misshapen:
        raise ValueError(f"{model_dir}: weights do not fit its config.json: {misshapen[:3]}")
    with torch.no_grad():
        for name, param in expected.items():  # a tied lm_head is the embedding's parameter
            # a copy: an fp32 tensor would otherwise stay a view of the file's memory map
            param.data = weights[name].to(torch.float32, copy=True)
    return model
