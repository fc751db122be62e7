"""Trainer precision: the policy per (precision, device), FSDP2 mixed precision on a 1-rank gloo group, the
rank-0 broadcast load, fp16 loss scaling, the --bf16/--fp16 flags and bf16 weight publication.

Production CPU runs never use a low-precision policy (they stay exact fp32); the gloo tests apply the
CUDA policy on CPU anyway, to prove that the policy the GPU path builds does what it says.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relax.config.flags import ConfigError, ignored_flags_warning, parse_args
from relax.config.megatron import IGNORED_FLAGS, MAPPED_FLAGS
from relax.training.actor import (
    PRECISIONS,
    TrainerActor,
    TrainerConfig,
    _shard,
    _sharded_from_rank0,
    mixed_precision_for,
    precision_fallback_warning,
    resolve_precision,
)
from relax.weights.buckets import make_buckets, merge_buckets, publish_tensor
from relax.weights.publication import WeightManifest

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Pure: which precision and which policy


@pytest.mark.parametrize(
    ("precision", "device", "resolved", "policy"),
    [
        ("auto", "cuda", "bf16", BF16),
        ("bf16", "cuda", "bf16", BF16),
        ("fp16", "cuda", "fp16", FP16),
        ("fp32", "cuda", "fp32", None),
        ("auto", "cpu", "fp32", None),
        ("bf16", "cpu", "fp32", None),
        ("fp16", "cpu", "fp32", None),
        ("fp32", "cpu", "fp32", None),
    ],
)
def test_policy_for_each_precision_and_device(precision, device, resolved, policy) -> None:
    assert resolve_precision(precision, device) == resolved
    assert mixed_precision_for(precision, device) == policy


def test_every_low_precision_policy_reduces_in_fp32() -> None:
    for precision in PRECISIONS:
        policy = mixed_precision_for(precision, "cuda")
        assert policy is None or (policy.reduce_dtype is torch.float32 and policy.output_dtype is None)


def test_cpu_fallback_warns_in_one_line_only_for_an_explicit_request() -> None:
    for precision in ("bf16", "fp16"):
        line = precision_fallback_warning(precision, "cpu")
        assert line is not None and "\n" not in line
        assert "fp32" in line and "slow" in line and f"--{precision}" in line
        assert precision_fallback_warning(precision, "cuda") is None
    assert precision_fallback_warning("auto", "cpu") is None
    assert precision_fallback_warning("fp32", "cpu") is None


def test_unknown_precision_is_rejected() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainerConfig(hf_checkpoint="m", precision="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("bfloat16", "cuda")
    assert TrainerConfig(hf_checkpoint="m").precision == "auto"


# --------------------------------------------------------------------------------------------------
# Flags


@pytest.mark.parametrize(("argv", "expected"), [([], "auto"), (["--bf16"], "bf16"), (["--fp16"], "fp16")])
def test_megatron_precision_flags_map_onto_the_trainer_precision(argv, expected) -> None:
    args = parse_args(argv)
    assert args.precision == expected
    assert args.ignored_flags == ()
    assert ignored_flags_warning(args) is None
    assert TrainerConfig.from_args(args, hf_checkpoint="m").precision == expected


def test_precision_flags_are_mapped_not_ignored() -> None:
    assert {"--bf16", "--fp16"} <= {flag.option for flag in MAPPED_FLAGS}
    assert not {"--bf16", "--fp16"} & {flag.option for flag in IGNORED_FLAGS}
    args = parse_args(["--bf16", "--sequence-parallel"])
    assert args.ignored_flags == ("--sequence-parallel",)
    assert "--bf16" not in (ignored_flags_warning(args) or "")


def test_bf16_and_fp16_together_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match="--bf16 and --fp16") as info:
        parse_args(["--bf16", "--fp16"])
    assert "\n" not in str(info.value)
    assert parse_args(["--bf16", "--bf16"]).precision == "bf16"  # repeating one flag is fine


# --------------------------------------------------------------------------------------------------
# FSDP2 on a 1-rank gloo group


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture()
def mesh() -> Iterator[object]:
    """A 1-process gloo group (destroyed after the test) and its CPU device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


def _toy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block(), torch.nn.Linear(8, 2))


def _record_linear_dtypes(model: torch.nn.Module) -> list[tuple[torch.dtype, torch.dtype]]:
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, mod.weight.dtype)))
    return seen


@pytest.mark.parametrize(("precision", "compute"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_policy_computes_in_low_precision_and_keeps_fp32_master_weights(mesh, precision, compute) -> None:
    model = _toy_model()
    seen = _record_linear_dtypes(model)
    policy = mixed_precision_for(precision, "cuda")
    for block in model[:2]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    out = model(torch.randn(4, 8))
    assert seen == [(compute, compute)] * 3  # every Linear: low-precision input and weight
    assert out.dtype == compute
    out.float().sum().backward()

    # After backward the registered parameters are the fp32 shards again, with fp32 (reduced) gradients.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moments = [s["exp_avg"] for s in optimizer.state.values()] + [s["exp_avg_sq"] for s in optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_without_a_policy_the_forward_stays_fp32(mesh) -> None:
    model = _toy_model()
    seen = _record_linear_dtypes(model)
    _shard(model, mesh, mixed_precision_for("auto", "cpu"))
    model(torch.randn(4, 8))
    assert seen == [(torch.float32, torch.float32)] * 3


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A very small tied-embedding Qwen3 (rotary buffers, decoder layers as FSDP units), saved as HF."""
    cfg = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf")
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def _full(hf_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)


def test_actor_shards_every_unit_with_the_policy(mesh, hf_dir) -> None:
    model = _full(hf_dir)
    seen = _record_linear_dtypes(model)
    _shard(model, mesh, mixed_precision_for("bf16", "cuda"))
    logits = model(input_ids=torch.tensor([[2, 3, 4, 5]]), use_cache=False).logits
    assert logits.dtype == torch.bfloat16
    assert len(seen) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, then lm_head
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    logits.float().sum().backward()
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rank0_broadcast_load_matches_from_pretrained(mesh, hf_dir, precision) -> None:
    full = _full(hf_dir)
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = full(input_ids=ids, use_cache=False).logits
    policy = mixed_precision_for(precision, "cuda")
    model = _sharded_from_rank0(full, str(hf_dir), mesh, torch.device("cpu"), policy,
                                prepare=lambda m: m.requires_grad_(False))
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    state = model.state_dict()
    for name, tensor in full.state_dict().items():
        assert torch.equal(state[name].full_tensor(), tensor), name
        assert state[name].dtype == torch.float32
    buffers = dict(model.named_buffers())
    for name, buffer in full.named_buffers():  # non-persistent: rotary inv_freq
        assert torch.equal(buffers[name], buffer), name
    assert hasattr(model, "_weight_conversions")
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    if policy is None:
        assert logits.dtype == torch.float32 and torch.equal(logits, expected)
    else:
        assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits.float(), expected, atol=0.05, rtol=0.05)


@pytest.mark.filterwarnings("ignore:Found a non-scalar tensor:UserWarning")  # torch's scaler, found_inf shape (1,)
def test_fp16_loss_scaling_unscales_and_skips_an_overflowing_step(mesh) -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = _toy_model()
    _shard(model, mesh, mixed_precision_for("fp16", "cuda"))
    actor = TrainerActor()
    actor.config = TrainerConfig(hf_checkpoint="m", clip_grad=0.0)
    actor.model, actor.world_size = model, 1
    actor.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)

    def step(scale: float) -> tuple[float, bool]:
        actor.grad_scaler = ShardedGradScaler(device="cpu", init_scale=scale)
        before = [p.full_tensor().clone() for p in model.parameters()]
        actor.grad_scaler.scale(model(x).float().sum()).backward()
        norm, skipped = actor._clip_and_step(lr=1e-2)
        moved = any(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters(), strict=True))
        assert moved != skipped
        return norm, skipped

    model(x).float().sum().backward()
    true_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).full_tensor())
    actor.optimizer.zero_grad(set_to_none=True)

    norm, skipped = step(2.0**4)
    assert not skipped and norm == pytest.approx(true_norm, rel=1e-2)  # the norm of the unscaled gradients
    assert actor.grad_scaler.get_scale() == 2.0**4
    norm, skipped = step(2.0**40)  # fp16 gradients overflow
    assert skipped and actor.grad_scaler.get_scale() == 2.0**39  # backed off


def test_cpu_actor_falls_back_to_fp32_with_one_warning(monkeypatch, caplog, hf_dir) -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")  # init sets them; monkeypatch restores (or removes) them afterwards
    threads = torch.get_num_threads()
    actor = TrainerActor()
    try:
        with caplog.at_level(logging.WARNING, logger="relax.training.actor"):
            info = actor.init(0, 1, "127.0.0.1", _free_port(), TrainerConfig(hf_checkpoint=str(hf_dir),
                                                                               precision="bf16"))
        assert info["precision"] == "fp32" and actor.grad_scaler is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [precision_fallback_warning("bf16", "cpu")]
        assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
        lps = actor.compute_log_probs([{"prompt_token_ids": [2, 3], "response_token_ids": [4, 5]}])
        assert len(lps) == 1 and len(lps[0]) == 2
    finally:
        actor.shutdown()
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Publication dtype


def _float_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())


def test_bf16_publication_halves_the_bytes_and_leaves_non_float_tensors_alone() -> None:
    torch.manual_seed(0)
    state = {
        "w": torch.randn(16, 8),
        "b": torch.randn(8),
        "position_ids": torch.arange(32),
        "mask": torch.ones(4, dtype=torch.bool),
        "already_bf16": torch.randn(4, dtype=torch.bfloat16),
    }
    default = merge_buckets(make_buckets(state))
    assert all(default[k] is state[k] for k in state)  # dtype=None: unchanged, not even copied

    buckets = make_buckets(state, dtype=torch.bfloat16)
    published = merge_buckets(buckets)
    assert list(published) == list(state)
    fp32 = ("w", "b")
    assert _float_bytes(published[k] for k in fp32) * 2 == _float_bytes(state[k] for k in fp32)
    for k in fp32:
        assert published[k].dtype == torch.bfloat16 and torch.equal(published[k], state[k].to(torch.bfloat16))
    for k in ("position_ids", "mask", "already_bf16"):
        assert published[k] is state[k]
    manifest = WeightManifest.from_buckets(1, buckets)
    assert manifest.dtypes == ("bfloat16", "bfloat16", "int64", "bool", "bfloat16")
    assert manifest.total_bytes == WeightManifest.from_buckets(1, make_buckets(state)).total_bytes - 16 * 8 * 2 - 8 * 2
    assert state["w"].dtype == torch.float32  # the caller's state dict is not modified


def test_buckets_are_cut_by_the_published_size() -> None:
    state = {f"t{i}": torch.zeros(16) for i in range(4)}  # 64 bytes each in fp32, 32 in bf16
    assert len(make_buckets(state, bucket_bytes=64)) == 4
    assert len(make_buckets(state, bucket_bytes=64, dtype=torch.bfloat16)) == 2


def test_publish_tensor_casts_floating_tensors_only() -> None:
    ids = torch.arange(3)
    assert publish_tensor(ids, torch.bfloat16) is ids
    half = torch.ones(2, dtype=torch.float16)
    assert publish_tensor(half, torch.bfloat16).dtype == torch.bfloat16
    assert publish_tensor(half, None) is half
