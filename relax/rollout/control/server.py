"""The ControlPlane actor: serves :func:`relax.rollout.control.api.create_app` with uvicorn, inside Ray.

The actor holds no logic: it runs one uvicorn server as an asyncio task on its own event loop and hands
every route to a *backend*. In a run the backend is the RolloutManager actor, reached through the one
:class:`~relax.rollout.control.manager_client.ManagerClient`; in-process any object with the same methods works
(``relax.testing.local_rollout.LocalRollout`` in tests and for trying the CLI without a cluster).

Ray is imported lazily so that importing this module (by the CLI, or in tests) stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from relax.rollout.control.api import create_app
from relax.rollout.control.manager_client import ManagerClient

log = logging.getLogger("relax.control_plane")

__all__ = ["ControlPlane", "spawn_control_plane"]

_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


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
    wrapped in a :class:`~relax.rollout.control.manager_client.ManagerClient`; in-process it may be any backend
    object. ``autoscaler_factory`` runs on
    the serving loop at :meth:`start` and returns what :func:`~relax.rollout.control.api.create_app` mounts under
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
            backend = ManagerClient(backend, call_timeout_s=call_timeout_s)
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
        # the bound address, not the flag: a name (``localhost``) is advertised as the address it resolved to
        bound = self._host if self._host in _WILDCARD_HOSTS else str(sock.getsockname()[0])
        self._url = f"http://{_url_host(bound)}:{port}"
        log.info("control plane serving on %s (auth %s)", self._url, "on" if self._token else "off")
        return self._url

    async def url(self) -> str | None:
        """The base URL while serving, else ``None``."""
        return self._url if self._task is not None and not self._task.done() else None

    async def node_ip(self) -> str:
        """The IP of the node serving: a token lookup written on another node would name the wrong machine."""
        import ray

        return str(ray.util.get_node_ip_address())

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
