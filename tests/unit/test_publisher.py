"""What a publication sends (bf16 where engines serve bf16, the trainer's fp32 elsewhere), and how rank 0 holds it:
copied in behind the hold, once per version."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from relax.training import sender as sender_module
from relax.training.publisher import publication_dtype
from relax.training.sender import WeightSender
from relax.weights.digest import layout_checksums
from relax.weights.flat_bucket import unflatten
from relax.weights.publication import WeightConflict
from tests.weight_sender import held_versions


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


def test_a_version_held_again_is_a_no_op_with_the_same_weights_and_a_conflict_with_others() -> None:
    gen = torch.Generator().manual_seed(1)
    state = {"a.weight": torch.randn(64, 32, generator=gen), "b.bias": torch.randn(32, generator=gen)}
    sender = WeightSender("127.0.0.1")
    try:
        first = sender.hold(3, state, bucket_bytes=4096)
        assert sender.hold(3, {k: v.clone() for k, v in state.items()}, bucket_bytes=4096) == first
        changed = {**state, "b.bias": state["b.bias"] + 1}
        with pytest.raises(WeightConflict, match="version 3 is already held with digest"):
            sender.hold(3, changed, bucket_bytes=4096)
        with pytest.raises(WeightConflict, match="other tensors"):
            sender.hold(3, {"a.weight": state["a.weight"]}, bucket_bytes=4096)
        with pytest.raises(ValueError, match="strictly increase"):
            sender.hold(2, state)
        assert held_versions(sender) == [3]
        assert sender.checksums(3) == layout_checksums(state, "hf")
    finally:
        sender.shutdown()


def test_the_hold_returns_before_its_buckets_are_copied_and_a_send_waits_for_its_own_bucket() -> None:
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}  # 1 KiB each: one bucket each
    sender = WeightSender("127.0.0.1")
    release = threading.Event()
    real_flatten = sender_module.flatten
    copied: list[str] = []

    def slow_flatten(bucket: dict, spec: Any, **kw: Any) -> Any:
        if spec.names[0] == "w2":
            release.wait(30)  # the third bucket's copy is held until the test lets it go
        copied.append(spec.names[0])
        return real_flatten(bucket, spec, **kw)

    sender_module.flatten = slow_flatten
    try:
        manifest = sender.hold(1, state, bucket_bytes=1024)
        assert manifest.bucket_sizes == (1, 1, 1, 1)
        held = sender._held(1)
        held.wait_ready(1, timeout_s=30)  # the first buckets are ready while the third is still copying
        assert not held.ready[2].done() and not held.ready[3].done()
        waiter = threading.Thread(target=sender.wait_copied)  # the optimizer step's wait
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # the next step may not change the weights yet
        release.set()
        waiter.join(30)
        assert not waiter.is_alive() and copied == ["w0", "w1", "w2", "w3"]
        assert torch.equal(unflatten(held.buffers[3], held.specs[3])["w3"], state["w3"])
    finally:
        release.set()
        sender_module.flatten = real_flatten
        sender.shutdown()
