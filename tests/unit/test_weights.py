"""Weight publication pieces: buckets, manifests, the version registry, on-disk materialisation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relax.cluster import scratch
from relax.weights.buckets import (
    cleanup_old,
    make_buckets,
    materialize,
    merge_buckets,
    version_dir,
)
from relax.weights.publication import WeightConflict, WeightManifest, WeightRegistry


def _state(sizes: list[int], dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((n,), float(i), dtype=dtype) for i, n in enumerate(sizes)}


# --------------------------------------------------------------------------------------------------
# Buckets and manifests


def test_buckets_respect_the_size_limit_keep_order_and_lose_nothing() -> None:
    state = _state([10, 20, 5, 40, 1, 1, 30])  # float32: 4 bytes per element
    buckets = make_buckets(state, bucket_bytes=100)
    assert [list(b) for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4", "t5"], ["t6"]]
    big = make_buckets(state, bucket_bytes=160)
    assert [list(b) for b in big] == [["t0", "t1", "t2"], ["t3"], ["t4", "t5", "t6"]]
    for b in buckets + big:
        assert sum(t.numel() * 4 for t in b.values()) <= 160
    merged = merge_buckets(big)
    assert list(merged) == list(state) and all(merged[k] is state[k] for k in state)


def test_a_tensor_larger_than_the_limit_gets_its_own_bucket() -> None:
    buckets = make_buckets(_state([1, 1000, 1]), bucket_bytes=16)
    assert [list(b) for b in buckets] == [["t0"], ["t1"], ["t2"]]
    assert make_buckets({}, bucket_bytes=16) == []
    with pytest.raises(ValueError):
        make_buckets(_state([1]), bucket_bytes=0)


def test_merge_rejects_a_tensor_in_two_buckets() -> None:
    with pytest.raises(ValueError, match="more than one bucket"):
        merge_buckets([{"a": torch.zeros(1)}, {"a": torch.zeros(1)}])


def test_manifest_describes_and_verifies_the_buckets() -> None:
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    buckets = make_buckets(state, bucket_bytes=24)
    m = WeightManifest.from_buckets(4, buckets)
    assert m.version == 4 and m.names == ("w", "b") and m.shapes == ((2, 3), (3,))
    assert m.dtypes == ("float32", "bfloat16") and m.total_bytes == 24 + 6 and m.bucket_sizes == (1, 1)
    m.verify(buckets)
    with pytest.raises(ValueError, match="missing"):
        m.verify(buckets[:1])
    with pytest.raises(ValueError, match="manifest says"):
        m.verify([{"w": torch.zeros(3, 2)}, buckets[1]])
    with pytest.raises(ValueError):
        WeightManifest(0, ("a", "a"), ((1,), (1,)), ("float32", "float32"), 8)


# --------------------------------------------------------------------------------------------------
# Registry


def _manifest(version: int) -> WeightManifest:
    return WeightManifest.from_buckets(version, [{"w": torch.zeros(1)}])


def test_registry_keeps_the_last_two_versions_in_order() -> None:
    now = [100.0]
    reg = WeightRegistry(clock=lambda: now[0])
    assert reg.latest() is None and reg.latest_version is None and len(reg) == 0
    for v in (0, 1, 3):
        now[0] += 1
        entry = reg.publish(v, [f"ref-{v}"], _manifest(v))
        assert entry.published_at == now[0]
    assert reg.versions() == [1, 3] and reg.latest_version == 3
    assert reg.get(1).bucket_refs == ("ref-1",)
    with pytest.raises(KeyError, match="not held"):
        reg.get(0)  # dropped: its refs are released


def test_a_version_published_again_is_a_no_op_and_with_other_weights_a_conflict() -> None:
    reg = WeightRegistry(keep=3)
    manifest = dataclasses.replace(_manifest(2), checksums={"w": "00aa"})
    first = reg.publish(2, ["r"], manifest)
    assert reg.publish(2, ["r"], dataclasses.replace(manifest)) is first  # a retried registration
    with pytest.raises(WeightConflict, match="version 2 is already published with other weights"):
        reg.publish(2, ["r"], dataclasses.replace(manifest, checksums={"w": "00bb"}))
    with pytest.raises(WeightConflict):
        reg.publish(2, ["r"], manifest, sender="another trainer")
    assert reg.versions() == [2] and reg.latest() is first


def test_registry_rejects_versions_that_do_not_increase_and_bad_manifests() -> None:
    reg = WeightRegistry(keep=3)
    reg.publish(2, ["r"], _manifest(2))
    with pytest.raises(ValueError, match="strictly increase"):
        reg.publish(1, ["r"], _manifest(1))
    with pytest.raises(ValueError, match="manifest is for version"):
        reg.publish(5, ["r"], _manifest(4))
    with pytest.raises(ValueError, match="bucket refs"):
        reg.publish(5, ["r", "extra"], _manifest(5))
    assert reg.versions() == [2]
    with pytest.raises(ValueError):
        WeightRegistry(keep=0)


# --------------------------------------------------------------------------------------------------
# On disk


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A very small tied-embedding Qwen3 written by save_pretrained (the shape of the tiny preset)."""
    cfg = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf")
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def test_materialize_writes_a_directory_from_pretrained_loads_identically(hf_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    state = {k: v.detach().clone() + 0.5 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = materialize(make_buckets(state, bucket_bytes=1024), hf_dir, tmp_path / "e0" / "v3")
    assert out == tmp_path / "e0" / "v3"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["v3"]  # no temporary directory left behind
    loaded, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # re-materialising a version replaces it
    materialize([{k: v + 1 for k, v in state.items()}], hf_dir, out)
    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(again.state_dict()["model.norm.weight"], state["model.norm.weight"] + 1)


def test_materialize_failure_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()  # no config.json
    with pytest.raises(FileNotFoundError):
        materialize([{"w": torch.zeros(1)}], tmp_path / "cfg", tmp_path / "root" / "v1")
    assert list((tmp_path / "root").iterdir()) == []


def test_cleanup_keeps_the_newest_versions(tmp_path: Path) -> None:
    for v in (1, 2, 10, 3):
        version_dir(tmp_path, v).mkdir()
    (tmp_path / ".tmp-v11-abc").mkdir()
    removed = cleanup_old(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["v1", "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-v11-abc", "v10", "v3"]
    assert cleanup_old(tmp_path / "absent", keep=1) == []


def test_default_root_is_per_engine_inside_the_run_scratch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RELAX_SCRATCH_DIR", str(tmp_path))
    monkeypatch.setenv("RELAX_RUN_ID", "r1")
    root = scratch.weights_root("engine-3")
    assert root == tmp_path / "relax-run-r1" / "weights" / "engine-3"
    assert (tmp_path / "relax-run-r1" / ".lease").is_file()
    scratch.release(tmp_path / "relax-run-r1")
    assert not (tmp_path / "relax-run-r1").exists()
    assert version_dir(root, 7).name == "v7"
