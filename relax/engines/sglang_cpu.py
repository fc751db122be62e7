"""SGLang on a node without CUDA: its CPU platform, set up by Relax so the user does not have to.

SGLang 0.5.23 serves on x86 CPUs with AVX-512 (AMX Xeons are its target) when it is started with its CPU
platform variable, its preloads and a handful of flags; found by hand, that is eight ``--sglang-*`` flags and
an environment variable. On an engine node without CUDA, Relax passes them itself:

* ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's platform switch) and ``LD_PRELOAD`` of Intel OpenMP from SGLang's own
  venv, tcmalloc and tbbmalloc — the preloads SGLang's CPU documentation asks for — where they exist;
* ``--device cpu``; ``--dtype bfloat16``: SGLang's CPU kernels have no fp32 (``rmsnorm_kernel not implemented for
  'Float'`` on AMX machines), so an fp32 checkpoint is served in bf16 and the trainer publishes bf16 to match;
* an attention backend the model supports: ``intel_amx`` needs AMX and a head dimension that is a multiple of
  32 (the tiny preset's 16 crashes its warm-up: ``invalid head_size 16``), else ``torch_native``;
* no overlap schedule and no CUDA graphs (neither exists on CPU), and a bounded KV pool (without
  ``--max-total-tokens`` SGLang sizes it from the node's free RAM);
* ``--sleep-on-idle``: an idle scheduler otherwise polls at 100 % of a core (measured), which on a CPU node is
  a core taken from the trainer and the other engines;
* one core set per engine (``SGLANG_CPU_OMP_THREADS_BIND``): without it every server binds its threads to
  every core, and two engines on one node spin against each other.

Explicit ``--sglang-*`` flags always win: a flag the user passed is never added again. Everything here is
pure except :func:`read_cpu_node` and :class:`CoreClaim`, which look at the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: SGLang's switch to its CPU platform.
CPU_PLATFORM_ENV = "SGLANG_USE_CPU_ENGINE"
#: SGLang's per-rank core sets (``0-3|4-7`` for two TP ranks).
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
#: KV pool in tokens when the user does not bound it (SmolLM2-135M: 23 KB a token in bf16, so ~0.4 GB).
DEFAULT_MAX_TOTAL_TOKENS = 16384
#: The AMX attention kernels' head dimension granule (``extend.cpp``: ``head_size % 32 == 0``).
AMX_HEAD_DIM_MULTIPLE = 32
#: Debian's locations of the allocators SGLang's CPU guide preloads.
SYSTEM_PRELOADS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtbbmalloc.so.2")
#: Where engines on one machine claim their cores (machine-wide: fake nodes and other runs share the cores).
CORE_LOCK_DIR = Path(tempfile.gettempdir()) / "relax-cpu-cores"


@dataclass(frozen=True)
class CpuNode:
    """What an engine's node offers SGLang's CPU platform."""

    amx: bool
    avx512: bool
    cores: tuple[int, ...]
    preloads: tuple[str, ...] = ()


@dataclass(frozen=True)
class CpuLaunch:
    """The flags and environment an SGLang server on CPU is started with, and why, in one line."""

    args: tuple[str, ...]
    env: Mapping[str, str]
    summary: str


def model_head_dim(model_path: str | os.PathLike[str]) -> int | None:
    """The attention head dimension from a Hugging Face ``config.json`` (``head_dim``, else hidden / heads)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def attention_backend(node: CpuNode, head_dim: int | None) -> tuple[str, str]:
    """The attention backend for ``node`` and a model of ``head_dim``, and the reason."""
    if not node.amx:
        return "torch_native", "no AMX on this CPU"
    if head_dim is None or head_dim % AMX_HEAD_DIM_MULTIPLE:
        return "torch_native", f"head dim {head_dim} is not a multiple of {AMX_HEAD_DIM_MULTIPLE} (AMX kernels)"
    return "intel_amx", f"AMX, head dim {head_dim}"


def flag_names(args: Sequence[str]) -> set[str]:
    """The ``--flags`` in an argv (``--x=1`` and ``--x 1`` alike)."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def threads_bind(core_sets: Sequence[Sequence[int]]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for one set per TP rank: ``0-1|2-3``; single cores and gaps as lists."""
    return "|".join(",".join(_ranges(sorted(cores))) for cores in core_sets)


def _ranges(cores: Sequence[int]) -> list[str]:
    out: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return out


def cpu_launch(
    node: CpuNode,
    *,
    head_dim: int | None,
    user_args: Sequence[str] = (),
    user_env: Mapping[str, str] | None = None,
    venv_lib: str | None = None,
    core_sets: Sequence[Sequence[int]] = (),
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
    offline: bool = True,
) -> CpuLaunch:
    """SGLang's CPU platform for one server: flags the user did not pass, and the environment.

    ``venv_lib``: the SGLang venv's ``lib`` directory (Intel OpenMP's ``libiomp5.so`` lives there).
    ``core_sets``: one set of cores per TP rank (empty: SGLang binds its threads itself).
    ``offline``: the model is a local directory, so SGLang must not look for it on a hub.
    """
    given = flag_names(user_args)
    user_env = user_env or {}
    backend, why = attention_backend(node, head_dim)
    wanted: list[tuple[str, tuple[str, ...]]] = [
        ("--device", ("cpu",)),
        ("--dtype", ("bfloat16",)),
        ("--attention-backend", (backend,)),
        ("--disable-overlap-schedule", ()),
        ("--cuda-graph-backend-decode", ("disabled",)),
        ("--cuda-graph-backend-prefill", ("disabled",)),
        ("--max-total-tokens", (str(max_total_tokens),)),
        ("--sleep-on-idle", ()),
    ]
    args: list[str] = []
    for flag, values in wanted:
        if flag not in given:
            args += [flag, *values]
    env: dict[str, str] = {CPU_PLATFORM_ENV: "1"}
    preloads = [p for p in ((f"{venv_lib}/libiomp5.so",) if venv_lib else ()) if os.path.exists(p)]
    preloads += list(node.preloads)
    if "LD_PRELOAD" not in user_env and preloads:
        env["LD_PRELOAD"] = ":".join(preloads)
    if core_sets and THREADS_BIND_ENV not in user_env:
        env[THREADS_BIND_ENV] = threads_bind(core_sets)
    if offline:
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
    chosen = "attention " + (backend if "--attention-backend" not in given else "as given")
    dtype = "bf16" if "--dtype" not in given else "dtype as given"
    cores = f"cores {env[THREADS_BIND_ENV]}" if THREADS_BIND_ENV in env else "cores: SGLang's own binding"
    return CpuLaunch(tuple(args), env, f"SGLang CPU platform: {dtype}, {chosen} ({why}), {cores}")


# -- the machine (impure) ------------------------------------------------------------------------------


def read_cpu_node(cpuinfo: str = "/proc/cpuinfo") -> CpuNode:
    """This machine's CPU flags, the cores this process may use, and the system preloads present."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(
        range(os.cpu_count() or 1))
    return CpuNode(amx="amx_bf16" in flags, avx512="avx512f" in flags, cores=cores,
                   preloads=tuple(p for p in SYSTEM_PRELOADS if os.path.exists(p)))


class CoreClaim:
    """Cores one engine holds for its life: an ``flock`` per core, released when this process lets go or dies.

    Engines on one machine take disjoint cores while there are enough; when there are not, the last ones share
    (``shared`` is True) rather than fail — slower, and said so in the start-up log.
    """

    def __init__(self, lock_dir: Path = CORE_LOCK_DIR) -> None:
        self.lock_dir = lock_dir
        self._fds: list[int] = []
        self.cores: tuple[int, ...] = ()
        self.shared = False

    def claim(self, cores: Sequence[int], want: int) -> tuple[int, ...]:
        """Up to ``want`` free cores of ``cores``; all of ``cores`` (shared) when none is free."""
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        taken: list[int] = []
        for core in cores:
            if len(taken) == want:
                break
            fd = os.open(self.lock_dir / f"core-{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._fds.append(fd)
            taken.append(core)
        if not taken:
            self.shared = True
            taken = list(cores)
        self.cores = tuple(taken)
        return self.cores

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


__all__ = ["CpuLaunch", "CpuNode", "CoreClaim", "attention_backend", "cpu_launch", "model_head_dim",
           "read_cpu_node", "threads_bind"]
