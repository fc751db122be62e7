"""benchmarks/gpu_check.py: the parts that need no GPU (arithmetic, peak lookup, bucket layout, tokenizer) and the
script's CPU paths (no CUDA -> exit 2; ``--cpu-smoke`` runs every check's code on the CPU with gloo)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def load_gpu_check() -> ModuleType:
    """benchmarks/ is not a package: load the script by path (it imports its sibling ``report`` by name)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


gc = load_gpu_check()


# -- parameters and FLOPs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [gc.QWEN3_0_6B, gc.QUICK_100M, gc.SMOKE_TINY], ids=["0.6B", "quick", "smoke"])
def test_count_parameters_matches_transformers(shape) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gc.qwen3_config(shape))
    counted = gc.count_parameters(shape)
    assert counted["total"] == sum(p.numel() for p in model.parameters())
    assert counted["embedding"] == model.get_input_embeddings().weight.numel()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert counted["matmul"] == linear  # every nn.Linear, the (tied) LM head included once


def test_qwen3_0_6b_shape_is_the_real_size() -> None:
    assert gc.count_parameters(gc.QWEN3_0_6B)["total"] == 596_049_920  # Qwen3-0.6B, tied embedding
    assert 90e6 < gc.count_parameters(gc.QUICK_100M)["total"] < 120e6


def test_flops_per_token_and_mfu() -> None:
    flops = gc.train_flops_per_token(matmul_params=1_000, layers=2, attention_dim=8, seq_len=16)
    assert flops == 6 * 1_000 + 12 * 2 * 8 * 16
    assert gc.mfu(tokens_per_s=1e3, flops_per_token=flops, peak_flops=flops * 4e3) == pytest.approx(0.25)
    assert gc.mfu(1e3, flops, None) is None
    assert gc.mfu(1e3, flops, 0.0) is None
    # Qwen3-0.6B at seq 1024: the 6N term dominates, attention (2048 wide: 16 heads x 128) adds ~20 %.
    n = gc.count_parameters(gc.QWEN3_0_6B)["matmul"]
    full = gc.train_flops_per_token(n, 28, 16 * 128, 1024)
    assert 0.19 < (full - 6 * n) / (6 * n) < 0.21


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H200", 989), ("NVIDIA GH200 480GB", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835), ("NVIDIA H20", 148), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA L4", 121), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA B200", 2250),
])
def test_peak_lookup_by_device_name(name: str, tflops: float) -> None:
    peak, source = gc.peak_bf16_flops(name)
    assert peak == tflops * 1e12
    assert source.startswith("table:")


def test_peak_lookup_unknown_device_and_override() -> None:
    peak, why = gc.peak_bf16_flops("Tesla T4")
    assert peak is None and "--peak-tflops" in why
    assert gc.peak_bf16_flops("Tesla T4", 65.0) == (65e12, "--peak-tflops")
    assert gc.peak_bf16_flops("NVIDIA H200", 500.0)[0] == 500e12  # the flag wins over the table


# -- flattened buckets -----------------------------------------------------------------------------------------


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.int8": torch.randint(-100, 100, (3,), dtype=torch.int8, generator=g),
        "a.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "c.fp32": torch.randn(7, generator=g),
        "d.scalar": torch.tensor(2.5, dtype=torch.float64),
        "e.empty": torch.empty(0, 4, dtype=torch.float16),
        "f.fp16": torch.randn(2, 2, generator=g).to(torch.float16),
    }


def _specs(tensors):
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def test_layout_is_in_name_order_with_aligned_offsets() -> None:
    tensors = _mixed_tensors()
    (layout,) = gc.plan_buckets(_specs(tensors), bucket_bytes=1 << 20)
    assert [s.name for s in layout.slots] == sorted(tensors)
    end = 0
    for slot in layout.slots:
        t = tensors[slot.name]
        assert slot.offset % t.element_size() == 0  # a uint8 slice views as the dtype only when aligned
        assert slot.offset >= end and slot.offset - end < t.element_size()  # no more padding than alignment needs
        assert slot.nbytes == t.numel() * t.element_size()
        end = slot.offset + slot.nbytes
    assert layout.nbytes == end
    # a.bf16 (30 B) then b.int8 (3 B) at 30, so c.fp32 must move from 33 to 36
    offsets = {s.name: s.offset for s in layout.slots}
    assert offsets["a.bf16"] == 0 and offsets["b.int8"] == 30 and offsets["c.fp32"] == 36
    assert offsets["d.scalar"] == 64  # 36 + 28 = 64, already a multiple of 8


def test_buckets_respect_the_limit_and_an_oversized_tensor_gets_its_own() -> None:
    specs = [("w0", (10,), torch.float32), ("w1", (10,), torch.float32), ("w2", (100,), torch.float32),
             ("w3", (5,), torch.float32), ("w4", (6,), torch.float32)]
    layouts = gc.plan_buckets(specs, bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in layouts] == [["w0"], ["w1"], ["w2"], ["w3", "w4"]]
    assert [b.nbytes for b in layouts] == [40, 40, 400, 44]
    assert all(b.slots[0].offset == 0 for b in layouts)
    with pytest.raises(ValueError):
        gc.plan_buckets(specs, bucket_bytes=0)


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 40, 1])
def test_pack_unpack_round_trip_bit_for_bit(bucket_bytes: int) -> None:
    sent = _mixed_tensors()
    received = {n: torch.zeros_like(t) for n, t in sent.items()}
    layouts = gc.plan_buckets(_specs(sent), bucket_bytes)
    assert sorted(s.name for b in layouts for s in b.slots) == sorted(sent)
    wire = torch.empty(max(b.nbytes for b in layouts), dtype=torch.uint8)  # one receive buffer, reused
    for layout in layouts:
        send_buffer = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
        gc.pack_bucket(layout, sent, send_buffer)
        wire[: layout.nbytes].copy_(send_buffer)  # stands in for dist.broadcast
        gc.unpack_bucket(layout, wire[: layout.nbytes], received)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    assert gc.checksums(received) == gc.checksums(sent)


def test_bucket_views_are_views_and_check_the_buffer() -> None:
    tensors = _mixed_tensors()
    (layout,) = gc.plan_buckets(_specs(tensors), 1 << 20)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = gc.bucket_views(layout, buffer)
    views["c.fp32"].fill_(1.0)
    c = next(s for s in layout.slots if s.name == "c.fp32")
    assert torch.equal(buffer[c.offset : c.offset + 4], torch.tensor([0, 0, 128, 63], dtype=torch.uint8))
    with pytest.raises(ValueError):
        gc.bucket_views(layout, buffer[:-1])
    with pytest.raises(ValueError):
        gc.bucket_views(layout, torch.zeros(layout.nbytes, dtype=torch.int8))


def test_checksum_catches_moved_bytes_a_plain_sum_would_not() -> None:
    t = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    swapped = t.clone()
    swapped[0, 0], swapped[0, 1] = t[0, 1], t[0, 0]
    assert gc.tensor_checksum(t)[1] == gc.tensor_checksum(swapped)[1]  # same sum ...
    assert gc.tensor_checksum(t) != gc.tensor_checksum(swapped)  # ... not the same place
    assert gc.tensor_checksum(t) == gc.tensor_checksum(t.clone())
    assert gc.tensor_checksum(t, chunk=3) == gc.tensor_checksum(t)  # chunking changes nothing
    odd = torch.arange(5, dtype=torch.uint8)
    assert gc.tensor_checksum(odd)[0] == 5


# -- the offline tokenizer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [259, 1024, 70_000])
def test_byte_bpe_vocab_has_exactly_the_size_and_valid_merges(size: int) -> None:
    vocab, merges = gc.byte_bpe_vocab(size)
    assert len(vocab) == size and sorted(vocab.values()) == list(range(size))
    assert [t for t, i in vocab.items() if i >= size - 3] == list(gc.SPECIAL_TOKENS)  # specials last, as Qwen
    for left, right in merges:
        assert vocab[left] < vocab[left + right] and vocab[right] < vocab[left + right]


def test_byte_bpe_vocab_rejects_too_small() -> None:
    with pytest.raises(ValueError):
        gc.byte_bpe_vocab(258)


def test_byte_tokenizer_decodes_every_id() -> None:
    tok = gc.build_byte_tokenizer(1024)
    assert len(tok) == 1024
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.eos_token_id == 1023
    text = "hello, world"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert isinstance(tok.decode(list(range(1024))), str)  # any sampled id decodes


# -- the script ------------------------------------------------------------------------------------------------


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_exits_2_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = _run("--quick", "--out", str(out), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == gc.NO_CUDA_MESSAGE and result.stdout == ""
    assert not out.exists()


def test_unknown_check_is_a_usage_error() -> None:
    result = _run("--checks", "train,nope", timeout=120)
    assert result.returncode == 2 and "nope" in result.stderr


@pytest.mark.e2e
def test_cpu_smoke_runs_every_check(tmp_path: Path) -> None:
    """The code the GPU will run, on the CPU: FSDP2 with gloo, the engine with --device cpu, gloo broadcast and
    shared-memory IPC, each verified by checksums."""
    out = tmp_path / "smoke.json"
    result = _run("--cpu-smoke", "--out", str(out), timeout=280)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["statuses"] == {"fsdp2_train_step": "ok", "builtin_engine": "ok", "weight_transfer": "ok",
                                  "weight_digest": "ok"}
    train = report["checks"]["fsdp2_train_step"]
    assert train["parameters"] == gc.count_parameters(gc.SMOKE_TINY)["total"]
    assert train["master_weights"] == "torch.float32 DTensor" and train["mfu"] is None
    engine = report["checks"]["builtin_engine"]
    assert engine["server_device"] == "cpu" and engine["concurrency_16"]["completion_tokens"] == 16 * 8
    transfer = report["checks"]["weight_transfer"]
    for part in (transfer["broadcast"], transfer["shared_memory_ipc"]):
        assert part["verified"] and part["receiver_differed_before"] and part["buckets"] > 1
    digest = report["checks"]["weight_digest"]
    assert digest["sglang-gpu"]["served_tensors"] == digest["sha256"]["served_tensors"] > 0


# -- how the transfer runs are summarized ----------------------------------------------------------------------


def _rank_results(receiver_checksums: dict) -> list[dict]:
    sums = {"w": [2, 3, 4]}
    sender = {"rank": 0, "ok": True, "weight_bytes": 2_000_000_000, "tensors": 1, "buckets": 4,
              "bucket_bytes": [1], "copy_s": [0.002, 0.001], "pipeline_s": [0.5, 0.2], "broadcast_s": [0.3, 0.1],
              "checksums_before": None, "checksums": sums}
    receiver = {"rank": 1, "ok": True, "copy_s": None, "pipeline_s": [0.4, 0.25], "broadcast_s": [0.2, 0.12],
                "checksums_before": {"w": [2, 3, 5]}, "checksums": receiver_checksums}
    return [sender, receiver]


def test_broadcast_summary_takes_the_slower_rank_of_the_best_pass() -> None:
    summary = gc.summarize_broadcast(_rank_results({"w": [2, 3, 4]}), "nccl")
    assert summary["status"] == "ok" and summary["verified"] and summary["receiver_differed_before"]
    assert summary["broadcast_s"] == 0.12 and summary["pipeline_s"] == 0.25  # max over ranks, min over passes
    assert summary["broadcast_gb_per_s"] == pytest.approx(2e9 / 0.12 / 1e9, abs=0.01)
    assert summary["copy_gb_per_s"] == 2000.0 and summary["broadcast_over_copy_s"] == 120.0


def test_broadcast_summary_fails_when_a_tensor_differs() -> None:
    summary = gc.summarize_broadcast(_rank_results({"w": [2, 3, 5]}), "nccl")
    assert summary["status"] == "failed" and summary["mismatched_tensors"] == ["w"]


def test_nccl_refusing_two_ranks_on_one_gpu_is_unsupported_not_failed() -> None:
    error = ("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1727, invalid usage, NCCL version 2.21.5\n"
             "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
             "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")
    results = [{"rank": 0, "ok": False, "error": error}, {"rank": 1, "ok": False, "error": error}]
    assert gc.summarize_broadcast(results, "nccl")["status"] == "unsupported"
    other = [{"rank": 0, "ok": False, "error": "OutOfMemoryError: CUDA out of memory"}, results[1]]
    assert gc.summarize_broadcast(other, "nccl")["status"] == "unsupported"  # one rank's refusal says why
    oom = [{"rank": 0, "ok": False, "error": "OutOfMemoryError: CUDA out of memory"}]
    assert gc.summarize_broadcast(oom, "nccl")["status"] == "failed"
