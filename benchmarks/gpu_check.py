"""One-GPU check: a bf16 FSDP2 training step, the built-in engine on CUDA and a weight broadcast, on random weights.

Made for a machine with one CUDA GPU and nothing but torch + transformers (no Ray, no SGLang, no network, no
download): every model is a Qwen3-shaped config with random weights, and the engine's tokenizer is built
offline. Three independent checks, each in processes of its own so that one that fails, hangs or poisons its CUDA
context cannot take the others down; the report says what each measured, or its error:

1. ``fsdp2_train_step``: the trainer's recipe in one process (NCCL, world size 1, a 1-GPU mesh, ``fully_shard``
   per decoder layer and at the root) with ``MixedPrecisionPolicy(bf16 params, fp32 reduce)`` over fp32 master
   weights, TF32 on, SDPA attention, AdamW and gradient clipping; tokens/s, step seconds, peak memory and the
   model FLOP utilisation (``mfu``, with the formula it used and the peak it divided by).
2. ``builtin_engine``: ``relax engine serve --device cuda`` on a loopback port, serving the same shape; tokens/s
   at 1 and 16 concurrent requests (fixed-length outputs, ``ignore_eos``), beside the bytes of weights a decode
   step reads per second.
3. ``weight_transfer``: a "trainer" process (rank 0) sends its bf16 weights to an "engine" process (rank 1) in
   buckets laid out as SGLang's ``flattened_bucket`` load format (every tensor's bytes concatenated in name
   order, in one uint8 buffer per bucket) over NCCL, on the weight-update group built as SGLang builds it
   (``relax.weights.group``); timed beside a
   device-to-device copy of the same bytes, and verified by checksums. NCCL refuses two ranks on one GPU (it
   needs one GPU per rank): that outcome is reported as ``unsupported`` with NCCL's error, and the same buckets
   also go over CUDA IPC (``torch.multiprocessing``), which is how an engine colocated on the trainer's GPU
   receives weights (SGLang's ``update_weights_from_tensor``).
4. ``weight_digest``: what a verified refit costs rank 0 (``--verify-weights``): the model's bf16 weights hashed in
   SGLang's layout with SGLang's GPU hash (``relax.weights.digest.sglang_gpu_hash``, in torch, on the
   device) and with SHA-256 (on the host), in GB/s, and the seconds that makes for Qwen3-4B's 8.05 GB.

    python benchmarks/gpu_check.py [--quick] [--out FILE] [--peak-tflops X] [--checks train,engine,transfer,digest]

``--quick`` shrinks everything (a ~100M model, 2 timed steps, short bursts), sized for ~3 minutes on an H200; the
default (Qwen3-0.6B's shape, 8 x 1024 tokens a step) for well under 8. ``--checks`` runs a subset (to rerun one).
Exit code 0 when no check failed, 1 when one did, 2 without a CUDA device; ``unsupported`` (NCCL refusing two
ranks on one GPU) is an outcome, not a failure. ``--cpu-smoke`` runs the same code paths on the CPU (gloo, a tiny
model, the engine with ``--device cpu``) to check this script without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from report import machine, save_report

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `relax` (the engine check only) without a pip install of the checkout
    sys.path.insert(0, str(REPO_ROOT))

LOOPBACK = "127.0.0.1"
NO_CUDA_MESSAGE = "no CUDA device: this check needs one GPU"
CHECKS = ("train", "engine", "transfer", "digest")
#: What the built-in engine's server imports beyond torch + transformers; checked before anything is built.
ENGINE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "httpx")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, chat start, eos: Qwen's, last in the vocab
GIB = 1 << 30
#: How long the other ranks get to report once one has failed (they may be blocked on it until the timeout).
FAILURE_GRACE_S = 20.0


# -- shapes and plans --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3 decoder's size; the embedding is tied to the LM head, as in Qwen3-0.6B."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = 151936


QWEN3_0_6B = ModelShape(1024, 3072, 28, 16, 8, 128)
QUICK_100M = ModelShape(512, 1536, 8, 8, 4, 64)
SMOKE_TINY = ModelShape(64, 128, 2, 4, 2, 16, vocab_size=1024)


@dataclass(frozen=True)
class Plan:
    """How big each check runs. The timeouts bound each check's processes at a few times what they should take
    (a hang is a failure, not a stall of the whole run); ``dist_timeout_s`` bounds one collective."""

    name: str
    model: ModelShape
    train_batch: int
    train_seq: int
    warmup_steps: int
    timed_steps: int
    prompt_tokens: int
    max_new_tokens: int
    requests_at_1: int
    requests_at_16: int
    bucket_bytes: int
    transfer_repeats: int
    train_timeout_s: float
    engine_timeout_s: float
    transfer_timeout_s: float
    dist_timeout_s: float = 120.0


PLANS: dict[str, Plan] = {
    "full": Plan("full", QWEN3_0_6B, train_batch=8, train_seq=1024, warmup_steps=3, timed_steps=10,
                 prompt_tokens=128, max_new_tokens=64, requests_at_1=4, requests_at_16=48,
                 bucket_bytes=512 << 20, transfer_repeats=3, train_timeout_s=300, engine_timeout_s=300,
                 transfer_timeout_s=180),
    "quick": Plan("quick", QUICK_100M, train_batch=4, train_seq=512, warmup_steps=1, timed_steps=2,
                  prompt_tokens=128, max_new_tokens=64, requests_at_1=2, requests_at_16=16,
                  bucket_bytes=128 << 20, transfer_repeats=2, train_timeout_s=180, engine_timeout_s=180,
                  transfer_timeout_s=120),
    "smoke": Plan("smoke", SMOKE_TINY, train_batch=2, train_seq=64, warmup_steps=1, timed_steps=2,
                  prompt_tokens=16, max_new_tokens=8, requests_at_1=2, requests_at_16=16,
                  bucket_bytes=64 << 10, transfer_repeats=2, train_timeout_s=180, engine_timeout_s=180,
                  transfer_timeout_s=120),
}


def count_parameters(shape: ModelShape) -> dict[str, int]:
    """Parameters of a tied-embedding Qwen3 of ``shape``, computed from the shape (printed before anything is built).

    ``matmul`` is what the FLOP count needs: every weight a token is multiplied by, so the embedding *lookup* is
    left out and the LM head counted once (with a tied embedding, that is the total less the norm weights).
    """
    h, d = shape.hidden_size, shape.head_dim
    q_out, kv_out = shape.num_attention_heads * d, shape.num_key_value_heads * d
    attention = h * q_out + 2 * h * kv_out + q_out * h
    mlp = 3 * h * shape.intermediate_size
    norms = 2 * d + 2 * h  # q_norm, k_norm (per head_dim), input and post-attention RMSNorm
    embedding = shape.vocab_size * h
    total = embedding + shape.num_hidden_layers * (attention + mlp + norms) + h  # + the final norm
    matmul = shape.num_hidden_layers * (attention + mlp) + embedding  # the LM head multiplies by the tied embedding
    return {"total": total, "embedding": embedding, "matmul": matmul}


def qwen3_config(shape: ModelShape, *, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 dtype: str = "float32"):
    """A ``Qwen3Config`` of ``shape`` with SDPA attention; Qwen3-0.6B's other settings (rope, norms) by default."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **asdict(shape), tie_word_embeddings=True, attn_implementation="sdpa", bos_token_id=None,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, dtype=dtype,
    )


# -- FLOPs and the peak they are measured against ----------------------------------------------------------------

#: Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets, matched as substrings of
#: ``torch.cuda.get_device_name()`` in this order: a name that contains another (GH200 > H200 > H20, L40S > L40 >
#: L4, H100 PCIe > H100) comes first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H20", 148.0),
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)
FLOPS_FORMULA = ("6*N_matmul + 12*layers*(heads*head_dim)*seq per token (PaLM, appendix B): N_matmul counts every "
                 "weight a token is multiplied by (the LM head, not the embedding lookup); attention is counted "
                 "without the causal mask's halving, as PaLM and Megatron do")


def peak_bf16_flops(device_name: str, override_tflops: float | None = None) -> tuple[float | None, str]:
    """The device's dense bf16 peak in FLOP/s and where it came from; ``(None, why)`` when it is not known."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    name = device_name.upper()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"table: {key} ({tflops:g} TFLOP/s dense bf16)"
    return None, f"{device_name!r} is not in the peak table: pass --peak-tflops to get an MFU"


def train_flops_per_token(matmul_params: int, layers: int, attention_dim: int, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token (see ``FLOPS_FORMULA``): 2 per multiply-add, x3 for backward."""
    return 6.0 * matmul_params + 12.0 * layers * attention_dim * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOP utilisation: the FLOPs the model needs per second over the device's peak (None without a peak)."""
    if not peak_flops or peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_token / peak_flops


# -- flattened buckets -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes sit in its bucket; ``offset`` is a multiple of the dtype's size."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its tensors in name order and the size of the uint8 buffer that holds them."""

    slots: tuple[TensorSlot, ...]
    nbytes: int


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def plan_buckets(tensors: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> list[BucketLayout]:
    """Lay tensors out in buckets of at most ``bucket_bytes``, in name order, as SGLang's ``flattened_bucket``.

    Both sides compute the same layout from names, shapes and dtypes alone, so only the bytes travel. Offsets are
    aligned to each tensor's element size because a uint8 slice can be viewed as a wider dtype only when its offset
    is a multiple of that dtype's size (that is what lets one bucket mix dtypes). A tensor larger than a bucket
    gets a bucket of its own rather than being split: every tensor is then one view of one buffer.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    layouts: list[BucketLayout] = []
    slots: list[TensorSlot] = []
    used = 0
    for name, shape, dtype in sorted(tensors, key=lambda t: t[0]):
        size = dtype.itemsize
        nbytes = size * _numel(shape)
        offset = _align_up(used, size)
        if slots and offset + nbytes > bucket_bytes:
            layouts.append(BucketLayout(tuple(slots), used))
            slots, offset = [], 0
        slots.append(TensorSlot(name, tuple(int(s) for s in shape), dtype, offset, nbytes))
        used = offset + nbytes
    if slots:
        layouts.append(BucketLayout(tuple(slots), used))
    return layouts


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def bucket_views(layout: BucketLayout, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor of the bucket as a view of ``buffer`` (uint8, at least ``layout.nbytes``): no copy."""
    if buffer.dtype != torch.uint8 or buffer.numel() < layout.nbytes:
        raise ValueError(f"need a uint8 buffer of at least {layout.nbytes} bytes, got {buffer.dtype} "
                         f"x {buffer.numel()}")
    return {s.name: buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in layout.slots}


def pack_bucket(layout: BucketLayout, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy the bucket's tensors into ``buffer`` (the sender's side); alignment padding is left as it is."""
    for name, view in bucket_views(layout, buffer).items():
        view.copy_(tensors[name])


def unpack_bucket(layout: BucketLayout, buffer: torch.Tensor, into: Mapping[str, torch.Tensor]) -> None:
    """Copy the bucket's tensors out of ``buffer`` into the preallocated tensors ``into`` (the receiver's side)."""
    for name, view in bucket_views(layout, buffer).items():
        into[name].copy_(view)


def tensor_checksum(tensor: torch.Tensor, chunk: int = 1 << 24) -> tuple[int, int, int]:
    """``(bytes, sum, position-weighted sum)`` of the tensor's raw bytes, exact integers, on the tensor's device.

    The weighted sum catches bytes that arrive in the wrong place (a wrong offset), which a plain sum would not;
    exact integers because two copies of the same weights must agree bit for bit. Chunked to bound memory.
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    total = weighted = 0
    for start in range(0, words.numel(), chunk):
        part = words[start : start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
        total += int(part.sum())
        weighted += int((part * weights).sum())
    return raw.numel(), total, weighted


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(tensor_checksum(t)) for name, t in sorted(tensors.items())}


# -- an offline tokenizer of any vocabulary size -----------------------------------------------------------------


def byte_bpe_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly ``vocab_size`` tokens: 256 bytes, merges, then the specials.

    The merges are every pair of bytes, then byte triples, in order: a tokenizer trained on text would do better,
    but the models here have random weights, and what matters is that every id the engine samples decodes and
    that the vocabulary is as large as Qwen3's, so the LM head costs what it costs in Qwen3-0.6B. (The tiny
    preset's trained BPE runs out of merges at ~350 tokens.)
    """
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    n_merges = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
    if n_merges < 0 or n_merges > len(alphabet) ** 2 + len(alphabet) ** 3:
        raise ValueError(f"vocab_size {vocab_size} is outside {len(alphabet) + len(SPECIAL_TOKENS)}.."
                         f"{len(alphabet) ** 3 + len(alphabet) ** 2 + len(alphabet) + len(SPECIAL_TOKENS)}")
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []

    def pairs() -> Iterable[tuple[str, str]]:
        yield from ((a, b) for a in alphabet for b in alphabet)
        yield from ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)

    for left, right in pairs():
        if len(merges) == n_merges:
            break
        merges.append((left, right))
        vocab[left + right] = len(vocab)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab, merges


def build_byte_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` over ``byte_bpe_vocab`` (Qwen's pad and eos tokens), built without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = byte_bpe_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    pad, im_start, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, additional_special_tokens=[im_start],
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def write_random_checkpoint(shape: ModelShape, out_dir: Path, seed: int = 0,
                            device: torch.device | None = None) -> dict[str, Any]:
    """Save a random-weight Qwen3 of ``shape`` (bf16 safetensors) and a matching tokenizer under ``out_dir``.

    Built directly in bf16 (half the memory and the disk of fp32; the engine loads it in fp32), on ``device``
    because a GPU fills 0.6B random weights in a blink where a CPU takes a while.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's one-shard bar is noise in the check's output
    began = time.perf_counter()
    tokenizer = build_byte_tokenizer(shape.vocab_size)
    if len(tokenizer) != shape.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, the model {shape.vocab_size}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = qwen3_config(shape, eos_token_id=eos, pad_token_id=pad, dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # the engine, not this process, should hold the GPU's memory
    return {"parameters": params, "write_s": round(time.perf_counter() - began, 2)}


# -- processes ---------------------------------------------------------------------------------------------------


class ChildFailed(RuntimeError):
    """A check's process raised, died or timed out; carries its traceback for the report."""

    def __init__(self, message: str, tracebacks: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.tracebacks = dict(tracebacks or {})


def _describe(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _device(kind: str) -> torch.device:
    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _child_entry(target: Callable[..., dict[str, Any]], rank: int, cfg: dict[str, Any], channels: tuple,
                 results: Any) -> None:
    """Run ``target`` in a spawned process and put its result (or its error) on ``results``; never raises."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if cfg["device"] == "cpu":
        torch.set_num_threads(1)
    try:
        results.put({"rank": rank, "ok": True, **target(rank, cfg, channels)})
    except BaseException as exc:  # everything must reach the parent, KeyboardInterrupt included
        results.put({"rank": rank, "ok": False, "error": _describe(exc), "traceback": traceback.format_exc()})


def run_ranks(target: Callable[..., dict[str, Any]], cfg: dict[str, Any], world: int, timeout_s: float) -> list[dict]:
    """Run ``target(rank, cfg, channels)`` in ``world`` spawned processes; one result dict per rank, in rank order.

    Spawned, not forked: a fork of a process that touched CUDA cannot use CUDA. ``channels`` are two queues
    (to rank 1, to rank 0) for checks that pass tensors between ranks. A rank that raised reports ``ok: False``
    with its traceback; one that died or outlived ``timeout_s`` is killed (by its pid) and reported as such.
    """
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    channels = (ctx.Queue(), ctx.Queue())
    procs = [ctx.Process(target=_child_entry, args=(target, rank, cfg, channels, results),
                         name=f"gpu-check-{target.__name__}-{rank}") for rank in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    grace = False
    killed: set[int] = set()
    try:
        while len(got) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = results.get(timeout=min(1.0, remaining))
                got[item["rank"]] = item
                if not item["ok"] and time.monotonic() + FAILURE_GRACE_S < deadline:
                    deadline, grace = time.monotonic() + FAILURE_GRACE_S, True  # the others may wait on it
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    with contextlib.suppress(queue.Empty):
                        while len(got) < world:
                            item = results.get(timeout=1.0)
                            got[item["rank"]] = item
                    break
    finally:
        for rank, proc in enumerate(procs):
            proc.join(timeout=15 if len(got) == world else 1)
            if proc.is_alive():
                killed.add(rank)
                proc.kill()
                proc.join(timeout=5)
    out = []
    for rank, proc in enumerate(procs):
        if rank in got:
            out.append(got[rank])
        else:
            if rank not in killed:
                why = f"the process died without a result (exit code {proc.exitcode})"
            elif grace:
                why = f"no result {FAILURE_GRACE_S:.0f}s after another rank failed (killed)"
            else:
                why = f"no result after {timeout_s:.0f}s (killed)"
            out.append({"rank": rank, "ok": False, "error": why, "traceback": ""})
    return out


def _require_ok(results: list[dict]) -> None:
    failed = [r for r in results if not r["ok"]]
    if failed:
        message = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
        raise ChildFailed(message, {r["rank"]: r["traceback"] for r in failed if r.get("traceback")})


# -- check 1: a bf16 FSDP2 training step -------------------------------------------------------------------------


def _train_worker(rank: int, cfg: dict[str, Any], channels: tuple) -> dict[str, Any]:
    """The trainer's recipe with bf16 compute, timed: see the module docstring, check 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    device = _device(cfg["device"])
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(cfg["port"]), RANK="0", WORLD_SIZE="1")
    torch.backends.cuda.matmul.allow_tf32 = True  # any fp32 matmul left outside the bf16 policy may use TF32
    torch.backends.cudnn.allow_tf32 = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(cfg["backend"], rank=0, world_size=1, timeout=timedelta(seconds=cfg["dist_timeout_s"]),
                            device_id=device if device.type == "cuda" else None)
    try:
        mesh = init_device_mesh(device.type, (1,))
        shape = ModelShape(**cfg["shape"])
        began = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):  # straight onto the GPU: no fp32 copy of the model on the CPU
            model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.float32)
        model.config.use_cache = False
        built_on = str(next(iter(model.parameters())).device)
        parameters = sum(p.numel() for p in model.parameters())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        build_s = time.perf_counter() - began
        generator = torch.Generator(device=device).manual_seed(0)
        batch = torch.randint(0, shape.vocab_size, (cfg["batch"], cfg["seq"]), device=device, generator=generator)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step_s: list[float] = []
        losses: list[float] = []
        for _ in range(cfg["warmup_steps"] + cfg["timed_steps"]):
            _synchronize(device)
            began = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _synchronize(device)
            step_s.append(time.perf_counter() - began)
            losses.append(float(loss.detach()))
        master = next(iter(model.parameters()))
        timed = step_s[cfg["warmup_steps"] :]
        tokens_per_step = cfg["batch"] * cfg["seq"]
        out: dict[str, Any] = {
            "parameters": parameters, "built_on": built_on, "build_s": round(build_s, 2),
            "master_weights": f"{master.dtype} {type(master).__name__}", "compute_dtype": "torch.bfloat16",
            "reduce_dtype": "torch.float32", "attn_implementation": model.config._attn_implementation,
            "batch": cfg["batch"], "seq_len": cfg["seq"], "tokens_per_step": tokens_per_step,
            "warmup_step_s": [round(s, 4) for s in step_s[: cfg["warmup_steps"]]],
            "timed_step_s": [round(s, 4) for s in timed],
            "step_s_median": round(statistics.median(timed), 4),
            "tokens_per_s": round(tokens_per_step * len(timed) / sum(timed), 1),
            "losses": [round(x, 4) for x in losses],
        }
        if device.type == "cuda":
            out["peak_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
            out["peak_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 2)
        return out
    finally:
        dist.destroy_process_group()


def check_train(plan: Plan, env: dict[str, Any], peak_tflops: float | None) -> dict[str, Any]:
    """Check 1 in a process of its own (its memory is the GPU's again when it exits); the MFU is computed here,
    from the shape, after the model's own parameter count agreed with ``count_parameters``."""
    shape = plan.model
    cfg = {**env, "shape": asdict(shape), "batch": plan.train_batch, "seq": plan.train_seq,
           "warmup_steps": plan.warmup_steps, "timed_steps": plan.timed_steps, "port": _free_port()}
    (result,) = run_ranks(_train_worker, cfg, 1, plan.train_timeout_s)
    _require_ok([result])
    result.pop("rank")
    result.pop("ok")
    counted = count_parameters(shape)
    if result["parameters"] != counted["total"]:
        raise RuntimeError(f"the model has {result['parameters']} parameters, count_parameters says "
                           f"{counted['total']}: the FLOP count would be wrong")
    flops = train_flops_per_token(counted["matmul"], shape.num_hidden_layers,
                                  shape.num_attention_heads * shape.head_dim, plan.train_seq)
    peak, peak_source = peak_bf16_flops(env["device_name"], peak_tflops)
    utilisation = mfu(result["tokens_per_s"], flops, peak)
    nonfinite = [x for x in result["losses"] if x != x or abs(x) == float("inf")]
    return {
        **result, "matmul_parameters": counted["matmul"], "flops_per_token": flops, "flops_formula": FLOPS_FORMULA,
        "model_tflops_per_s": round(result["tokens_per_s"] * flops / 1e12, 2),
        "peak_tflops": None if peak is None else round(peak / 1e12, 1), "peak_source": peak_source,
        "mfu": None if utilisation is None else round(utilisation, 4),
        **({"status": "failed", "error": f"non-finite loss {nonfinite}"} if nonfinite else {}),
    }


# -- check 2: the built-in engine --------------------------------------------------------------------------------


async def _burst(url: str, prompt_ids: list[int], *, requests: int, concurrency: int, max_new_tokens: int,
                 timeout_s: float = 120.0) -> dict[str, Any]:
    """``requests`` generations of exactly ``max_new_tokens`` tokens, at most ``concurrency`` in flight."""
    import httpx

    body = {"input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, trust_env=False, limits=limits) as http:

        async def one() -> None:
            nonlocal tokens
            async with gate:
                began = time.perf_counter()
                response = await http.post("/generate", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - began)
                tokens += int(response.json()["meta_info"]["completion_tokens"])

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        seconds = time.perf_counter() - began
    if tokens != requests * max_new_tokens:
        raise RuntimeError(f"{tokens} completion tokens for {requests} x {max_new_tokens} (ignore_eos)")
    latencies.sort()
    return {"requests": requests, "concurrency": concurrency, "completion_tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "p50_latency_s": round(latencies[len(latencies) // 2], 3), "max_latency_s": round(latencies[-1], 3)}


async def _engine_measurements(url: str, prompt_ids: list[int], plan: Plan) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
        info = (await http.get("/server_info")).json()
    await _burst(url, prompt_ids, requests=4, concurrency=4, max_new_tokens=8)  # warm-up: kernels, allocator
    at_1 = await _burst(url, prompt_ids, requests=plan.requests_at_1, concurrency=1,
                        max_new_tokens=plan.max_new_tokens)
    at_16 = await _burst(url, prompt_ids, requests=plan.requests_at_16, concurrency=16,
                         max_new_tokens=plan.max_new_tokens)
    return {"server_device": info.get("device"), "concurrency_1": at_1, "concurrency_16": at_16}


def check_engine(plan: Plan, env: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Check 2: the engine runs as the product runs it (``ServerProcess``, its own process group, stopped by it);
    this process only writes the checkpoint and sends requests. Missing server packages fail before anything is
    built, with their names."""
    missing = [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"the built-in engine's server needs {', '.join(missing)}, not installed here: install "
                           f"(or carry as wheels) the versions pyproject.toml pins, with their dependencies")
    from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec

    model_dir = workdir / "engine-model"
    written = write_random_checkpoint(plan.model, model_dir, device=_device(env["device"]))
    spec = builtin_spec(str(model_dir), LOOPBACK, _free_port(), str(workdir / "engine.log"),
                        options=BuiltinOptions(max_running_requests=64), name="gpu-check-engine")
    spec = dataclasses.replace(spec, argv=(*spec.argv, "--device", env["device"]))
    server = ServerProcess(spec)
    server.start()
    try:
        healthy_s = server.wait_healthy(timeout=plan.engine_timeout_s)
        prompt_ids = [int(t) for t in torch.randint(0, plan.model.vocab_size - len(SPECIAL_TOKENS),
                                                    (plan.prompt_tokens,), generator=torch.Generator().manual_seed(0))]
        measured = asyncio.run(asyncio.wait_for(_engine_measurements(spec.url, prompt_ids, plan),
                                                plan.engine_timeout_s))
    except Exception as exc:
        raise RuntimeError(f"{_describe(exc)}\n--- engine log (tail) ---\n{server.log_tail()}") from exc
    finally:
        server.stop(grace_s=10)
    if not str(measured["server_device"]).startswith(env["device"]):
        raise RuntimeError(f"asked for --device {env['device']}, the server reports {measured['server_device']}")
    at_1, at_16 = measured["concurrency_1"]["tokens_per_s"], measured["concurrency_16"]["tokens_per_s"]
    steps_per_s = at_16 / 16  # 16 rows running: one decode step yields 16 tokens
    weight_bytes = written["parameters"] * 4  # load_model serves fp32
    return {
        "parameters": written["parameters"], "served_dtype": "torch.float32 (relax.engines.builtin.model_runner)",
        "checkpoint_write_s": written["write_s"], "startup_to_healthy_s": round(healthy_s, 1),
        "prompt_tokens": plan.prompt_tokens, "max_new_tokens": plan.max_new_tokens, **measured,
        "speedup_16_vs_1": round(at_16 / at_1, 2), "decode_steps_per_s_at_16": round(steps_per_s, 1),
        "weight_read_gb_per_s_at_16": round(weight_bytes * steps_per_s / 1e9, 1),
    }


# -- check 3: weight transfer ------------------------------------------------------------------------------------


def parameter_shapes(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters (the tied embedding once) by name and shape, read from a meta model.

    Computed once in the parent and handed to the ranks, so a spawned rank imports torch alone: transformers'
    import (with torch's compiler stack behind it) was most of each rank's start-up, four times per check.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(qwen3_config(shape))
    return [(name, tuple(p.shape)) for name, p in meta.named_parameters()]


def random_weights(shapes: Sequence[tuple[str, Sequence[int]]], device: torch.device,
                   seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 tensors of these names and shapes (:func:`parameter_shapes`): one kernel per tensor, no model
    init. Different seeds on the two sides make the receiver's tensors differ until the transfer overwrites them.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(tuple(size), generator=generator, device=device, dtype=torch.bfloat16)
            for name, size in shapes}


def _specs(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def copy_seconds(nbytes: int, device: torch.device, repeats: int) -> list[float]:
    """Seconds of ``dst.copy_(src)`` of ``nbytes`` on ``device`` (after one untimed copy): the local ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        began = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        times.append(time.perf_counter() - began)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def _rendezvous(device: torch.device) -> None:
    """Both ranks reach this point before either goes on (an all-reduce they both wait for)."""
    import torch.distributed as dist

    flag = torch.ones(1, device=device)
    dist.all_reduce(flag)
    _synchronize(device)


def broadcast_worker(rank: int, cfg: dict[str, Any], channels: tuple) -> dict[str, Any]:
    """Rank 0 broadcasts its weights bucket by bucket; rank 1 receives into preallocated tensors.

    Timed twice, each pass from a rendezvous to the end of the last bucket on this rank: ``pipeline`` (pack,
    broadcast, unpack: what a weight update costs) and ``broadcast`` (the packed buffers again: the wire alone).
    """
    import torch.distributed as dist

    from relax.weights.group import init_weight_group

    device = _device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(cfg["backend"], init_method=f"tcp://{LOOPBACK}:{cfg['port']}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=cfg["dist_timeout_s"]),
                            device_id=device if device.type == "cuda" else None)
    # the buckets travel over the weight-update group as Relax builds it for SGLang (rank 0 hosts its rendezvous
    # on weight_port); the default group above only times the passes (its all-reduces keep the ranks in step)
    group = init_weight_group("gpu-check-weights", LOOPBACK, cfg["weight_port"], rank, 2, cfg["backend"],
                              cfg["dist_timeout_s"], device=device)
    try:
        weights = random_weights(cfg["parameter_shapes"], device, seed=rank)
        layouts = plan_buckets(_specs(weights), cfg["bucket_bytes"])
        weight_bytes = sum(t.nbytes for t in weights.values())
        before = checksums(weights) if rank == 1 else None
        _rendezvous(device)  # the first collective: NCCL sets its communicator up here (or refuses)
        copy_s = copy_seconds(weight_bytes, device, cfg["repeats"]) if rank == 0 else None
        _rendezvous(device)
        if rank == 0:
            buffers = [torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for layout in layouts]
        else:
            received = torch.empty(max(layout.nbytes for layout in layouts), dtype=torch.uint8, device=device)
            buffers = [received[: layout.nbytes] for layout in layouts]
        group.broadcast(buffers[0][: min(1 << 20, layouts[0].nbytes)])  # warm-up, untimed
        pipeline_s, broadcast_s = [], []
        for _ in range(cfg["repeats"]):
            _rendezvous(device)
            began = time.perf_counter()
            for layout, buffer in zip(layouts, buffers, strict=True):
                if rank == 0:
                    pack_bucket(layout, weights, buffer)
                group.broadcast(buffer)
                if rank == 1:
                    unpack_bucket(layout, buffer, weights)
            _synchronize(device)
            pipeline_s.append(time.perf_counter() - began)
        after = checksums(weights)
        for _ in range(cfg["repeats"]):
            _rendezvous(device)
            began = time.perf_counter()
            for buffer in buffers:
                group.broadcast(buffer)
            _synchronize(device)
            broadcast_s.append(time.perf_counter() - began)
        _rendezvous(device)
        return {"weight_bytes": weight_bytes, "buckets": len(layouts), "bucket_bytes": [b.nbytes for b in layouts],
                "tensors": len(weights), "copy_s": copy_s, "pipeline_s": pipeline_s, "broadcast_s": broadcast_s,
                "checksums_before": before, "checksums": after}
    finally:
        group.close()
        dist.destroy_process_group()


def ipc_worker(rank: int, cfg: dict[str, Any], channels: tuple) -> dict[str, Any]:
    """The same buckets over ``torch.multiprocessing`` queues: CUDA IPC handles on a GPU, shared memory on a CPU.

    Rank 0 packs each bucket, synchronizes (the other process reads the buffer) and sends it; rank 1 unpacks it
    into its preallocated tensors and says when a pass is done (synchronized), so rank 0 may pack again. Timed on
    rank 0 from the start of a pass to that answer. The first pass opens the IPC handles; later ones reuse them.
    """
    to_receiver, to_sender = channels
    device = _device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = random_weights(cfg["parameter_shapes"], device, seed=rank)
    layouts = plan_buckets(_specs(weights), cfg["bucket_bytes"])
    weight_bytes = sum(t.nbytes for t in weights.values())
    repeats = cfg["repeats"]
    if rank == 1:
        before = checksums(weights)
        for _ in range(repeats):
            to_sender.put("ready")
            for _ in layouts:
                index, buffer = to_receiver.get(timeout=cfg["dist_timeout_s"])
                unpack_bucket(layouts[index], buffer, weights)
                del buffer
            _synchronize(device)
            to_sender.put("done")
        after = checksums(weights)
        to_sender.put("released")
        return {"checksums_before": before, "checksums": after}
    copy_s = copy_seconds(weight_bytes, device, repeats)
    buffers = [torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for layout in layouts]
    pass_s = []
    for _ in range(repeats):
        _expect(to_sender, "ready", cfg["dist_timeout_s"])
        began = time.perf_counter()
        for index, (layout, buffer) in enumerate(zip(layouts, buffers, strict=True)):
            pack_bucket(layout, weights, buffer)
            _synchronize(device)
            to_receiver.put((index, buffer))
        _expect(to_sender, "done", cfg["dist_timeout_s"])
        pass_s.append(time.perf_counter() - began)
    _expect(to_sender, "released", cfg["dist_timeout_s"])  # keep the buffers alive until the receiver let go
    return {"weight_bytes": weight_bytes, "buckets": len(layouts), "tensors": len(weights), "copy_s": copy_s,
            "pass_s": pass_s, "checksums": checksums(weights)}


def _expect(channel: Any, word: str, timeout_s: float) -> None:
    got = channel.get(timeout=timeout_s)
    if got != word:
        raise RuntimeError(f"expected {word!r} from the other rank, got {got!r}")


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


def _ratio(seconds: float, baseline_s: float) -> float | None:
    """How many times longer than the device-to-device copy of the same bytes (1.0: as fast as memory allows)."""
    return round(seconds / baseline_s, 2) if baseline_s > 0 else None


def _verify(sender: dict[str, list[int]], receiver: dict[str, list[int]], before: dict[str, list[int]]) -> dict:
    """Whether every tensor arrived bit for bit, and whether the receiver's tensors differed before (the check
    would have caught a transfer that moved nothing)."""
    wrong = sorted(name for name in sender if receiver.get(name) != sender[name])
    return {"verified": not wrong and set(receiver) == set(sender), "mismatched_tensors": wrong[:5],
            "receiver_differed_before": any(before.get(name) != sender[name] for name in sender)}


#: What NCCL says when two ranks of one communicator share a GPU (init.cc's "Duplicate GPU detected").
NCCL_SAME_GPU_MARKERS = ("duplicate gpu", "ncclinvalidusage", "invalid usage")


def summarize_broadcast(results: list[dict], backend: str) -> dict[str, Any]:
    """The broadcast run's report: per pass, the slower rank's seconds; the best pass against the best copy."""
    failed = [r for r in results if not r["ok"]]
    if failed:
        errors = " | ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
        same_gpu = backend == "nccl" and any(m in errors.lower() for m in NCCL_SAME_GPU_MARKERS)
        return {"status": "unsupported" if same_gpu else "failed", "error": errors,
                **({"why": "NCCL does not allow two ranks of one communicator on the same GPU; this part needs "
                           "two GPUs (the cuda_ipc figures are what one GPU offers)"} if same_gpu else {}),
                "traceback": {r["rank"]: r.get("traceback", "") for r in failed}}
    sender, receiver = results
    nbytes = sender["weight_bytes"]
    pipeline = min(max(a, b) for a, b in zip(sender["pipeline_s"], receiver["pipeline_s"], strict=True))
    wire = min(max(a, b) for a, b in zip(sender["broadcast_s"], receiver["broadcast_s"], strict=True))
    copy = min(sender["copy_s"])
    check = _verify(sender["checksums"], receiver["checksums"], receiver["checksums_before"])
    return {
        "status": "ok" if check["verified"] else "failed", "backend": backend, "bytes": nbytes,
        "gb": round(nbytes / 1e9, 3), "tensors": sender["tensors"], "buckets": sender["buckets"],
        "bucket_bytes": sender["bucket_bytes"],
        "broadcast_s": round(wire, 6), "broadcast_gb_per_s": _gbps(nbytes, wire),
        "pipeline_s": round(pipeline, 6), "pipeline_gb_per_s": _gbps(nbytes, pipeline),
        "copy_s": round(copy, 6), "copy_gb_per_s": _gbps(nbytes, copy),
        "broadcast_over_copy_s": _ratio(wire, copy), "pipeline_over_copy_s": _ratio(pipeline, copy), **check,
    }


def summarize_ipc(results: list[dict]) -> dict[str, Any]:
    failed = [r for r in results if not r["ok"]]
    if failed:
        return {"status": "failed", "error": " | ".join(f"rank {r['rank']}: {r['error']}" for r in failed),
                "traceback": {r["rank"]: r.get("traceback", "") for r in failed}}
    sender, receiver = results
    nbytes = sender["weight_bytes"]
    best, copy = min(sender["pass_s"]), min(sender["copy_s"])
    check = _verify(sender["checksums"], receiver["checksums"], receiver["checksums_before"])
    return {
        "status": "ok" if check["verified"] else "failed", "bytes": nbytes, "gb": round(nbytes / 1e9, 3),
        "buckets": sender["buckets"], "first_pass_s": round(sender["pass_s"][0], 6), "best_pass_s": round(best, 6),
        "pass_gb_per_s": _gbps(nbytes, best), "copy_s": round(copy, 6), "copy_gb_per_s": _gbps(nbytes, copy),
        "pass_over_copy_s": _ratio(best, copy), **check,
    }


def check_transfer(plan: Plan, env: dict[str, Any]) -> dict[str, Any]:
    """Check 3: the broadcast run, then the IPC run, each in two fresh processes (a refused or crashed NCCL
    communicator leaves nothing behind for the IPC run)."""
    cfg = {**env, "parameter_shapes": parameter_shapes(plan.model), "bucket_bytes": plan.bucket_bytes,
           "repeats": plan.transfer_repeats}
    ports = {"port": _free_port(), "weight_port": _free_port()}
    runs = run_ranks(broadcast_worker, {**cfg, **ports}, 2, plan.transfer_timeout_s)
    broadcast = summarize_broadcast(runs, env["backend"])
    ipc = summarize_ipc(run_ranks(ipc_worker, cfg, 2, plan.transfer_timeout_s))
    statuses = {broadcast["status"], ipc["status"]}
    status = "failed" if "failed" in statuses else ("unsupported" if "unsupported" in statuses else "ok")
    return {"status": status, "parameters": count_parameters(plan.model)["total"], "dtype": "torch.bfloat16",
            "layout": "flattened_bucket: one uint8 buffer per bucket, tensors in name order, offsets aligned to "
                      "their element size",
            "broadcast": broadcast, "cuda_ipc" if env["device"] == "cuda" else "shared_memory_ipc": ipc}


QWEN3_4B_BF16_BYTES = 8_045_000_000  # Qwen3-4B's 4.02B parameters in bf16


def check_digest(plan: Plan, env: dict[str, Any]) -> dict[str, Any]:
    """Check 4: rank 0's checksums of one version, in the layout and hash an SGLang engine on this device answers."""
    from transformers import AutoModelForCausalLM

    from relax.weights.digest import ChecksumAlgorithm, layout_checksums

    device = torch.device(env["device"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_config(plan.model), dtype=torch.bfloat16)
    tensors = {name: t.detach() for name, t in model.state_dict().items()
               if name != "lm_head.weight"}  # tied: a publication drops it, as a checkpoint does
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(tensors)}
    for algorithm, where in ((ChecksumAlgorithm.SGLANG_GPU, tensors),
                             (ChecksumAlgorithm.SHA256, {n: t.cpu() for n, t in tensors.items()})):
        layout_checksums({n: t for n, t in list(where.items())[:2]}, "hf", algorithm=algorithm)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        sums = layout_checksums(where, "sglang", algorithm=algorithm)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        out[algorithm.value] = {"seconds": round(seconds, 3), "gb_per_s": round(nbytes / seconds / 1e9, 2),
                                "served_tensors": len(sums),
                                "qwen3_4b_seconds": round(QWEN3_4B_BF16_BYTES / (nbytes / seconds), 2)}
    return out


# -- the script --------------------------------------------------------------------------------------------------


def _run_check(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one check; whatever it raises becomes its report (``status: failed``) and the next check still runs."""
    print(f"[gpu_check] {name}: running ...", flush=True)
    began = time.perf_counter()
    try:
        result = run()
        status = result.pop("status", "ok")
    except Exception as exc:
        status = "failed"
        result = {"error": _describe(exc, limit=8000)}
        tracebacks = getattr(exc, "tracebacks", None)
        result["traceback"] = tracebacks if tracebacks else traceback.format_exc()
    wall = round(time.perf_counter() - began, 1)
    print(f"[gpu_check] {name}: {status} in {wall}s{_headline(name, status, result)}", flush=True)
    return {"status": status, "wall_s": wall, **result}


def _headline(name: str, status: str, result: dict[str, Any]) -> str:
    if status != "ok" and "error" in result:
        return " - " + result["error"].splitlines()[0][:300]
    if name == "fsdp2_train_step":
        utilisation = "n/a" if result.get("mfu") is None else f"{result['mfu']:.1%}"
        return (f" - {result['tokens_per_s']:,.0f} tokens/s, {result['step_s_median']}s/step, MFU {utilisation}, "
                f"peak {result.get('peak_memory_allocated_gib', 'n/a')} GiB")
    if name == "builtin_engine":
        return (f" - {result['concurrency_1']['tokens_per_s']} tokens/s at 1, "
                f"{result['concurrency_16']['tokens_per_s']} at 16 ({result['server_device']})")
    if name == "weight_digest":
        gpu, sha = result["sglang-gpu"], result["sha256"]
        return (f" - SGLang's GPU hash {gpu['gb_per_s']} GB/s (Qwen3-4B {gpu['qwen3_4b_seconds']}s), SHA-256 "
                f"{sha['gb_per_s']} GB/s")
    if name == "weight_transfer":
        parts = []
        for key in ("broadcast", "cuda_ipc", "shared_memory_ipc"):
            part = result.get(key)
            if part:
                rate = part.get("broadcast_gb_per_s", part.get("pass_gb_per_s"))
                detail = (f" {rate} GB/s (copy {part['copy_gb_per_s']})" if part["status"] == "ok"
                          else f" ({part.get('error', '')[:160]})")
                parts.append(f"{key} {part['status']}{detail}")
        return " - " + "; ".join(parts)
    return ""


def _environment(device_kind: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {**machine(), "torch": torch.__version__, "transformers": transformers.__version__}
    if device_kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                   gpus_visible=torch.cuda.device_count(), cuda=torch.version.cuda,
                   nccl=_nccl_version())
    else:
        env.update(device_name="cpu")
    return env


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a torch without NCCL: the broadcast check will say so
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~100M model, 2 timed steps, short bursts (~3 min)")
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json", help="where the JSON report goes")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak in TFLOP/s, for the MFU (default: from a table by name)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the same code on the CPU (gloo, a tiny model) to test this script; no real figures")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown or not checks:
        parser.error(f"--checks: unknown {unknown}; choose from {','.join(CHECKS)}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    device_kind = "cpu" if args.cpu_smoke else "cuda"
    plan = PLANS["smoke" if args.cpu_smoke else "quick" if args.quick else "full"]
    env_info = _environment(device_kind)
    env = {"device": device_kind, "backend": "gloo" if args.cpu_smoke else "nccl",
           "device_name": env_info["device_name"], "dist_timeout_s": plan.dist_timeout_s}
    counted = count_parameters(plan.model)
    print(f"[gpu_check] {plan.name} plan on {env_info['device_name']}: Qwen3 shape {asdict(plan.model)}, "
          f"{counted['total']:,} parameters (tied embedding {counted['embedding']:,})", flush=True)
    report: dict[str, Any] = {"benchmark": "gpu_check", "plan": plan.name, "machine": env_info,
                              "model_shape": asdict(plan.model), "parameters": counted, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="relax-gpu-check-") as tmp:
        runs: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
            "train": ("fsdp2_train_step", lambda: check_train(plan, env, args.peak_tflops)),
            "engine": ("builtin_engine", lambda: check_engine(plan, env, Path(tmp))),
            "transfer": ("weight_transfer", lambda: check_transfer(plan, env)),
            "digest": ("weight_digest", lambda: check_digest(plan, env)),
        }
        for key in CHECKS:
            if key in checks:
                name, run = runs[key]
                report["checks"][name] = _run_check(name, run)
    statuses = {name: c["status"] for name, c in report["checks"].items()}
    report["statuses"] = statuses
    report["ok"] = "failed" not in statuses.values()
    save_report(report, args.out)
    print(f"[gpu_check] {'ok' if report['ok'] else 'FAILED'}: {statuses} -> {args.out}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
