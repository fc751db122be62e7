"""How Relax starts vLLM behind its front (relax.engines.vllm.options): what it owns, what it picks on CPU."""

from __future__ import annotations

import pytest

from relax.engines.vllm.options import VllmOptionError, cpu_model_problem, head_size, vllm_argv, vllm_env

HEAD = ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--uds", "/d/vllm.sock",
        "--enable-scale-out"]


def test_on_cpu_relax_picks_dtype_and_eager_mode_unless_the_user_did() -> None:
    assert vllm_argv("py", "/m", "/d/vllm.sock", [], on_cpu=True) == [*HEAD, "--dtype", "bfloat16",
                                                                       "--enforce-eager"]
    assert vllm_argv("py", "/m", "/d/vllm.sock", ["--dtype=float32", "--max-num-seqs", "8"], on_cpu=True) == [
        *HEAD, "--enforce-eager", "--dtype=float32", "--max-num-seqs", "8"]
    assert vllm_argv("py", "/m", "/d/vllm.sock", ["--enforce-eager"], on_cpu=True) == [
        *HEAD, "--dtype", "bfloat16", "--enforce-eager"]
    assert vllm_argv("py", "/m", "/d/vllm.sock", ["--max-num-seqs", "8"], on_cpu=False) == [
        *HEAD, "--max-num-seqs", "8"]  # on GPU vLLM's own defaults


@pytest.mark.parametrize("flags", [["--uds", "/x"], ["--port=8000"], ["--api-key", "k"], ["--host", "0.0.0.0"],
                                   ["--tokens-only"]])
def test_flags_that_would_open_vllm_or_bypass_the_front_are_refused(flags: list[str]) -> None:
    with pytest.raises(VllmOptionError, match=flags[0].split("=")[0]):
        vllm_argv("py", "/m", "/d/vllm.sock", flags, on_cpu=True)


def test_the_environment_carries_the_key_dev_routes_and_private_temp_dir() -> None:
    env = vllm_env({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "4", "TMPDIR": "/tmp"}, "/d", "k1", on_cpu=True)
    assert env == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "VLLM_API_KEY": "k1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "TMPDIR": "/d"}
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env({}, "/d", "k1", on_cpu=False)


def test_a_head_size_the_cpu_kernels_lack_is_refused_before_start() -> None:
    assert head_size({"head_dim": 128, "hidden_size": 64, "num_attention_heads": 2}) == 128
    assert head_size({"hidden_size": 576, "num_attention_heads": 9}) == 64  # SmolLM2-135M
    assert head_size({}) is None
    assert cpu_model_problem({"hidden_size": 576, "num_attention_heads": 9}) is None
    problem = cpu_model_problem({"hidden_size": 64, "num_attention_heads": 4})  # the tiny preset: 16
    assert problem is not None and problem.startswith("attention head size 16")
