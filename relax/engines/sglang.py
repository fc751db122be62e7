"""The SGLang backend's launch command (``python -m sglang.launch_server``).

SGLang is never imported here (it needs CUDA and is an optional runtime dependency); Relax
only builds its command line and then drives it with the shared launcher, exactly like the built-in
engine. Flag names follow SGLang's ``ServerArgs`` (field ``tp_size`` -> ``--tp-size`` and so on); every
flag emitted here is checked against a snapshot of SGLang's real flags (``scripts/sglang_contract.py``,
``tests/unit/test_sglang_contract.py``).

Supported SGLang: ``SUPPORTED_SGLANG`` (0.5.x, verified against 0.5.23's source). The engine actor calls
:func:`check_sglang_version` before starting a server, so a missing or wrong SGLang fails with one line
instead of a traceback from inside SGLang (``docs/install.md``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from relax.engines.launcher import ENGINE_API_KEY_ENV, LaunchSpec

SGLANG_MODULE = "sglang.launch_server"

#: SGLang releases Relax runs against: 0.5.x, verified against 0.5.23's source. ``--weight-version`` (which
#: Relax always passes) exists from the 0.5 builds of August 2025 on; older ones reject it and never start.
SUPPORTED_SGLANG = ">=0.5.0,<0.6"
#: The release whose source the flag / route / request-field snapshot was read from.
VERIFIED_SGLANG = "0.5.23"
#: What to install, as shown in error messages (the same range as ``SUPPORTED_SGLANG``).
SGLANG_PIP_SPEC = "sglang>=0.5,<0.6"
#: Environment variable holding SGLang's ``--api-key``, so the key needs no place in configs or command lines.
SGLANG_API_KEY_ENV = "RELAX_SGLANG_API_KEY"
#: The key Relax sends to engines attached by URL (``engine_urls``): never the run's own secret, which stays
#: with the engines the run starts. Unset: external engines get no Authorization header.
EXTERNAL_ENGINE_API_KEY_ENV = "RELAX_EXTERNAL_ENGINE_API_KEY"
#: How long asking an interpreter for its SGLang version may take (a cold import of importlib is fast;
#: a network file system on a busy node is not).
VERSION_CHECK_TIMEOUT_S = 60.0
# Reads the installed version from package metadata: SGLang itself is never imported, not even there.
_VERSION_PROBE = "import importlib.metadata as m; print(m.version('sglang'))"
# argparse (SGLang's parser) also accepts any unambiguous prefix of a flag, and in 0.5.23 two letters are
# enough for some: `--po 1` sets --port, `--ho`, `--ap`, `--te` likewise. Single letters are ambiguous among
# SGLang's ~560 flags (tests/unit/test_sglang_contract.py checks both against the snapshot).
_MIN_PREFIX_CHARS = 2

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
    "--admin-api-key": "admin_api_key",
    "--config": "config_path",  # the engine's private keys file; other flags go as --sglang-* (or extra_args)
    "--max-running-requests": "max_running_requests",
    "--random-seed": "random_seed",
}
#: The three ways out when an engine's interpreter cannot run SGLang (each error message ends with them).
_FIXES = (f"install it into that interpreter (pip install 'sglang=={VERIFIED_SGLANG}'), or pass --sglang-python PATH "
          "(a Python that has it, e.g. SGLang's own environment), or pass --rollout-backend builtin")
#: How long a stop waits for SGLang's own shutdown: its SIGTERM watchdog looks every 5 s, drains, then stops
#: its scheduler (measured on CPU: 2-5 s idle).
SGLANG_STOP_GRACE_S = 15.0
# Seeds go to numpy's ``np.random.seed`` inside SGLang, which accepts 0 .. 2**32 - 1 only.
_MAX_SEED = 2**32 - 1


class SGLangVersionError(ValueError):
    """SGLang is missing, unreadable or outside ``SUPPORTED_SGLANG`` for the interpreter that would run it."""


@dataclass(frozen=True)
class SGLangOptions:
    """Per-engine SGLang settings that are not about where the engine runs.

    ``api_key`` (SGLang's generation key) and ``admin_api_key`` (its control key) are left out of ``repr`` so
    that logging the options (or a Ray error quoting them) does not print them. They reach the server through
    a 0600 ``--config`` file, never its argv.
    """

    tp_size: int = 1
    mem_fraction_static: float | None = None
    trust_remote_code: bool = False
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()
    python: str | None = None  # interpreter with sglang installed; default: this one
    max_running_requests: int | None = None
    random_seed: int | None = None
    #: ``dummy``: SGLang's ``--load-format dummy`` (random weights, no checkpoint read) for a joining engine.
    load_format: str | None = None
    #: On a node without CUDA: how many engines share its cores (each binds its threads to its own share).
    cpu_engines_per_node: int = 1

    def __post_init__(self) -> None:
        # Checked here as well as in sglang_command so a bad value fails where the options are made
        # (config parsing), not later on a GPU node when the first engine starts.
        _check_max_running_requests(self.max_running_requests)
        _check_random_seed(self.random_seed)


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The engines' key from ``RELAX_SGLANG_API_KEY`` (or ``RELAX_ENGINE_API_KEY``); ``None`` when unset or blank.

    An environment variable keeps the key out of config files and out of the command lines Relax logs
    (those mask it as ``***`` anyway, ``relax.engines.launcher.format_argv``). Surrounding whitespace is
    dropped: a key read with ``$(cat keyfile)`` often carries a newline that would never match.
    """
    for name in (SGLANG_API_KEY_ENV, ENGINE_API_KEY_ENV):
        value = environ.get(name)
        if value is not None and value.strip():
            return value.strip()
    return None


def external_engine_key(environ: Mapping[str, str] = os.environ) -> str | None:
    """The key for external engines (``RELAX_EXTERNAL_ENGINE_API_KEY``); ``None`` when unset or blank."""
    value = environ.get(EXTERNAL_ENGINE_API_KEY_ENV)
    return value.strip() if value is not None and value.strip() else None


def engine_secret() -> str:
    """The run's engine secret: a fresh random one that only this run's manager holds. Every engine's keys are
    derived from it (``relax.engines.keys``); a user's key (:func:`api_key_from_env`, for scripts that call the
    engines themselves) becomes the engines' generation key, never their admin key."""
    import secrets

    return secrets.token_urlsafe(32)


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


def _managed_prefix_matches(flag: str) -> list[str]:
    """Managed flags that ``flag`` abbreviates the way argparse would accept (``--mem-frac``)."""
    if not flag.startswith("--") or len(flag) - 2 < _MIN_PREFIX_CHARS:
        return []
    return [managed for managed in _MANAGED_FLAGS if managed.startswith(flag)]


def _check_no_managed_flags(args: Sequence[str]) -> None:
    """Reject managed flags in ``extra_args``, spelled out or abbreviated (argparse takes both)."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _MANAGED_FLAGS:
            raise ValueError(
                f"SGLang extra argument {flag!r} is set by Relax (parameter {_MANAGED_FLAGS[flag]!r}); "
                "remove it from the extra arguments"
            )
        matches = _managed_prefix_matches(flag)
        if matches:
            params = sorted({_MANAGED_FLAGS[m] for m in matches})
            raise ValueError(
                f"SGLang extra argument {flag!r} abbreviates {' / '.join(matches)}, which is set by Relax "
                f"(parameter {' / '.join(repr(p) for p in params)}); remove it from the extra arguments"
            )


def reserved_flag_problems(passthrough: Sequence[tuple[str, Sequence[str]]], prefix: str = "--sglang-") -> list[str]:
    """One line per ``--sglang-X`` passthrough that names a flag Relax sets itself (pre-flight).

    ``passthrough`` is ``TrainArgs.sglang_passthrough`` (``X`` without the prefix, its values); the same flags
    would be refused by :func:`sglang_command` when an engine starts, which is minutes later on a GPU node.
    """
    problems = []
    for name, _values in passthrough:
        try:
            _check_no_managed_flags(["--" + name])
        except ValueError:
            flag = "--" + name
            managed = [flag] if flag in _MANAGED_FLAGS else _managed_prefix_matches(flag)
            params = sorted({_MANAGED_FLAGS[m] for m in managed})
            problems.append(
                f"{prefix}{name}: SGLang's {' / '.join(managed)} is set by Relax ({' / '.join(params)}); remove "
                f"{prefix}{name} from the command line"
            )
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_max_running_requests(value: int | None) -> None:
    if value is not None and (not _is_int(value) or value < 1):
        raise ValueError(f"max_running_requests must be a positive integer, got {value!r}")


def _check_random_seed(value: int | None) -> None:
    if value is not None and (not _is_int(value) or not 0 <= value <= _MAX_SEED):
        raise ValueError(f"random_seed must be an integer in 0..{_MAX_SEED} (SGLang seeds numpy), got {value!r}")


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
    config_path: str | None = None,
    enable_metrics: bool = True,
    max_running_requests: int | None = None,
    random_seed: int | None = None,
    python: str | None = None,
    load_format: str | None = None,
) -> list[str]:
    """argv that starts one SGLang server.

    ``--enable-metrics`` is on by default because the autoscaler reads ``/metrics``, which SGLang only
    serves with that flag. ``nccl_port`` lets the caller hand out a port it knows is free: several
    engines on one node otherwise pick theirs at random and can collide. Keys never appear here:
    ``config_path`` names the private YAML file that holds them (:func:`keys_config`), which any local user
    could otherwise read from ``ps``.
    The SGLang version is not checked here (commands are built where SGLang is not installed); the engine
    actor calls :func:`check_sglang_version` before starting the server.
    """
    if not str(model_path):
        raise ValueError("model_path must not be empty")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    if not _is_int(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if mem_fraction_static is not None and not 0.0 < float(mem_fraction_static) <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static!r}")
    if nccl_port is not None and (not isinstance(nccl_port, int) or not 0 < nccl_port < 65536):
        raise ValueError(f"nccl_port must be an integer in 1..65535, got {nccl_port!r}")
    _check_max_running_requests(max_running_requests)
    _check_random_seed(random_seed)
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
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if load_format is not None and "--load-format" not in extra:
        argv += ["--load-format", str(load_format)]
    if trust_remote_code and "--trust-remote-code" not in extra:
        argv.append("--trust-remote-code")
    if config_path:
        argv += ["--config", str(config_path)]
    return argv + extra


def keys_config(api_key: str | None, admin_api_key: str | None) -> str:
    """The ``--config`` YAML that gives an SGLang server its keys (SGLang merges it into its flags)."""
    lines = [f"{name}: {json.dumps(value)}" for name, value in (("api-key", api_key), ("admin-api-key", admin_api_key))
             if value]
    return "\n".join(lines) + "\n"


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
    """LaunchSpec of one SGLang server; its health check is ``/health_generate`` like every engine's.

    Its keys go in ``<log_path>.keys.yaml`` (0600, removed when the server stops); its ``/dev/shm`` files carry
    its NCCL port (``deepspeed_allreduce_buffer_0_<host>_<nccl_port>_0``), which is how they are found.
    """
    options = options or SGLangOptions()
    keys = keys_config(options.api_key, options.admin_api_key) if options.api_key or options.admin_api_key else None
    config_path = f"{log_path}.keys.yaml" if keys else None
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
        config_path=config_path,
        max_running_requests=options.max_running_requests,
        random_seed=options.random_seed,
        python=options.python,
        load_format=options.load_format,
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
        secret_files={config_path: keys} if config_path and keys else {},
        shm_tags=(f"_{nccl_port}_",) if nccl_port else (),
        stop_grace_s=SGLANG_STOP_GRACE_S,
    )


# -- the SGLang version ---------------------------------------------------------------------------------

#: Runs ``argv`` and returns (exit code, stdout, stderr); raises ``subprocess.TimeoutExpired`` or ``OSError``.
Runner = Callable[[Sequence[str], float], tuple[int, str, str]]


def _run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                            env=None if env is None else {**os.environ, **env})
    return result.returncode, result.stdout, result.stderr


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def check_sglang_version(
    python: str,
    *,
    timeout: float = VERSION_CHECK_TIMEOUT_S,
    runner: Runner = _run,
    env: Mapping[str, str] | None = None,
) -> str:
    """The SGLang version installed for interpreter ``python``; raises :class:`SGLangVersionError` otherwise.

    Asks that interpreter in a subprocess (package metadata only: SGLang is never imported, here or there)
    because the interpreter that runs SGLang is often not Relax's own (``SGLangOptions.python``). Every
    failure is one line naming the interpreter and the fix. Pre-releases and dev builds inside the range
    are accepted (a source build of a 0.5 branch reports ``0.5.24.dev0``). ``env``: the overrides the server
    will run with (a ``PYTHONPATH`` decides what is installed, as for the server). ``runner`` is for tests.
    """
    try:
        if env is not None and runner is _run:
            code, out, err = _run([python, "-c", _VERSION_PROBE], timeout, env)
        else:
            code, out, err = runner([python, "-c", _VERSION_PROBE], timeout)
    except subprocess.TimeoutExpired:
        raise SGLangVersionError(
            f"asking {python} for its SGLang version timed out after {timeout:g} s; check that the interpreter "
            "starts on this node"
        ) from None
    except OSError as error:
        raise SGLangVersionError(
            f"cannot run {python} to check its SGLang version ({error.strerror or error}); pass --sglang-python "
            "PATH naming a Python that exists on the GPU nodes, or --rollout-backend builtin"
        ) from None
    if code != 0:
        if "PackageNotFoundError" in err:
            raise SGLangVersionError(
                f"SGLang is not installed for {python} (the interpreter this engine asked): {_FIXES}"
            )
        raise SGLangVersionError(f"{python} failed to report its SGLang version (exit {code}): {_last_line(err)}")
    found = out.strip()
    try:
        version = Version(found)
    except InvalidVersion:
        raise SGLangVersionError(f"{python} reports SGLang version {found!r}, which is not a version number") from None
    if not SpecifierSet(SUPPORTED_SGLANG).contains(version, prereleases=True):
        raise SGLangVersionError(
            f"SGLang {found} is installed for {python}, but Relax supports sglang{SUPPORTED_SGLANG} "
            f"(verified against {VERIFIED_SGLANG}): {_FIXES}"
        )
    return found
