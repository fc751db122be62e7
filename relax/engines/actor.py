"""EngineActor: one Ray actor per inference engine, owning that engine's server process.

The actor is deliberately thin. It picks a port on its node, builds the backend's :class:`LaunchSpec`,
starts the server through the shared :class:`ServerProcess`, waits for health and reports where the
engine lives. Everything about *which* engines exist and what state they are in belongs to the
RolloutManager; weight loading goes over HTTP (``EngineClient.update_weights_from_disk``).

Threading model: the actor runs with ``max_concurrency > 1`` so that ``is_alive``/``shutdown`` answer
while a slow ``start`` is waiting for health (a scale-out cancel must be able to stop a starting engine).
Its ``__init__`` runs on the worker's main thread, which is where the SIGTERM hook must be installed.

Eviction hook (docs/architecture.md, "Placement and eviction"). When the platform SIGTERMs the actor
(node reclaimed, pod evicted):

* with an ``on_eviction`` callback: the actor records the eviction time, calls the callback with its
  engine id from a helper thread (never from inside the signal handler) and keeps serving, so in-flight
  requests can finish. Draining, shutdown and placement-group removal are the caller's job. A *second*
  SIGTERM means "now": the server is stopped and the worker exits.
* without a callback: the server is stopped and the worker exits as Ray's own handler would.

The callback is an actor method or remote function (``rollout_manager.notify_eviction``, called with
``.remote(engine_id)``), a pair ``(actor_handle, "method_name")`` meaning the same, or a plain callable
``f(engine_id)`` run inside the actor (a returned coroutine is run to completion).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.cluster.network import LOCALHOST, free_port, node_ip
from relax.engines.backends import Prepared, cuda_available, engine_backend
from relax.engines.client import EngineClient, PauseWindow
from relax.engines.guard import describe_exit
from relax.engines.launcher import (
    BuiltinOptions,
    LaunchSpec,
    ServerLaunchError,
    ServerProcess,
)
from relax.engines.sglang import SGLangOptions
from relax.engines.weight_load import CONTROL_TIMEOUT_S, load_from_disk
from relax.logs import setup_logging
from relax.weights.pause_mode import PauseMode

logger = logging.getLogger(__name__)

EvictionCallback = Callable[[str], Any] | tuple[Any, str]

DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_LOG_DIR = os.path.join(tempfile.gettempdir(), "relax", "engines")
# A port picked by free_port can be taken by someone else before the server binds it.
_PORT_RETRIES = 2


#: How an engine is paused around a weight load (SGLang's /pause_generation modes), or "none".
def copy_checkpoint_extras(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy every file of a checkpoint that is not a weight file (tokenizer, chat template, ...) if missing.

    A server started from a published version needs the tokenizer the base checkpoint carries.
    """
    weight_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
    copied = []
    for path in sorted(Path(src_dir).iterdir()):
        target = Path(dst_dir) / path.name
        if path.is_file() and not path.name.endswith(weight_suffixes) and not path.name.endswith(".index.json") \
                and not target.exists():
            shutil.copy2(path, target)
            copied.append(path.name)
    return copied


async def _load_into(url: str, options: Any, out_dir: Path, version: int, mode: PauseMode,
                     nbytes: int) -> PauseWindow:
    async with EngineClient(url, timeout=CONTROL_TIMEOUT_S, token=getattr(options, "api_key", None),
                            admin_token=getattr(options, "admin_api_key", None)) as client:
        return await load_from_disk(client, out_dir, version, mode, nbytes=nbytes)


def build_launch_spec(
    backend: str,
    engine_id: str,
    model_path: str,
    host: str,
    port: int,
    log_path: str,
    *,
    weight_version: int | str | None = None,
    options: BuiltinOptions | SGLangOptions | None = None,
    env: Mapping[str, str] | None = None,
    nccl_port: int | None = None,
) -> LaunchSpec:
    """The backend adapter's pure command builder (``relax.engines.backends``)."""
    adapter = engine_backend(backend)
    if options is not None and not isinstance(options, adapter.options_type):
        raise TypeError(f"{backend} backend takes {adapter.options_type.__name__}, got {type(options).__name__}")
    return adapter.launch_spec(engine_id, model_path, host, port, log_path, weight_version=weight_version,
                               options=options, env=env or {}, nccl_port=nccl_port)


def resolve_host(host: str) -> str:
    """``"node"`` means this node's IP (reachable from other nodes); anything else is used as given."""
    return node_ip() if host == "node" else host


def _valid_callback(callback: Any) -> bool:
    pair = isinstance(callback, tuple) and len(callback) == 2 and isinstance(callback[1], str)
    return callable(callback) or pair


class EngineActor:
    """Owns one engine server process. Create it with :func:`spawn_engine_actor`."""

    def __init__(
        self,
        engine_id: str,
        backend: str,
        model_path: str,
        *,
        host: str = LOCALHOST,
        weight_version: int | str | None = None,
        options: BuiltinOptions | SGLangOptions | None = None,
        log_dir: str | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        on_eviction: EvictionCallback | None = None,
    ) -> None:
        engine_backend(backend)  # an unknown name fails here, in one line
        if on_eviction is not None and not _valid_callback(on_eviction):
            raise TypeError("on_eviction must be a callable or an (actor_handle, method_name) pair")
        setup_logging()
        self.engine_id = engine_id
        self.backend = backend
        self.model_path = str(model_path)  # the run's checkpoint: config and tokenizer files come from here
        self._serve_path = self.model_path  # what the server starts from (the latest version, when one exists)
        self.host = host
        self.weight_version = weight_version
        self.options = options
        self.log_dir = log_dir or DEFAULT_LOG_DIR
        self.startup_timeout_s = float(startup_timeout_s)
        self.env = dict(env or {})
        self._on_eviction = on_eviction
        self._server: ServerProcess | None = None
        self._prepared: Prepared | None = None  # the backend's options and env on this node (relax.engines.backends)
        self._info: dict[str, Any] | None = None
        self._lock = threading.Lock()  # guards _server / _shutting_down against shutdown()
        self._start_lock = threading.Lock()  # one start at a time
        self._shutting_down = False
        self._evicted_at: float | None = None
        self._previous_sigterm: Any = None
        self._install_sigterm_hook()
        atexit.register(self._stop_quietly)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, initial_weights: tuple[int, list[Any]] | None = None,
              dummy_weights: bool = False) -> dict[str, Any]:
        """Start the server and wait until it is healthy; returns ``{engine_id, url, node_id, pid, ...}``.

        ``initial_weights`` (version, bucket refs): the newest published version. The server then starts
        from it — pulled and written to this node's shared memory first — instead of loading the base
        checkpoint and reloading the latest right after (two loads, and for a moment an engine serving
        version 0). Calling it again (even concurrently) returns the same info. On failure the server is
        stopped and a :class:`ServerLaunchError` quoting the server log is raised.

        ``dummy_weights``: the server starts with random weights and reads no weight file (``--load-format
        dummy``): a joining engine whose first refit sends every tensor, and which is routed only once that refit
        is verified (``rollout.fleet.lifecycle``).
        """
        with self._start_lock:
            if self._info is not None:
                return dict(self._info)
            if self._shutting_down:
                raise RuntimeError(f"{self.engine_id}: start after shutdown")
            began = time.monotonic()
            # on this node: SGLang's version (one clear line, not a server that never comes up), its CPU platform
            self._prepared = engine_backend(self.backend).prepare(self.options, self.model_path, self.env,
                                                                  cuda=cuda_available())
            if self._prepared.summary:
                logger.info("%s: %s", self.engine_id, self._prepared.summary)
            if initial_weights is not None:
                self._prepare_start_from(*initial_weights)
            elif dummy_weights and hasattr(self._prepared.options, "load_format"):
                self._prepared.options = replace(self._prepared.options, load_format="dummy")
            server, healthy_after = self._launch_until_healthy(resolve_host(self.host))
            info = {
                "engine_id": self.engine_id,
                "backend": self.backend,
                "url": server.url,
                "host": server.spec.host,
                "port": server.spec.port,
                "node_id": self.node_id(),
                "pid": server.pid,
                "actor_pid": os.getpid(),
                "log_path": server.spec.log_path,
                "startup_s": round(time.monotonic() - began, 3),
                "weight_version": int(self.weight_version or 0),
                "model_path": self._serve_path,
                "healthy_after_s": round(healthy_after, 3),
                "platform": self._prepared.summary,
                "load_format": getattr(self._prepared.options, "load_format", None) or "auto",
            }
            self._info = info
        logger.info("%s: ready url=%s node=%s pid=%s", self.engine_id, info["url"], info["node_id"], info["pid"])
        return dict(info)

    def _launch_until_healthy(self, host: str) -> tuple[ServerProcess, float]:
        """Launch and wait for health, on a fresh port if the picked one was taken meanwhile."""
        for attempt in range(_PORT_RETRIES + 1):
            server = self._launch(host)
            try:
                return server, server.wait_healthy(self.startup_timeout_s)
            except ServerLaunchError as exc:
                server.stop()
                if self._shutting_down:
                    raise RuntimeError(f"{self.engine_id}: shut down while starting") from exc
                if attempt < _PORT_RETRIES and exc.port_was_taken:
                    logger.warning("%s: port %d was taken, retrying on another", self.engine_id, server.spec.port)
                    continue
                logger.error("%s: launch failed (exit code %s)", self.engine_id, exc.exit_code)
                raise
            except BaseException:
                server.stop()  # never leave a half-started server behind
                raise
        raise AssertionError("unreachable")

    def _launch(self, host: str) -> ServerProcess:
        port = free_port(host)
        nccl_port = free_port(host) if engine_backend(self.backend).needs_nccl_port else None
        log_path = str(Path(self.log_dir) / f"{self.engine_id}-{port}.log")
        prepared = self._prepared or Prepared(self.options, dict(self.env))
        spec = build_launch_spec(
            self.backend,
            self.engine_id,
            self._serve_path,
            host,
            port,
            log_path,
            weight_version=self.weight_version,
            options=prepared.options,
            env=prepared.env,
            nccl_port=nccl_port,
        )
        server = ServerProcess(spec)
        with self._lock:
            if self._shutting_down:
                raise RuntimeError(f"{self.engine_id}: shut down while starting")
            self._server = server
            server.start()
        return server

    def shutdown(self, grace_s: float | None = None) -> int | None:
        """Stop the server (its own graceful shutdown, then SIGKILL after ``grace_s``); idempotent.

        Returns the server's exit code (None if it was never started). The actor itself stays up so the
        caller can still read ``log_tail``; ``ray.kill`` it afterwards.
        """
        with self._lock:
            self._shutting_down = True
            server = self._server
        if server is None:
            return None
        code = server.stop(grace_s)
        logger.info("%s: shut down, server exit code %s", self.engine_id, code)
        self._drop_scratch()
        if self._prepared is not None:
            self._prepared.release()
        return code

    def _drop_scratch(self) -> None:
        """This engine's weight copies go with it; the run's scratch directory goes with its last user."""
        from relax.cluster import scratch

        for root in scratch.held():
            shutil.rmtree(root / "weights" / self.engine_id, ignore_errors=True)
        scratch.release()

    def __ray_shutdown__(self) -> None:
        """Ray calls this on graceful actor exit: never leave a server behind."""
        self._stop_quietly()

    def __del__(self) -> None:
        self._stop_quietly()

    def _stop_quietly(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None and server.alive:
            with contextlib.suppress(Exception):  # best effort, possibly during interpreter teardown
                server.stop()

    # -- queries ----------------------------------------------------------------------------------

    def sync_weights(self, version: int, bucket_refs: list[Any],
                     pause_mode: PauseMode | str = PauseMode.RETRACT) -> dict[str, Any]:
        """Pull weight version `version` from the object store and load it into the server.

        (docs/architecture.md, "Weights and staleness".)

        The buckets are written as safetensors under local shared memory on this node, then loaded with
        ``relax.engines.weight_load.load_from_disk`` (paused with ``pause_mode``, the one bracket every weight
        path uses): one path for SGLang and the built-in engine. Time limits grow with the bytes moved.
        Returns timings for the publication metrics.
        """
        from relax.cluster.scratch import weights_root
        from relax.weights.buckets import cleanup_old, materialize

        mode = PauseMode(pause_mode)
        if self._server is None or not self._server.alive:
            raise RuntimeError(f"{self.engine_id}: cannot sync weights, the server is not running")
        began = time.monotonic()
        buckets = ray.get(list(bucket_refs))
        pulled = time.monotonic()
        nbytes = sum(t.numel() * t.element_size() for bucket in buckets for t in bucket.values())
        root = weights_root(self.engine_id)
        out_dir = materialize(buckets, self.model_path, root / f"v{version}")
        written = time.monotonic()
        # asyncio.run on this pool thread: the actor stays a threaded one (an async method would make Ray run
        # every method on one event loop, behind a load)
        window = asyncio.run(_load_into(self._server.url, self.options, out_dir, version, mode, nbytes))
        loaded = time.monotonic()
        cleanup_old(root, keep=1)
        self.weight_version = version
        logger.info("%s: weights v%d loaded, %.1f MiB (pull %.2fs, write %.2fs, load %.2fs, paused %.2fs, mode %s)",
                    self.engine_id, version, nbytes / 2**20, pulled - began, written - pulled, loaded - written,
                    window.seconds, mode.value)
        return {"engine_id": self.engine_id, "version": version, "bytes": nbytes, "pull_s": pulled - began,
                "write_s": written - pulled, "load_s": loaded - written, "paused_s": window.seconds,
                "path": "object-store"}

    def _prepare_start_from(self, version: int, bucket_refs: list[Any]) -> None:
        """Write version ``version`` as a complete checkpoint (weights + the run's config and tokenizer files)."""
        from relax.cluster.scratch import weights_root
        from relax.weights.buckets import materialize

        began = time.monotonic()
        out_dir = materialize(ray.get(list(bucket_refs)), self.model_path, weights_root(self.engine_id)
                              / f"v{version}")
        copy_checkpoint_extras(self.model_path, out_dir)
        self._serve_path = str(out_dir)
        self.weight_version = version
        logger.info("%s: starts from weights v%d (%s, prepared in %.2fs)", self.engine_id, version, out_dir,
                    time.monotonic() - began)

    def info(self) -> dict[str, Any] | None:
        """What ``start`` returned, or None before the engine is ready; once the server has exited, ``exit``
        says how (``was killed by SIGKILL (signal 9) — out of memory?``), for the failure's event."""
        if self._info is None:
            return None
        server, info = self._server, dict(self._info)
        code = None if server is None else server.returncode
        if code is not None:
            info["exit"] = describe_exit(code)
        return info

    def url(self) -> str | None:
        return None if self._info is None else self._info["url"]

    def node_id(self) -> str | None:
        """The Ray node this actor (and so its server) runs on; None outside Ray."""
        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int | None:
        server = self._server
        return None if server is None else server.pid

    def is_alive(self) -> bool:
        """True while the server process runs (not a health check: use ``EngineClient`` for that)."""
        server = self._server
        return server is not None and server.alive

    def log_tail(self, lines: int = 40) -> str:
        server = self._server
        return "" if server is None else server.log_tail(lines)

    # -- eviction ---------------------------------------------------------------------------------

    def _install_sigterm_hook(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("%s: not on the main thread; SIGTERM eviction hook not installed", self.engine_id)
            return
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Runs on the main thread between bytecodes. The first notice only records and hands off to a
        # thread (a Ray call or a lock taken here could deadlock with what the main thread was doing).
        first = self._evicted_at is None
        if first:
            self._evicted_at = time.time()
        if first and self._on_eviction is not None:
            threading.Thread(target=self._notify_eviction, name=f"{self.engine_id}-eviction", daemon=True).start()
            return
        self._stop_quietly()
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def _notify_eviction(self) -> None:
        logger.warning("%s: SIGTERM received (eviction); notifying", self.engine_id)
        callback = self._on_eviction
        try:
            if hasattr(callback, "remote"):  # an actor method or remote function: manager.notify_eviction
                ray.get(callback.remote(self.engine_id), timeout=30)  # type: ignore[union-attr]
            elif callable(callback):
                result = callback(self.engine_id)
                if inspect.isawaitable(result):
                    asyncio.run(_await(result))
            else:
                handle, method = callback  # type: ignore[misc]
                ray.get(getattr(handle, method).remote(self.engine_id), timeout=30)
        except Exception:
            logger.exception("%s: eviction callback failed", self.engine_id)


async def _await(awaitable: Any) -> Any:
    return await awaitable


# The Ray actor class. Declaring it needs no running cluster; only ``.remote()`` does.
EngineActorRemote = ray.remote(EngineActor)


def spawn_engine_actor(
    engine_id: str,
    backend: str,
    model_path: str,
    *,
    placement_group: Any = None,
    bundle_index: int | None = None,
    num_gpus: float = 1,
    num_cpus: float = 1,
    resources: Mapping[str, float] | None = None,
    name: str | None = None,
    namespace: str | None = None,
    max_concurrency: int = 4,
    runtime_env: Mapping[str, Any] | None = None,
    **engine_kwargs: Any,
) -> Any:
    """Create an :class:`EngineActor` (not yet started: call ``start.remote()``); returns its handle.

    In a placement group the actor takes ``num_gpus``/``num_cpus`` from bundle ``bundle_index``, so Ray
    sets ``CUDA_VISIBLE_DEVICES`` to that bundle's GPU and the server subprocess inherits it.
    ``engine_kwargs`` go to :class:`EngineActor` (host, weight_version, options, log_dir,
    startup_timeout_s, env, on_eviction).
    """
    options: dict[str, Any] = {
        "num_gpus": num_gpus,
        "num_cpus": num_cpus,
        "max_concurrency": max_concurrency,
        "max_restarts": 0,
    }
    if resources:
        options["resources"] = dict(resources)
    if name is not None:
        options["name"] = name
    if namespace is not None:
        options["namespace"] = namespace
    if runtime_env is not None:
        options["runtime_env"] = dict(runtime_env)
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=-1 if bundle_index is None else bundle_index,
            placement_group_capture_child_tasks=False,
        )
    elif bundle_index is not None:
        raise ValueError("bundle_index given without a placement_group")
    return EngineActorRemote.options(**options).remote(engine_id, backend, model_path, **engine_kwargs)
