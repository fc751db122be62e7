"""The ControlPlane actor: serves :func:`relax.rollout.api.create_app` with uvicorn, inside Ray (DESIGN 2).

The actor holds no logic: it runs one uvicorn server as an asyncio task on its own event loop and hands
every route to a *backend*. In a run the backend is the RolloutManager actor, reached through
:class:`RayBackend`; :class:`LocalBackend` implements the same contract in-process over the pure modules
with simulated engines, for tests, demos and trying the CLI without a cluster.

Ray is imported lazily so that importing this module (for :class:`LocalBackend`, or by the CLI) stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import uvicorn

from relax.config.flags import PartialSuccessPolicy
from relax.rollout.api import Envelope, create_app, envelope, error_envelope, unwrap_envelope
from relax.rollout.api_models import DEFAULT_MODEL, CancelBatchBody, EnginesResponse, RequestError, parse_body
from relax.rollout.events import EventKind, EventLog
from relax.rollout.pool import EngineKind, EnginePool, EngineRecord, EngineState
from relax.rollout.scaling import (
    Direction,
    Noop,
    RejectedRequest,
    ScaleInPlan,
    ScaleInRequest,
    ScaleInStatus,
    ScaleKind,
    ScaleOutRequest,
    ScaleOutStatus,
    ScaleRequestRegistry,
    check_model_name,
    decide_partial_outcome,
)

log = logging.getLogger("relax.control_plane")

__all__ = ["ControlPlane", "LocalBackend", "RayBackend", "spawn_control_plane"]

_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


# -- the Ray adapter ----------------------------------------------------------------------------------


class RayBackend:
    """The backend contract over a RolloutManager actor handle: ``await handle.<method>.remote(...)``.

    It turns what can go wrong *between* the processes into envelopes, so the routes keep one code path:
    a dead or restarting manager is a 503, a call that takes longer than ``call_timeout_s`` a 504 (an HTTP
    client must not hang on a stuck actor), a ``RequestError`` raised remotely keeps its status, and any
    other remote exception is a 500 that names it.
    """

    def __init__(self, handle: Any, *, call_timeout_s: float = 30.0) -> None:
        self._handle = handle
        self._timeout = call_timeout_s

    async def _call(self, method: str, *args: Any) -> Envelope:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            ref = getattr(self._handle, method).remote(*args)
            result = await asyncio.wait_for(_await_ref(ref), timeout=self._timeout)
        except asyncio.TimeoutError:
            return envelope(504, {"detail": f"the rollout manager did not answer {method} within {self._timeout:g}s"})
        except (RayActorError, ActorUnavailableError) as exc:
            return envelope(503, {"detail": f"the rollout manager is unavailable: {_first_line(exc)}"})
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RequestError):
                return error_envelope(cause)
            log.error("rollout manager %s raised: %s", method, exc)
            shown = cause if cause is not None else exc
            detail = f"internal error in {method}: {type(shown).__name__}: {_first_line(shown)}"
            return envelope(500, {"detail": detail})
        status, body = unwrap_envelope(result)
        return envelope(status, body)

    async def engines_view(self, model_name: str | None) -> Envelope:
        return await self._call("engines_view", model_name)

    async def scale_out(self, body: dict[str, Any]) -> Envelope:
        return await self._call("scale_out", body)

    async def scale_in(self, body: dict[str, Any]) -> Envelope:
        return await self._call("scale_in", body)

    async def list_scale_requests(self, direction: str, status: str | None, model_name: str | None) -> Envelope:
        return await self._call("list_scale_requests", direction, status, model_name)

    async def get_scale_request(self, direction: str, request_id: str) -> Envelope:
        return await self._call("get_scale_request", direction, request_id)

    async def cancel_scale_out(self, request_id: str) -> Envelope:
        return await self._call("cancel_scale_out", request_id)

    async def cancel_scale_out_batch(self, body: dict[str, Any]) -> Envelope:
        return await self._call("cancel_scale_out_batch", body)

    async def events(self, limit: int, kind: str | None) -> Envelope:
        # The RolloutManager keeps its EventLog in ``self.events``, so its method is named ``events_view``;
        # ``events`` is accepted too for backends without that attribute clash.
        method = "events_view" if _has_method(self._handle, "events_view") else "events"
        return await self._call(method, limit, kind)

    async def relax_status(self) -> Envelope:
        return await self._call("relax_status")


def _has_method(handle: Any, name: str) -> bool:
    try:
        return callable(getattr(handle, name).remote)
    except AttributeError:
        return False


async def _await_ref(ref: Any) -> Any:
    return await ref


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# -- an in-process backend over the pure modules ---------------------------------------------------------


def _enveloped(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Envelope]]:
    """Answer a 200 with the method's result, or the status of the :class:`RequestError` it raised."""

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Envelope:
        try:
            return envelope(200, await method(*args, **kwargs))
        except RequestError as exc:
            return error_envelope(exc)

    return wrapper


_SCALE_EVENT_KINDS = frozenset(
    {
        EventKind.SCALE_OUT_REQUESTED,
        EventKind.SCALE_IN_REQUESTED,
        EventKind.SCALE_COMPLETED,
        EventKind.SCALE_FAILED,
        EventKind.SCALE_CANCELLED,
        EventKind.ENGINE_EVICTED,
        EventKind.ENGINE_FAILED,
        EventKind.ENGINE_RESTARTED,
    }
)
_BRING_UP = (EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING, EngineState.ACTIVE)


class LocalBackend:
    """The backend contract implemented in-process with simulated engines.

    Real rules, fake engines: requests go through :class:`~relax.rollout.scaling.ScaleRequestRegistry` and
    engines through :class:`~relax.rollout.pool.EnginePool`'s lifecycle, exactly as in the RolloutManager;
    only the work of each phase (placement, process start, health, weight sync, drain) is a pause of
    ``step_delay_s``. ``paused`` freezes every running request between two phases, which is how a test
    holds a scale-out open to see a 409 or a cancel. URLs in ``unreachable_urls`` fail their health check.
    Must be used (and :meth:`aclose`'d) on one event loop: the one serving the app.
    """

    def __init__(
        self,
        initial_engines: int = 2,
        *,
        step_delay_s: float = 0.0,
        partial_success_policy: PartialSuccessPolicy | str = PartialSuccessPolicy.ROLLBACK_ALL,
        scale_out_timeout_s: float = 300.0,
        max_engines: int | None = None,
        unreachable_urls: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.event_log = EventLog(clock)
        self.pool = EnginePool(clock, on_transition=self._on_transition)
        self.registry = ScaleRequestRegistry(clock)
        self.initial_count = initial_engines
        self.max_engines = max_engines
        self.step_delay_s = step_delay_s
        self.partial_success_policy = PartialSuccessPolicy(partial_success_policy)
        self.scale_out_timeout_s = scale_out_timeout_s
        self.unreachable_urls = set(unreachable_urls)
        self.paused = False
        self.training: dict[str, Any] = {
            "training_step": 0,
            "num_rollout": 0,
            "rollout_tokens_per_s": 0.0,
            "staleness_mean": 0.0,
            "trainer_wait_fraction": 0.0,
            "staleness_blocked_fraction": 0.0,
        }
        self._event_counts: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        for _ in range(initial_engines):
            record = self.pool.add(EngineKind.INITIAL, bundle="initial")
            self._assign_address(record)
            for state in _BRING_UP:
                self._advance_engine(record.engine_id, state)

    # -- helpers ------------------------------------------------------------------------------------

    def _event(self, kind: EventKind, message: str = "", **kwargs: Any) -> None:
        self.event_log.append(kind, message, **kwargs)
        if kind in _SCALE_EVENT_KINDS:
            self._event_counts[kind.value] += 1

    def _on_transition(self, record: EngineRecord, src: EngineState, dst: EngineState) -> None:
        kind = EventKind.ENGINE_FAILED if dst is EngineState.FAILED else EventKind.ENGINE_STATE
        message = f"{src.value} -> {dst.value}" + (f": {record.last_error}" if dst is EngineState.FAILED else "")
        self._event(kind, message, engine_ids=record.engine_id)

    def _assign_address(self, record: EngineRecord) -> None:
        if record.url is None:
            self.pool.set_url(record.engine_id, f"http://127.0.0.1:{30000 + record.number}")
        group = "stable" if record.kind is EngineKind.INITIAL else "elastic"
        self.pool.set_node_id(record.engine_id, f"node-{group}-{record.number}")

    def _advance_engine(self, engine_id: str, state: EngineState) -> None:
        if state is EngineState.ACTIVE:
            self.pool.set_weight_version(engine_id, 0)
        self.pool.transition(engine_id, state)

    async def _phase(self) -> None:
        await asyncio.sleep(self.step_delay_s)
        while self.paused:
            await asyncio.sleep(0.01)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, request: ScaleOutRequest | ScaleInRequest) -> dict[str, Any]:
        request.observe(self.pool)
        return request.to_dict()

    async def aclose(self) -> None:
        """Stop the simulated work of running requests (they stay where they are)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no scale request is running (tests)."""
        deadline = time.monotonic() + timeout_s
        while self.registry.running() is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.registry.running().request_id} still running after {timeout_s}s")
            await asyncio.sleep(0.01)

    # -- the contract -------------------------------------------------------------------------------

    @_enveloped
    async def engines_view(self, model_name: str | None) -> dict[str, Any]:
        if model_name is not None:
            check_model_name(model_name)
        view = EnginesResponse.from_records(self.pool.records(), model_name=model_name or DEFAULT_MODEL)
        return view.model_dump(mode="json")

    @_enveloped
    async def scale_out(self, body: dict[str, Any]) -> dict[str, Any]:
        outcome = self.registry.submit_scale_out(
            body, self.pool, initial_count=self.initial_count, max_engines=self.max_engines
        )
        if isinstance(outcome, Noop):
            return outcome.to_dict()
        assert isinstance(outcome, ScaleOutRequest)
        what = f"to {outcome.target} engines" if outcome.kind is ScaleKind.RAY_NATIVE else f"attach {len(outcome.urls)}"
        self._event(EventKind.SCALE_OUT_REQUESTED, f"scale out {what}", request_id=outcome.request_id)
        for number in range(outcome.to_create):
            if outcome.kind is ScaleKind.RAY_NATIVE:
                record = self.pool.add(EngineKind.ELASTIC, bundle=f"{outcome.request_id}-{number}")
            else:
                record = self.pool.add(EngineKind.EXTERNAL, url=outcome.urls[number])
            outcome.add_engine(record.engine_id, record.url)
        self._spawn(self._run_scale_out(outcome))
        return {"request_id": outcome.request_id, "status": ScaleOutStatus.PENDING.value}

    async def _run_scale_out(self, request: ScaleOutRequest) -> None:
        deadline = request.deadline(self.scale_out_timeout_s)
        for state in _BRING_UP:
            await self._phase()
            if request.cancel_requested:
                break
            timed_out = self.clock() > deadline
            for engine_id in request.engine_ids:
                record = self.pool.get(engine_id)
                if record.state.terminal:
                    continue
                if timed_out:
                    self.pool.transition(engine_id, EngineState.FAILED, error="scale-out timed out")
                elif state is EngineState.HEALTH_CHECKING and record.url in self.unreachable_urls:
                    self.pool.transition(engine_id, EngineState.FAILED, error=f"{record.url}: connection refused")
                else:
                    if state is EngineState.STARTING:
                        self._assign_address(record)
                    self._advance_engine(engine_id, state)
            request.observe(self.pool)
        if request.cancel_requested:  # sticky cancel: engines not yet ACTIVE go away, ACTIVE ones stay
            for record in request.rollback_candidates(self.pool):
                self.pool.transition(record.engine_id, EngineState.REMOVED)
            status, teardown = ScaleOutStatus.CANCELLED, []
        else:
            results = {e: self.pool.get(e).state for e in request.engine_ids}
            status, teardown = decide_partial_outcome(results, self.partial_success_policy)
        for engine_id in teardown:
            record = self.pool.get(engine_id)
            if record.state is EngineState.ACTIVE:
                self.pool.transition(engine_id, EngineState.DRAINING)
            if not record.state.terminal:
                self.pool.transition(engine_id, EngineState.REMOVED)
        request.observe(self.pool)
        errors = sorted({o.error for o in request.engines.values() if o.error})
        final = request.advance(status, error="; ".join(errors) or None)
        kind = {
            ScaleOutStatus.CANCELLED: EventKind.SCALE_CANCELLED,
            ScaleOutStatus.FAILED: EventKind.SCALE_FAILED,
        }.get(final, EventKind.SCALE_COMPLETED)
        self._event(kind, f"scale-out {final.value}", request_id=request.request_id, engine_ids=request.engine_ids)

    @_enveloped
    async def scale_in(self, body: dict[str, Any]) -> dict[str, Any]:
        outcome = self.registry.submit_scale_in(body, self.pool, initial_count=self.initial_count)
        if isinstance(outcome, Noop | ScaleInPlan):
            return outcome.to_dict()
        assert isinstance(outcome, ScaleInRequest)
        self._event(
            EventKind.SCALE_IN_REQUESTED,
            f"scale in to {outcome.target} engines" if outcome.target is not None else "scale in by URL",
            request_id=outcome.request_id,
            engine_ids=outcome.victim_ids,
        )
        self._spawn(self._run_scale_in(outcome))
        return {"request_id": outcome.request_id, "status": ScaleInStatus.PENDING.value}

    async def _run_scale_in(self, request: ScaleInRequest) -> None:
        await self._phase()
        for engine_id in request.victim_ids:
            self.pool.transition(engine_id, EngineState.DRAINING)
        request.advance(ScaleInStatus.DRAINING)
        await self._phase()
        for engine_id in request.victim_ids:
            request.note_drained(engine_id)
        request.advance(ScaleInStatus.REMOVING)
        await self._phase()
        for engine_id in request.victim_ids:
            self.pool.transition(engine_id, EngineState.REMOVED)
        request.observe(self.pool)
        request.advance(ScaleInStatus.COMPLETED)
        self._event(EventKind.SCALE_COMPLETED, "scale-in COMPLETED", request_id=request.request_id)

    @_enveloped
    async def list_scale_requests(self, direction: str, status: str | None, model_name: str | None) -> list[Any]:
        requests = self.registry.list_requests(Direction(direction), status=status, model_name=model_name)
        return [self._record(r) for r in requests]

    @_enveloped
    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return self._record(self.registry.get(request_id, Direction(direction)))

    @_enveloped
    async def cancel_scale_out(self, request_id: str) -> dict[str, Any]:
        request = self.registry.cancel(request_id)
        return self._record(request)

    @_enveloped
    async def cancel_scale_out_batch(self, body: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_body(CancelBatchBody, body)
        return self.registry.cancel_batch(parsed.status_filter, dry_run=parsed.dry_run).to_dict()

    @_enveloped
    async def events(self, limit: int, kind: str | None) -> dict[str, Any]:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise RejectedRequest(f"limit: must be an integer >= 0, got {limit!r}", field="limit")
        if kind is not None and kind not in {k.value for k in EventKind}:
            allowed = ", ".join(k.value for k in EventKind)
            raise RejectedRequest(f"kind: unknown event kind {kind!r} (allowed: {allowed})", field="kind")
        return self.event_log.to_dict(limit, kind)

    @_enveloped
    async def relax_status(self) -> dict[str, Any]:
        version = self.pool.min_active_weight_version()
        return {
            "engines_by_state": {state.value: n for state, n in self.pool.counts().items()},
            "active_engines": len(self.pool.active()),
            "engine_weight_version": -1 if version is None else version,
            "scale_events_total": dict(self._event_counts),
            "initial_engines": self.initial_count,
            "scale_request_running": (r.request_id if (r := self.registry.running()) else None),
            **self.training,
        }


# -- the server ----------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the actor (or the driver) owns SIGTERM/SIGINT.

    uvicorn installs handlers when it runs on the main thread and re-raises captured signals on exit; inside
    a Ray worker or a test process that would steal the process's own graceful-stop path.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket here, not in uvicorn, so a busy port is an exception we can word (uvicorn
    would ``sys.exit``) and ``port=0`` gives us the port the OS picked before the server starts."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise RuntimeError(f"control plane: cannot resolve --api-host {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"control plane cannot listen on {host}:{port}: {exc.strerror or exc}; "
            "pick another --api-port (or --api-host)"
        ) from None
    return sock


def _url_host(host: str) -> str:
    """The host to put in the URL: a wildcard bind is advertised by the node's IP (reachable from elsewhere)."""
    if host in _WILDCARD_HOSTS:
        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:
            host = "127.0.0.1"
    with contextlib.suppress(ValueError):
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    return host


def _connect_host(host: str) -> str:
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn's way to report a failed start-up; must not leave the event loop
        raise RuntimeError(f"uvicorn exited with status {exc.code}") from None


class ControlPlane:
    """Serves the control plane's HTTP app on ``host:port`` as an asyncio task of the current event loop.

    As a Ray actor (see :func:`spawn_control_plane`), ``backend`` is the RolloutManager's handle and is
    wrapped in :class:`RayBackend`; in-process it may be any backend object. ``autoscaler_factory`` runs on
    the serving loop at :meth:`start` and returns what :func:`~relax.rollout.api.create_app` mounts under
    ``/autoscaler``: a factory rather than an object because an autoscaler with live asyncio tasks cannot
    be pickled into the actor.
    """

    def __init__(
        self,
        backend: Any,
        host: str = "127.0.0.1",
        port: int = 8000,
        token: str | None = None,
        *,
        autoscaler: Any | None = None,
        autoscaler_factory: Callable[[], Any] | None = None,
        call_timeout_s: float = 30.0,
    ) -> None:
        if autoscaler is not None and autoscaler_factory is not None:
            raise ValueError("give autoscaler or autoscaler_factory, not both")
        if _is_actor_handle(backend):
            backend = RayBackend(backend, call_timeout_s=call_timeout_s)
        self._backend = backend
        self._host = host
        self._port = port
        self._token = token or None
        self._autoscaler = autoscaler
        self._autoscaler_factory = autoscaler_factory
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._url: str | None = None

    async def start(self, timeout_s: float = 30.0) -> str:
        """Start serving and return the base URL once the socket accepts connections (idempotent)."""
        if self._task is not None and not self._task.done():
            assert self._url is not None
            return self._url
        autoscaler = self._autoscaler_factory() if self._autoscaler_factory is not None else self._autoscaler
        app = create_app(self._backend, token=self._token, autoscaler=autoscaler)
        sock = _bind(self._host, self._port)
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            host=self._host,
            port=port,
            log_level="warning",
            log_config=None,  # keep the process's own logging setup (relax.logs); uvicorn's would replace it
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=3,
        )
        server = _Server(config)
        task = asyncio.get_running_loop().create_task(_serve(server, sock))
        deadline = time.monotonic() + timeout_s
        try:
            while not server.started:
                if task.done():
                    task.result()  # raises the start-up error
                    raise RuntimeError("the control plane server stopped during start-up")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the control plane did not start within {timeout_s:g}s")
                await asyncio.sleep(0.01)
            await _wait_accepting(_connect_host(self._host), port, deadline)
        except BaseException:
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, timeout=5)
            sock.close()
            raise
        self._server, self._task = server, task
        self._url = f"http://{_url_host(self._host)}:{port}"
        log.info("control plane serving on %s (auth %s)", self._url, "on" if self._token else "off")
        return self._url

    async def url(self) -> str | None:
        """The base URL while serving, else ``None``."""
        return self._url if self._task is not None and not self._task.done() else None

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving: finish in-flight requests for up to ``timeout_s``, then cut the rest."""
        server, task = self._server, self._task
        self._server = self._task = None
        self._url = None
        if server is None or task is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=timeout_s)
        except asyncio.TimeoutError:
            server.force_exit = True
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        except Exception as exc:
            log.warning("control plane server ended with %r", exc)


async def _wait_accepting(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


def _is_actor_handle(obj: Any) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a dependency, but the check must not require it
        return False
    return isinstance(obj, ActorHandle)


def spawn_control_plane(
    backend_handle: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    resources: dict[str, float] | None = None,
    *,
    autoscaler_factory: Callable[[], Any] | None = None,
    name: str | None = None,
    start_timeout_s: float = 60.0,
) -> tuple[Any, str]:
    """Create the ControlPlane actor, start its server, and return ``(actor, url)``.

    ``num_cpus=0``: serving a handful of operator requests must never take a CPU a bundle needs.
    ``resources`` carries the node-group marker (``{"<G>_cpu": 0.01}``) that pins the control plane to the
    stable group when affinity is on, so a reclaimed elastic node never takes the API down. On a start-up
    failure (port in use...) the actor is killed and the error re-raised with its message.
    """
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
    if resources:
        options["resources"] = dict(resources)
    if name is not None:
        options["name"] = name
    actor = (
        ray.remote(ControlPlane)
        .options(**options)
        .remote(backend_handle, host, port, token, autoscaler_factory=autoscaler_factory)
    )
    try:
        url = ray.get(actor.start.remote(), timeout=start_timeout_s)
    except BaseException as exc:
        ray.kill(actor, no_restart=True)
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise RuntimeError(str(cause)) from None
        raise
    return actor, url
