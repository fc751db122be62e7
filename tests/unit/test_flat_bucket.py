"""SGLang's flattened_bucket format: the byte layout both sides of a broadcast agree on."""

from __future__ import annotations

import pytest
import torch

from relax.weights.buckets import make_buckets
from relax.weights.flat_bucket import BucketSpec, dtype_from_name, flatten, specs_from_manifest, unflatten
from relax.weights.publication import WeightManifest


def mixed_bucket() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: would misalign what follows
        "b.fp32": torch.randn(7, generator=g),
        "c.int64": torch.arange(3),
        "d.bool": torch.tensor([True, False, True]),
        "e.fp16": torch.randn(2, 2, generator=g).half(),
    }


def test_round_trip_keeps_every_tensor_bit_for_bit_with_mixed_dtypes() -> None:
    bucket = mixed_bucket()
    buffer, spec = flatten(bucket)
    assert buffer.dtype == torch.uint8 and buffer.numel() == spec.nbytes == sum(
        t.numel() * t.element_size() for t in bucket.values())
    out = unflatten(buffer.clone(), spec)
    assert set(out) == set(bucket)
    for name, t in bucket.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_wire_order_puts_wider_elements_first_so_every_offset_is_aligned() -> None:
    spec = BucketSpec.of(mixed_bucket())
    assert spec.names == ("c.int64", "b.fp32", "a.bf16", "e.fp16", "d.bool")  # stable within one width
    for offset, dtype in zip(spec.offsets(), spec.dtypes, strict=True):
        assert offset % torch.empty((), dtype=dtype_from_name(dtype)).element_size() == 0


def test_a_misaligned_layout_is_refused_by_name() -> None:
    spec = BucketSpec(("odd", "wide"), ("uint8", "float32"), ((3,), (2,)))
    with pytest.raises(ValueError, match=r"'wide' \(float32\) starts at byte 3"):
        spec.offsets()


def test_flatten_copies_so_later_in_place_updates_do_not_leak_into_a_held_version() -> None:
    w = torch.ones(4)
    buffer, spec = flatten({"w": w})
    w.add_(1)
    assert torch.equal(unflatten(buffer, spec)["w"], torch.ones(4))


def test_non_contiguous_tensors_flatten_by_value() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    buffer, spec = flatten({"t": t})
    assert torch.equal(unflatten(buffer, spec)["t"], t)


def test_a_buffer_of_the_wrong_size_or_type_is_rejected() -> None:
    buffer, spec = flatten({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="holds 12 bytes, the bucket's tensors need 16"):
        unflatten(buffer[:12], spec)
    with pytest.raises(ValueError, match="1-D uint8"):
        unflatten(buffer.view(torch.float32), spec)


def test_dtype_names_accept_both_spellings_and_reject_garbage() -> None:
    assert dtype_from_name("bfloat16") is torch.bfloat16 and dtype_from_name("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        dtype_from_name("float33")


def test_spec_lengths_and_duplicates_are_checked() -> None:
    with pytest.raises(ValueError, match="same length"):
        BucketSpec(("a",), (), ((1,),))
    with pytest.raises(ValueError, match="twice"):
        BucketSpec(("a", "a"), ("float32", "float32"), ((1,), (1,)))


def test_a_manifest_cuts_back_into_the_buckets_it_was_made_from() -> None:
    state = {f"layer{i}.w": torch.randn(64) for i in range(10)}
    buckets = make_buckets(state, bucket_bytes=3 * 256)
    ordered = [{n: b[n] for n in BucketSpec.of(b).names} for b in buckets]
    manifest = WeightManifest.from_buckets(3, ordered)
    specs = specs_from_manifest(manifest.names, manifest.dtypes, manifest.shapes, manifest.bucket_sizes)
    assert [s.names for s in specs] == [BucketSpec.of(b).names for b in buckets]
    assert sum(s.nbytes for s in specs) == manifest.total_bytes
    with pytest.raises(ValueError, match="sum to 9"):
        specs_from_manifest(manifest.names, manifest.dtypes, manifest.shapes, (4, 5))


def test_bf16_publication_halves_the_bytes_on_the_wire() -> None:
    state = {"w": torch.randn(128, 64), "ids": torch.arange(16)}
    fp32 = sum(flatten(b)[1].nbytes for b in make_buckets(state))
    bf16 = sum(flatten(b)[1].nbytes for b in make_buckets(state, dtype=torch.bfloat16))
    assert bf16 == 128 * 64 * 2 + 16 * 8 and fp32 == 128 * 64 * 4 + 16 * 8
