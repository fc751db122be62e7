"""Engine backends: what differs between SGLang and the built-in engine, in one adapter each.

Everything else about an engine — its actor, its process, its HTTP contract, its weight paths — is shared.
An adapter answers the few questions where the two differ: which options it takes, how its server is
launched on the node it landed on (SGLang on a node without CUDA runs its CPU platform, set up here), what
must be true before it starts (SGLang's version), which dtype the trainer publishes for it, and how many
ranks it puts in a weight-update group. Callers look an adapter up by name (:func:`engine_backend`) instead
of branching on the name.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

from relax.engines.launcher import BuiltinOptions, LaunchSpec, builtin_spec
from relax.engines.sglang import SGLangOptions, check_sglang_version, sglang_spec
from relax.engines.sglang_cpu import CoreClaim, cpu_launch, model_head_dim, read_cpu_node

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A backend's options and environment for one engine on its node, and what it holds until the engine stops."""

    options: Any
    env: dict[str, str]
    summary: str = ""
    cores: CoreClaim | None = field(default=None, repr=False)

    def release(self) -> None:
        if self.cores is not None:
            self.cores.release()


class EngineBackend(Protocol):
    """What Relax needs to know about one kind of engine."""

    name: ClassVar[str]
    #: The options class the backend takes (BuiltinOptions or SGLangOptions).
    options_type: ClassVar[type]
    #: dtype name the trainer publishes weights in for these engines (None: the trainer's own).
    publication_dtype: ClassVar[str | None]
    #: How the server lays out the model it serves: what its ``/weights_checker`` checksums are of
    #: (``relax.weights.digest.ChecksumLayout``).
    checksum_layout: ClassVar[str]
    #: Whether the server needs a port of its own for its weight-update group rendezvous.
    needs_nccl_port: ClassVar[bool]

    def options(self, *, gpus_per_engine: int, max_running_requests: int | None, extra_args: tuple[str, ...],
                mem_fraction_static: float | None, random_seed: int | None, python: str | None) -> Any:
        """The run's options for every engine of this backend (keys are added per engine)."""
        ...

    def prepare(self, options: Any, model_path: str, env: Mapping[str, str], *, cuda: bool) -> Prepared:
        """On the engine's node, before the first launch: check the backend can run, adapt to the node."""
        ...

    def launch_spec(self, engine_id: str, model_path: str, host: str, port: int, log_path: str, *,
                    weight_version: int | str | None, options: Any, env: Mapping[str, str],
                    nccl_port: int | None) -> LaunchSpec:
        """The server's LaunchSpec (pure)."""
        ...

    def broadcast_ranks(self, gpus_per_engine: int) -> int:
        """How many ranks one engine puts in a weight-update group."""
        ...


class BuiltinBackend:
    """Relax's own engine: one process, fp32 on CPU, the trainer's dtype."""

    name: ClassVar[str] = "builtin"
    options_type: ClassVar[type] = BuiltinOptions
    publication_dtype: ClassVar[str | None] = None  # fp32 on CPU: the tests compare log-probs to 1e-4
    checksum_layout: ClassVar[str] = "hf"  # it serves the Hugging Face model as it is
    needs_nccl_port: ClassVar[bool] = False

    def options(self, *, gpus_per_engine: int, max_running_requests: int | None, extra_args: tuple[str, ...],
                mem_fraction_static: float | None, random_seed: int | None, python: str | None) -> BuiltinOptions:
        return BuiltinOptions(max_running_requests=max_running_requests, num_threads=1)

    def prepare(self, options: Any, model_path: str, env: Mapping[str, str], *, cuda: bool) -> Prepared:
        return Prepared(options, dict(env))

    def launch_spec(self, engine_id: str, model_path: str, host: str, port: int, log_path: str, *,
                    weight_version: int | str | None, options: Any, env: Mapping[str, str],
                    nccl_port: int | None) -> LaunchSpec:
        return builtin_spec(model_path, host, port, log_path, weight_version=weight_version, options=options,
                            env=env, name=engine_id)

    def broadcast_ranks(self, gpus_per_engine: int) -> int:
        return 1


class SGLangBackend:
    """SGLang's server (``python -m sglang.launch_server``), on CUDA GPUs or, on a node without CUDA, its CPU
    platform (``relax.engines.sglang_cpu``): bf16 either way, so the trainer publishes bf16."""

    name: ClassVar[str] = "sglang"
    options_type: ClassVar[type] = SGLangOptions
    publication_dtype: ClassVar[str | None] = "bfloat16"
    checksum_layout: ClassVar[str] = "sglang"  # fused qkv/gate_up, padded vocabulary, tied head dropped
    needs_nccl_port: ClassVar[bool] = True

    def options(self, *, gpus_per_engine: int, max_running_requests: int | None, extra_args: tuple[str, ...],
                mem_fraction_static: float | None, random_seed: int | None, python: str | None) -> SGLangOptions:
        return SGLangOptions(tp_size=gpus_per_engine, mem_fraction_static=mem_fraction_static, extra_args=extra_args,
                             max_running_requests=max_running_requests, random_seed=random_seed, python=python)

    def prepare(self, options: Any, model_path: str, env: Mapping[str, str], *, cuda: bool) -> Prepared:
        """Check SGLang's version in the server's interpreter; without CUDA, set up SGLang's CPU platform."""
        opts = options if isinstance(options, SGLangOptions) else SGLangOptions()
        python = opts.python or sys.executable
        found = check_sglang_version(python, env=dict(env) or None)  # one clear line before anything starts
        if cuda:
            return Prepared(opts, dict(env), f"SGLang {found} ({python})")
        node = read_cpu_node()
        claim = CoreClaim()
        want = max(1, len(node.cores) // max(1, opts.cpu_engines_per_node)) * opts.tp_size
        cores = claim.claim(node.cores, want)
        per_rank = max(1, len(cores) // opts.tp_size)
        core_sets = [cores[i * per_rank:(i + 1) * per_rank] or cores for i in range(opts.tp_size)]
        launch = cpu_launch(node, head_dim=model_head_dim(model_path), user_args=opts.extra_args, user_env=env,
                            venv_lib=str(Path(python).parent.parent / "lib"), core_sets=core_sets,
                            offline=os.path.isdir(model_path))
        summary = f"SGLang {found} ({python}); {launch.summary}" + (
            " — shared with other engines: no free cores left on this node" if claim.shared else "")
        return Prepared(replace(opts, extra_args=(*launch.args, *opts.extra_args)), {**launch.env, **env}, summary,
                        claim)

    def launch_spec(self, engine_id: str, model_path: str, host: str, port: int, log_path: str, *,
                    weight_version: int | str | None, options: Any, env: Mapping[str, str],
                    nccl_port: int | None) -> LaunchSpec:
        return sglang_spec(model_path, host, port, log_path, weight_version=weight_version, options=options,
                           nccl_port=nccl_port, env=env, name=engine_id)

    def broadcast_ranks(self, gpus_per_engine: int) -> int:
        return gpus_per_engine  # one rank per TP rank of the server


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, skipping torch's import (seconds) on a node with no GPU device files."""
    import glob

    if not (glob.glob("/dev/nvidia[0-9]*") or os.path.isdir("/proc/driver/nvidia/gpus") or os.path.exists("/dev/kfd")
            or os.path.exists("/dev/dxg")):
        return False
    import torch

    return bool(torch.cuda.is_available())


#: The registry: ``--rollout-backend`` names (``auto`` is resolved before an adapter is asked for).
ENGINE_BACKENDS: dict[str, EngineBackend] = {b.name: b for b in (BuiltinBackend(), SGLangBackend())}


def engine_backend(name: str) -> EngineBackend:
    """The adapter for backend ``name``; one line naming the choices otherwise."""
    try:
        return ENGINE_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown engine backend {name!r}; expected one of {', '.join(ENGINE_BACKENDS)}") from None


__all__ = ["ENGINE_BACKENDS", "BuiltinBackend", "EngineBackend", "Prepared", "SGLangBackend", "cuda_available",
           "engine_backend"]
