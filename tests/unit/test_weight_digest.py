"""Checksums of a publication as SGLang's /weights_checker reports them (relax.weights.digest).

The real engine's side is tests/sglang/test_training.py: every tensor of every version matched there."""

from __future__ import annotations

import hashlib

import pytest
import torch

from relax.weights.digest import (
    ChecksumLayout,
    checksum_mismatches,
    layout_checksums,
    sglang_checksums,
    sglang_layout,
    tensor_checksum,
    version_digest,
)


def hf_layer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(*s, generator=g) for n, s in {
        "model.embed_tokens.weight": (70, 8), "model.norm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.mlp.gate_proj.weight": (16, 8), "model.layers.0.mlp.up_proj.weight": (16, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 16)}.items()}
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()  # tied
    return t


def test_the_layout_fuses_qkv_and_gate_up_pads_the_vocabulary_and_drops_a_tied_head() -> None:
    state = hf_layer()
    layout = sglang_layout(state)
    assert sorted(layout) == ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                              "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                              "model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"]
    qkv = layout["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    embed = layout["model.embed_tokens.weight"]
    assert embed.shape == (128, 8) and torch.equal(embed[:70], state["model.embed_tokens.weight"])
    assert not embed[70:].any()


def test_a_checksum_is_sha256_of_the_bytes_and_any_change_shows() -> None:
    t = torch.arange(6, dtype=torch.bfloat16)
    assert tensor_checksum(t) == hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).digest()[:8].hex()
    expected = sglang_checksums(hf_layer(), torch.bfloat16)
    changed = hf_layer()
    changed["model.layers.0.mlp.up_proj.weight"][3, 3] += 1.0
    assert checksum_mismatches(expected, sglang_checksums(changed, torch.bfloat16)) == [
        "model.layers.0.mlp.gate_up_proj.weight"]
    assert checksum_mismatches(expected, {**expected, "extra": "0"}) == ["extra"]


def test_a_publication_missing_part_of_a_fused_tensor_is_refused() -> None:
    state = hf_layer()
    del state["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match="qkv_proj"):
        sglang_layout(state)


def test_hashing_the_parts_in_place_equals_hashing_the_fused_padded_tensors() -> None:
    state = hf_layer()
    del state["lm_head.weight"]  # a publication drops a tied head (as a checkpoint does)
    state["lm_head.weight"] = torch.randn(70, 8)  # an untied one is served, padded like the embedding
    copied = {name: tensor_checksum(t) for name, t in sglang_layout(state).items()}
    assert layout_checksums(state, ChecksumLayout.SGLANG) == copied
    assert layout_checksums(state, ChecksumLayout.SGLANG, threads=1) == copied
    assert layout_checksums(state, "hf") == {name: tensor_checksum(t) for name, t in state.items()}


def test_the_version_digest_is_sglangs_per_gpu_checksum() -> None:
    checksums = {"b": "00ff", "a": "1234"}
    assert version_digest(checksums) == hashlib.sha256(b"a1234b00ff").hexdigest()
    assert version_digest({**checksums, "a": "1235"}) != version_digest(checksums)
