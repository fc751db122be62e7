"""The SGLang backend's launch command (``python -m sglang.launch_server``).

SGLang is never imported here (it needs CUDA and is an optional runtime dependency); Relax
only builds its command line and then drives it with the shared launcher, exactly like the built-in
engine. Flag names follow SGLang's ``ServerArgs`` (field ``tp_size`` -> ``--tp-size`` and so on).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relax.engines.launcher import LaunchSpec

SGLANG_MODULE = "sglang.launch_server"

# Flags Relax sets itself, with SGLang's aliases. Passing them again through ``extra_args`` would
# silently fight Relax's bookkeeping (the URL the router uses, the weight version it tracks), so it is
# rejected with a message instead.
_MANAGED_FLAGS: dict[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--host": "host",
    "--port": "port",
    "--tp-size": "tp_size",
    "--tp": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--mem-fraction-static": "mem_fraction_static",
    "--weight-version": "weight_version",
    "--nccl-port": "nccl_port",
    "--api-key": "api_key",
}


@dataclass(frozen=True)
class SGLangOptions:
    """Per-engine SGLang settings that are not about where the engine runs."""

    tp_size: int = 1
    mem_fraction_static: float | None = None
    trust_remote_code: bool = False
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    python: str | None = None  # interpreter with sglang installed; default: this one


def parse_extra_args(extra_args: str | Sequence[str] | None) -> list[str]:
    """Extra SGLang flags as argv; a single string is split like a shell would."""
    if extra_args is None:
        return []
    if isinstance(extra_args, str):
        return shlex.split(extra_args)
    args = list(extra_args)
    for arg in args:
        if not isinstance(arg, str):
            raise TypeError(f"SGLang extra_args must be strings, got {arg!r} ({type(arg).__name__})")
    return args


def _check_no_managed_flags(args: Sequence[str]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _MANAGED_FLAGS:
            raise ValueError(
                f"SGLang extra argument {flag!r} is set by Relax (parameter {_MANAGED_FLAGS[flag]!r}); "
                "remove it from the extra arguments"
            )


def sglang_command(
    model_path: str,
    host: str,
    port: int,
    tp_size: int = 1,
    mem_fraction_static: float | None = None,
    weight_version: int | str | None = None,
    extra_args: str | Sequence[str] | None = None,
    *,
    trust_remote_code: bool = False,
    nccl_port: int | None = None,
    api_key: str | None = None,
    enable_metrics: bool = True,
    python: str | None = None,
) -> list[str]:
    """argv that starts one SGLang server.

    ``--enable-metrics`` is on by default because the autoscaler reads ``/metrics``, which SGLang only
    serves with that flag. ``nccl_port`` lets the caller hand out a port it knows is free: several
    engines on one node otherwise pick theirs at random and can collide.
    """
    if not str(model_path):
        raise ValueError("model_path must not be empty")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if mem_fraction_static is not None and not 0.0 < float(mem_fraction_static) <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static!r}")
    if nccl_port is not None and (not isinstance(nccl_port, int) or not 0 < nccl_port < 65536):
        raise ValueError(f"nccl_port must be an integer in 1..65535, got {nccl_port!r}")
    extra = parse_extra_args(extra_args)
    _check_no_managed_flags(extra)

    argv = [python or sys.executable, "-m", SGLANG_MODULE]
    argv += ["--model-path", str(model_path), "--host", str(host), "--port", str(port)]
    argv += ["--tp-size", str(tp_size)]
    if mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(float(mem_fraction_static))]
    if enable_metrics and "--enable-metrics" not in extra:
        argv.append("--enable-metrics")
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if trust_remote_code and "--trust-remote-code" not in extra:
        argv.append("--trust-remote-code")
    if api_key:
        argv += ["--api-key", api_key]
    return argv + extra


def sglang_spec(
    model_path: str,
    host: str,
    port: int,
    log_path: str,
    *,
    weight_version: int | str | None = None,
    options: SGLangOptions | None = None,
    nccl_port: int | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "engine",
) -> LaunchSpec:
    """LaunchSpec of one SGLang server; its health check is ``/health_generate`` like every engine's."""
    options = options or SGLangOptions()
    argv = sglang_command(
        model_path,
        host,
        port,
        tp_size=options.tp_size,
        mem_fraction_static=options.mem_fraction_static,
        weight_version=weight_version,
        extra_args=options.extra_args,
        trust_remote_code=options.trust_remote_code,
        nccl_port=nccl_port,
        api_key=options.api_key,
        python=options.python,
    )
    merged_env = {"PYTHONUNBUFFERED": "1", **(env or {})}
    return LaunchSpec(
        argv=tuple(argv),
        host=host,
        port=int(port),
        log_path=str(log_path),
        env=merged_env,
        name=name,
        token=options.api_key,
    )
