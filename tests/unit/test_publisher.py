"""What a publication sends: bf16 where engines serve bf16 (half the bytes), the trainer's fp32 elsewhere."""

from __future__ import annotations

import torch

from relax.training.flat_bucket import unflatten
from relax.training.publisher import publication_dtype
from relax.training.sender import WeightSender


def test_sglang_engines_are_sent_bf16_and_the_builtin_engine_fp32() -> None:
    assert publication_dtype("sglang") is torch.bfloat16
    assert publication_dtype("builtin") is None


def test_a_bf16_publication_halves_the_bytes_and_keeps_bf16_values() -> None:
    gen = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(64, 32, generator=gen), "b.bias": torch.randn(32, generator=gen)}
    sender = WeightSender("127.0.0.1")
    fp32 = sender.hold(1, state)
    bf16 = sender.hold(2, state, dtype=torch.bfloat16)
    assert bf16.total_bytes * 2 == fp32.total_bytes == sum(t.numel() * 4 for t in state.values())
    assert set(bf16.dtypes) == {"bfloat16"} and set(fp32.dtypes) == {"float32"}
    held = sender._held(2)
    held.wait_ready(timeout_s=30)  # copied in behind the hold
    received = unflatten(held.buffers[0], held.specs[0])  # what an engine unpacks from the broadcast
    for name, tensor in state.items():
        assert torch.equal(received[name], tensor.to(torch.bfloat16))
    sender.shutdown()
