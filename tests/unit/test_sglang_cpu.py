"""SGLang's CPU platform as Relax sets it up (relax.engines.sglang_cpu): pure rules, no SGLang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.engines.sglang_cpu import (
    CPU_PLATFORM_ENV,
    THREADS_BIND_ENV,
    CoreClaim,
    CpuNode,
    attention_backend,
    cpu_launch,
    model_head_dim,
    threads_bind,
)

AMX = CpuNode(amx=True, avx512=True, cores=(0, 1, 2, 3), preloads=("/usr/lib/libtcmalloc.so.4",))
NO_AMX = CpuNode(amx=False, avx512=True, cores=(0, 1))


def flags(args: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize("node,head_dim,expected", [
    (AMX, 64, "intel_amx"),  # SmolLM2-135M
    (AMX, 128, "intel_amx"),  # Qwen3-4B
    (AMX, 16, "torch_native"),  # the tiny preset: AMX kernels need a multiple of 32 ("invalid head_size 16")
    (AMX, None, "torch_native"),
    (NO_AMX, 64, "torch_native"),
])
def test_the_attention_backend_is_one_the_model_and_cpu_support(node: CpuNode, head_dim: int | None,
                                                                 expected: str) -> None:
    assert attention_backend(node, head_dim)[0] == expected


def test_cpu_launch_sets_the_platform_bf16_no_cuda_graphs_a_bounded_pool_and_idle_sleep() -> None:
    launch = cpu_launch(AMX, head_dim=64, core_sets=[(0, 1)])
    f = flags(launch.args)
    assert f["--device"] == "cpu" and f["--dtype"] == "bfloat16" and f["--attention-backend"] == "intel_amx"
    assert f["--cuda-graph-backend-decode"] == "disabled" and f["--cuda-graph-backend-prefill"] == "disabled"
    assert "--disable-overlap-schedule" in f and "--sleep-on-idle" in f
    assert int(f["--max-total-tokens"] or 0) > 0
    assert launch.env[CPU_PLATFORM_ENV] == "1" and launch.env[THREADS_BIND_ENV] == "0-1"
    assert launch.env["LD_PRELOAD"] == "/usr/lib/libtcmalloc.so.4"
    assert "bf16" in launch.summary and "intel_amx" in launch.summary


def test_explicit_sglang_flags_and_variables_win() -> None:
    launch = cpu_launch(AMX, head_dim=16, user_args=("--attention-backend=intel_amx", "--dtype", "float16"),
                        user_env={"LD_PRELOAD": "/mine.so", THREADS_BIND_ENV: "3"}, core_sets=[(0,)])
    f = flags(launch.args)
    assert "--attention-backend" not in f and "--dtype" not in f  # never passed twice
    assert "LD_PRELOAD" not in launch.env and THREADS_BIND_ENV not in launch.env
    assert "as given" in launch.summary


def test_threads_bind_is_one_set_per_tp_rank() -> None:
    assert threads_bind([(0, 1, 2, 3)]) == "0-3"
    assert threads_bind([(0, 1), (2, 3)]) == "0-1|2-3"
    assert threads_bind([(5,), (0, 2, 3)]) == "5|0,2-3"


def test_head_dim_from_a_hugging_face_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))
    assert model_head_dim(tmp_path) == 64
    (tmp_path / "config.json").write_text(json.dumps({"head_dim": 16, "hidden_size": 64, "num_attention_heads": 4}))
    assert model_head_dim(tmp_path) == 16
    assert model_head_dim(tmp_path / "missing") is None


def test_engines_on_one_machine_claim_disjoint_cores_then_share(tmp_path: Path) -> None:
    first, second, third = CoreClaim(tmp_path), CoreClaim(tmp_path), CoreClaim(tmp_path)
    try:
        assert first.claim((0, 1, 2, 3), 2) == (0, 1) and not first.shared
        assert second.claim((0, 1, 2, 3), 2) == (2, 3)
        assert third.claim((0, 1, 2, 3), 2) == (0, 1, 2, 3) and third.shared  # none free: share, never fail
        first.release()
        assert CoreClaim(tmp_path).claim((0, 1, 2, 3), 2) == (0, 1)  # a stopped engine's cores are free again
    finally:
        for claim in (first, second, third):
            claim.release()
