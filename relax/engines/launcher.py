"""Start, health-check and stop one engine server process; shared by the SGLang and built-in backends.

Functional core, imperative shell: a backend's command builder is a pure function that returns a
:class:`LaunchSpec` (argv, env, address, health path, log path); :class:`ServerProcess` is the only code
that touches processes. Because SGLang cannot run on the development machines, the tests drive this very
code path with the built-in engine's spec, which keeps the SGLang launch path honest (docs/architecture.md, "Engines").
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from relax.cluster.secret_env import DRIVER_ONLY, RAY_ONLY, without
from relax.engines.guard import describe_exit
from relax.engines.shm_leftovers import ShmLedger, group_pids

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_PATH = "/health_generate"
#: The built-in engine reads its key here (not from argv, so `ps` does not show it); users set it to choose
#: the run's engine secret themselves (relax.engines.sglang.engine_secret).
ENGINE_API_KEY_ENV = "RELAX_ENGINE_API_KEY"
#: The built-in engine's admin key (SGLang's ``--admin-api-key``), also from the environment only.
ENGINE_ADMIN_API_KEY_ENV = "RELAX_ENGINE_ADMIN_API_KEY"
#: The run's secrets an engine server never reads from what it inherits: its own keys come in its spec's env
#: (or SGLang's config file), the others are the driver's, Ray's, or another engine kind's
#: (``relax.engines.sglang``'s ``RELAX_SGLANG_API_KEY``, ``RELAX_EXTERNAL_ENGINE_API_KEY``, the router's key).
WITHHELD_FROM_ENGINES = frozenset({
    *DRIVER_ONLY, *RAY_ONLY, ENGINE_API_KEY_ENV, ENGINE_ADMIN_API_KEY_ENV,
    "RELAX_SGLANG_API_KEY", "RELAX_EXTERNAL_ENGINE_API_KEY", "RELAX_SGLANG_ROUTER_API_KEY",
})
# Lines of the server log quoted in launch errors: enough for a Python traceback, short enough to read.
LOG_TAIL_LINES = 40
_TAIL_BYTES = 64 * 1024
# Upper bound on one health probe: /health_generate runs a real generation, which can be slow the first
# time (compilation, cache warm-up), but a probe that hangs longer should not eat the whole deadline.
_MAX_PROBE_S = 30.0
_SECRET_FLAGS = frozenset({"--api-key", "--admin-api-key"})


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one server and know when it is ready; pure data, picklable.

    ``env`` holds overrides applied on top of the launching process's environment. ``host`` is the bind
    address; :attr:`url` is the address to connect to (a wildcard bind is reached over loopback).
    ``token`` is sent as a bearer token with health probes (SGLang's ``--api-key``).
    """

    argv: tuple[str, ...] = field(repr=False)  # may hold --api-key: the repr shows the masked form below
    host: str
    port: int
    log_path: str
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = DEFAULT_HEALTH_PATH
    name: str = "engine"
    cwd: str | None = None
    token: str | None = field(default=None, repr=False)
    #: Files written (mode 0600) before the server starts and removed after it stops: path -> text. How a
    #: server gets its keys without them in argv (SGLang's ``--config`` YAML).
    secret_files: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Name fragments of ``/dev/shm`` files that belong to this server (relax.engines.shm_leftovers).
    shm_tags: tuple[str, ...] = ()
    #: How long a stop waits for the server's own graceful shutdown before it is killed.
    stop_grace_s: float = 10.0

    def __repr__(self) -> str:
        return (f"LaunchSpec(name={self.name!r}, argv={format_argv(self.argv)!r}, host={self.host!r}, "
                f"port={self.port}, log_path={self.log_path!r})")

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("LaunchSpec.argv must not be empty")
        if not 0 < int(self.port) < 65536:
            raise ValueError(f"LaunchSpec.port must be in 1..65535, got {self.port!r}")
        if not self.health_path.startswith("/"):
            raise ValueError(f"LaunchSpec.health_path must start with '/', got {self.health_path!r}")
        object.__setattr__(self, "argv", tuple(str(a) for a in self.argv))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in self.env.items()})
        object.__setattr__(self, "secret_files", {str(k): str(v) for k, v in self.secret_files.items()})
        object.__setattr__(self, "shm_tags", tuple(self.shm_tags))

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"


def connect_host(bind_host: str) -> str:
    """The address a client on this node uses to reach a server bound to ``bind_host``."""
    if bind_host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind_host == "::":
        return "[::1]"
    if ":" in bind_host and not bind_host.startswith("["):
        return f"[{bind_host}]"
    return bind_host


# What a server's log says when its port is taken (uvicorn, SGLang, Python's socket errors).
PORT_IN_USE_MARKERS = ("address already in use", "errno 98", "port is in use", "port is not available")


class ServerLaunchError(RuntimeError):
    """The server exited or never became healthy; the message quotes the end of its log."""

    def __init__(self, message: str, *, name: str, exit_code: int | None, log_path: str, log_tail: str) -> None:
        super().__init__(message)
        self.name = name
        self.exit_code = exit_code
        self.log_path = log_path
        self.log_tail = log_tail

    @property
    def port_was_taken(self) -> bool:
        """The server exited because its port was taken meanwhile: worth retrying on another port.

        A free port is found by binding port 0 and released again, and a server binds it only after
        loading its model (seconds later), so another process can take it in between.
        """
        tail = self.log_tail.lower()
        return self.exit_code is not None and any(marker in tail for marker in PORT_IN_USE_MARKERS)

    def __reduce__(self):  # survive the trip through Ray's error wrapping
        return (_rebuild_launch_error, (str(self), self.name, self.exit_code, self.log_path, self.log_tail))


def _rebuild_launch_error(
    message: str, name: str, exit_code: int | None, log_path: str, log_tail: str
) -> ServerLaunchError:
    return ServerLaunchError(message, name=name, exit_code=exit_code, log_path=log_path, log_tail=log_tail)


#: Lines that say an error in a server log (a Python exception's last line, SGLang's and uvicorn's error lines).
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception|Exit|Interrupt)\b:?|.*\b(?:Error|ERROR|FATAL|Fatal)\b[:\]])")
#: Lines that look like errors and are not: SGLang's optional-model import notices, warnings.
_NOT_AN_ERROR = re.compile(r"Ignore import error|Warning|warnings\.warn|^\s*(?:File |\^)")


def last_error_line(log_tail: str) -> str | None:
    """The server's own last error line in ``log_tail`` (``RuntimeError: invalid head_size 16``), or None.

    A server that dies before it is healthy is reported with this line rather than a guess from its exit code:
    SGLang kills its own process tree with SIGKILL after an error in warm-up, which looks like the OOM killer.
    """
    for line in reversed(log_tail.splitlines()):
        text = line.strip()
        if text and _ERROR_LINE.match(text) and not _NOT_AN_ERROR.search(text):
            return text if len(text) <= 300 else text[:297] + "..."
    return None


def read_log_tail(path: str | os.PathLike[str], lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist yet)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL_BYTES))
            data = fh.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def guarded(argv: Sequence[str], shm_tags: Sequence[str] = ()) -> list[str]:
    """``argv`` run under ``relax.engines.guard``: the server dies when this process does, however it dies."""
    tags = [arg for tag in shm_tags for arg in ("--shm-tag", tag)]
    return [sys.executable, "-m", "relax.engines.guard", "--owner-pid", str(os.getpid()), *tags, "--", *argv]


def working_directory(spec_cwd: str | None, log_dir: str) -> tuple[str | None, str | None]:
    """Where the server starts, and a warning when it cannot start where asked; ``None``: this process's own.

    A Ray job with a ``working_dir`` runs its workers inside the unpacked copy, and a node's runtime-env agent
    re-extracts that copy (``rmtree``, then unzip) when it first needs it. Where nodes share a filesystem (the
    local elastic cluster's fake nodes; shared ``/tmp/ray`` mounts) a joining node so deletes the directory
    every running worker sits in. A server started from a deleted directory dies at torch's first matmul
    ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so", exit 2). So: the directory by *name* (the
    re-extracted copy, where relative paths in argv still resolve), else the log directory.
    """
    if spec_cwd is not None:
        return spec_cwd, None
    try:
        os.getcwd()
        return None, None
    except FileNotFoundError:
        pass
    by_name = os.environ.get("PWD", "")  # the shell that exec'd the worker (`cd <working_dir> && exec ...`) set it
    if by_name and os.path.isdir(by_name):
        return by_name, f"this process's working directory was removed; starting the server in {by_name} (same path)"
    return log_dir, (f"this process's working directory was removed (and PWD={by_name or '<unset>'} is gone); "
                     f"starting the server in its log directory {log_dir}")


class ServerProcess:
    """One server subprocess in its own session (process group), logging to ``spec.log_path``.

    Its own session means ``stop`` reaches every process the server spawned (SGLang forks schedulers
    and detokenizers) and a signal aimed at the parent (Ctrl-C in a terminal, SIGTERM to a Ray worker)
    does not hit the server behind our back. ``stop`` is idempotent and safe to call from any thread.
    The session leader is ``relax.engines.guard`` (``pid`` is its pid): it stops the group when the
    process that called ``start`` is gone, so no server outlives its owner.
    """

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._started_at: float | None = None
        self._ledger = ShmLedger(tags=spec.shm_tags)

    def __repr__(self) -> str:
        return f"ServerProcess({self.spec.name!r}, url={self.url!r}, pid={self.pid})"

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return read_log_tail(self.spec.log_path, lines)

    def start(self) -> int:
        """Start the server; returns its pid. Starting twice is a bug and raises."""
        with self._lock:
            if self._proc is not None:
                raise RuntimeError(f"{self.spec.name}: server already started (pid {self._proc.pid})")
            log_path = Path(self.spec.log_path)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            for path, text in self.spec.secret_files.items():
                write_private(path, text)
            env = {**without(os.environ, WITHHELD_FROM_ENGINES), **self.spec.env}
            cwd, why = working_directory(self.spec.cwd, str(log_path.parent))
            if why:
                logger.warning("%s: %s", self.spec.name, why)
            # 0600: a server log may quote its keys (SGLang prints its server_args at start)
            with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
                os.fchmod(log.fileno(), 0o600)
                self._proc = subprocess.Popen(
                    guarded(self.spec.argv, self.spec.shm_tags),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                    close_fds=True,
                )
            self._started_at = time.monotonic()
        logger.info(
            "%s: started server pid=%d url=%s log=%s argv=%s",
            self.spec.name,
            self._proc.pid,
            self.url,
            log_path,
            format_argv(self.spec.argv),
        )
        return self._proc.pid

    def wait_healthy(self, timeout: float, *, poll_interval: float = 0.5) -> float:
        """Poll ``GET spec.health_path`` until it answers 200; returns the seconds it took.

        Fails fast when the process exits. On failure raises :class:`ServerLaunchError` quoting the log
        tail and exit code, and leaves the process as it is: the caller decides whether to ``stop`` it.
        """
        if self._proc is None:
            raise RuntimeError(f"{self.spec.name}: wait_healthy before start")
        began = time.monotonic()
        deadline = began + timeout
        url = self.url + self.spec.health_path
        last_problem = "no answer yet"
        headers = {"Authorization": f"Bearer {self.spec.token}"} if self.spec.token else {}
        with httpx.Client(trust_env=False, headers=headers) as http:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise self._launch_error("{exit} before it became healthy", code)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._launch_error(f"not healthy after {timeout:.0f}s (last probe: {last_problem})", None)
                # the group's processes and shared memory, noted while it starts (a server that dies in its warm-up
                # never reaches the note at healthy, and its scheduler's files must be swept all the same)
                self._ledger.note(self._proc.pid)
                try:
                    response = http.get(url, timeout=max(0.1, min(remaining, _MAX_PROBE_S)))
                    if response.status_code == 200:
                        self._ledger.note(self._proc.pid)
                        took = time.monotonic() - began
                        logger.info("%s: healthy at %s after %.1fs", self.spec.name, self.url, took)
                        return took
                    last_problem = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    last_problem = type(exc).__name__
                # Waiting on the process (not sleeping) returns at once if it dies meanwhile.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=max(0.0, min(poll_interval, deadline - time.monotonic())))

    def _launch_error(self, what: str, exit_code: int | None) -> ServerLaunchError:
        """The error of a failed start; its first line names the server's own last error, when its log has one."""
        tail = self.log_tail()
        said = last_error_line(tail)
        if exit_code is not None:
            # with the server's own error in hand, the exit code is not guessed at ("out of memory?")
            exit_text = describe_exit(exit_code).split(" — ", 1)[0] if said else describe_exit(exit_code)
            what = what.format(exit=exit_text)
        if said:
            what += f": {said}"
        message = (
            f"{self.spec.name}: server {what}; url={self.url} log={self.spec.log_path}\n"
            f"--- last {LOG_TAIL_LINES} lines of the server log ---\n{tail or '(log is empty)'}"
        )
        return ServerLaunchError(
            message, name=self.spec.name, exit_code=exit_code, log_path=self.spec.log_path, log_tail=tail
        )

    def stop(self, grace_s: float | None = None) -> int | None:
        """Ask the server to shut down (SIGTERM to it alone), wait up to ``grace_s``, then SIGKILL its group.

        The signal goes to the server only (through the guard, which forwards it), never to its whole process
        group: SGLang's main process drains and stops its scheduler and detokenizer itself, while a scheduler
        that receives SIGTERM directly dies, and its parent then reads a crash (5 s of "crash diagnostics",
        then SIGKILL). ``grace_s`` defaults to the spec's ``stop_grace_s``. Afterwards the shared memory the
        server's processes made is removed. Idempotent: a stopped (or never started) server returns its exit
        code (or None) again.
        """
        grace_s = self.spec.stop_grace_s if grace_s is None else grace_s
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            if proc.poll() is None:
                self._ledger.note(proc.pid)
                began = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=max(0.0, grace_s))
                    logger.info("%s: server pid=%d stopped in %.1fs, exit code %s", self.spec.name, proc.pid,
                                time.monotonic() - began, proc.returncode)
                except subprocess.TimeoutExpired:
                    logger.warning("%s: server pid=%d still running %.1fs after SIGTERM; killing", self.spec.name,
                                   proc.pid, grace_s)
                    self._signal_group(signal.SIGKILL)
                    proc.wait()
            # Children the server forked may outlive it; they share its process group.
            self._signal_group(signal.SIGKILL)
            self._wait_group_gone()
            removed = self._ledger.sweep()
            if removed:
                logger.info("%s: removed %d shared-memory file(s) the server left: %s", self.spec.name,
                            len(removed), ", ".join(sorted(removed)))
            for path in self.spec.secret_files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return proc.returncode

    def _wait_group_gone(self, timeout_s: float = 5.0) -> None:
        """Until no process of the server's group is left (a SIGKILLed process still unmaps its memory)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while group_pids(self._proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)  # no event tells a process outside our children has gone; the poll is bounded

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)


# -- the built-in engine's command -----------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinOptions:
    """Tuning knobs of the built-in engine (``relax engine serve``); None leaves the server's default."""

    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    num_threads: int | None = None
    model_impl: str | None = None
    """``auto`` (the default), ``native`` or ``transformers``: see ``relax engine serve --help``."""
    load_format: str | None = None
    """``dummy``: random weights, no weight file read (a joining engine's first refit overwrites them)."""
    api_key: str | None = field(default=None, repr=False)
    """The engine's generation key (SGLang's ``--api-key``); passed in the environment, never in argv."""
    admin_api_key: str | None = field(default=None, repr=False)
    """The engine's control key (SGLang's ``--admin-api-key``); in the environment too."""


def builtin_command(
    model_path: str,
    host: str,
    port: int,
    max_running_requests: int | None = None,
    max_total_tokens: int | None = None,
    weight_version: int | str | None = None,
    num_threads: int | None = None,
    model_impl: str | None = None,
    load_format: str | None = None,
) -> list[str]:
    """argv of the built-in engine, run with this interpreter so it sees the same packages."""
    argv = [sys.executable, "-m", "relax.cli", "engine", "serve"]
    argv += ["--model-path", str(model_path), "--host", str(host), "--port", str(int(port))]
    optional = (
        ("--max-running-requests", max_running_requests),
        ("--max-total-tokens", max_total_tokens),
        ("--weight-version", weight_version),
        ("--num-threads", num_threads),
        ("--model-impl", model_impl),
        ("--load-format", load_format),
    )
    for flag, value in optional:
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _package_root() -> str:
    """The directory holding the ``relax`` package, so the server imports the same code as we do."""
    import relax

    return str(Path(relax.__file__).resolve().parent.parent)


def builtin_spec(
    model_path: str,
    host: str,
    port: int,
    log_path: str,
    *,
    weight_version: int | str | None = None,
    options: BuiltinOptions | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "engine",
) -> LaunchSpec:
    """LaunchSpec of the built-in engine.

    The package root is put first on ``PYTHONPATH`` because a source checkout that is not pip-installed
    is importable in a Ray worker (Ray adds the driver's directory to its ``sys.path``) but not in a fresh
    subprocess. ``PYTHONUNBUFFERED`` makes the log tail in launch errors current.
    """
    options = options or BuiltinOptions()
    argv = builtin_command(
        model_path,
        host,
        port,
        max_running_requests=options.max_running_requests,
        max_total_tokens=options.max_total_tokens,
        weight_version=weight_version,
        num_threads=options.num_threads,
        model_impl=options.model_impl,
        load_format=options.load_format,
    )
    inherited = os.environ.get("PYTHONPATH", "")
    merged_env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (_package_root(), inherited) if p),
    }
    if options.num_threads is not None:
        merged_env["OMP_NUM_THREADS"] = str(options.num_threads)
    merged_env.update(env or {})
    if options.api_key:
        merged_env[ENGINE_API_KEY_ENV] = options.api_key
    if options.admin_api_key:
        merged_env[ENGINE_ADMIN_API_KEY_ENV] = options.admin_api_key
    return LaunchSpec(argv=tuple(argv), host=host, port=int(port), log_path=str(log_path), env=merged_env, name=name,
                      token=options.api_key)


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600 from creation, never a moment wider)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(text)


def format_argv(argv: Sequence[str]) -> str:
    """A copy-pasteable shell line for logs, with secrets (``--api-key``) masked."""
    shown: list[str] = []
    for i, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        if flag in _SECRET_FLAGS and "=" in arg:
            arg = f"{flag}=***"
        elif i > 0 and argv[i - 1] in _SECRET_FLAGS:
            arg = "***"
        shown.append(shlex.quote(arg))
    return " ".join(shown)
