"""A FastAPI app served by uvicorn on 127.0.0.1 in a background thread: real HTTP for tests.

Several tests need a small real server (an engine double, a metrics endpoint, a dashboard stand-in); this is
the one way they start and stop it, so every one of them waits for the socket instead of sleeping and ends
its thread on exit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

from relax.cluster.network import free_port


class LoopbackServer:
    """``with LoopbackServer(app) as server: httpx.get(server.url + "/path")``.

    ``port``: a port chosen beforehand, for apps that must know their own address when built.
    ``loop``: run the server on this event loop instead of a fresh one, for apps whose backends must be
    driven on the server's loop (``asyncio.run_coroutine_threadsafe(coro, server.loop)``).
    ``force_exit``: on exit, do not wait for requests still in flight (deliberately slow endpoints).
    """

    def __init__(self, app: Any, *, port: int | None = None, loop: asyncio.AbstractEventLoop | None = None,
                 force_exit: bool = True, lifespan: str = "auto", name: str = "loopback-server",
                 start_timeout: float = 20.0) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = loop
        self.force_exit = force_exit
        self.start_timeout = start_timeout
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan=lifespan))
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        if self.loop is None:
            self.server.run()
            return
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"{self.thread.name} exited before serving on {self.url}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.thread.name} did not serve on {self.url} within {self.start_timeout:g}s")
            self.thread.join(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = self.force_exit
        self.thread.join(timeout=10)

    def __enter__(self) -> LoopbackServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
