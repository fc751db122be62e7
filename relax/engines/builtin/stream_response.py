"""Sending a stream to its client, and giving up on a client that stopped reading (``stream_stall``).

Every write of a streamed ``/generate`` may wait for the client at most the server's stall bound. A write that
waits longer ends the stream: ``on_stall`` aborts what the stream's requests still had to generate and logs
it, the stream's events are closed (which gives its slot in the engine's update lock back), and the
connection is closed at once.

*At once* needs the connection itself. ASGI lets an application end a response only by returning without
finishing it, and the server then closes the connection gracefully: it first sends what it has buffered,
which to a client that does not read takes forever — the socket, its buffers and the server's transport
stay. :func:`expose_connection_abort` wraps the server's application (outermost, where uvicorn calls it) and
puts an ``abort`` for the request's connection into the scope's extensions; a stalled stream uses it to reset
the connection (``SO_LINGER`` 0: the unsent bytes are dropped, the client sees a reset). Under a server that
does not offer it (the extension is absent) the stream is ended the ASGI way.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relax.engines.builtin.stream_stall import StallBound

__all__ = ["CONNECTION_EXTENSION", "ClientWaits", "StallGuardedStream", "expose_connection_abort"]

#: ``scope["extensions"][CONNECTION_EXTENSION]["abort"]``: resets the request's connection.
CONNECTION_EXTENSION = "relax.connection"
#: How long a stalled stream waits for the server to see its reset connection go (it does on the next turn of
#: the event loop), so the server does not report a response its application left unfinished.
DISCONNECT_GRACE_S = 1.0


@dataclass
class ClientWaits:
    """What the server's streaming clients cost it (``/server_info``), counted by their responses.

    A write to a client with room in its buffers completes at once, so ``waiting`` is, to within an instant, the
    number of streams whose client is not reading what it is sent.
    """

    waiting: int = 0  # writes waiting for their client now
    stalled: int = 0  # streams given up on since the server started


def _reset(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already gone: abort() is all there is left to do
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def expose_connection_abort(app: ASGIApp) -> ASGIApp:
    """``app`` with an ``abort`` of each HTTP request's connection in ``scope["extensions"]``.

    uvicorn's ``send`` is a method of the request's cycle, which holds the connection's transport (its h11 and
    httptools implementations alike); anything else gets no extension.
    """

    async def with_connection_abort(scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and isinstance(transport, asyncio.BaseTransport):
            extensions = scope.setdefault("extensions", {})
            extensions[CONNECTION_EXTENSION] = {"abort": lambda: _reset(transport)}
        await app(scope, receive, send)

    return with_connection_abort


class StallGuardedStream(StreamingResponse):
    """A streaming response each of whose writes may wait for the client at most ``bound``.

    ``on_stall(waited_s)`` runs when one did not complete in time (shielded: the stream is being torn down),
    before the events are closed and the connection reset. The events are closed when the response ends in any
    way (their ``finally`` aborts what a client that hung up left unfinished), not whenever the generator
    happens to be collected.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], bound: StallBound,
                 on_stall: Callable[[float], Awaitable[None]], *, media_type: str,
                 waits: ClientWaits | None = None) -> None:
        super().__init__(events, media_type=media_type)
        self._events = events
        self._bound = bound
        self._waits = waits if waits is not None else ClientWaits()
        self._on_stall = on_stall
        self._abort_connection: Callable[[], None] | None = None
        self._receive: Receive | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection: dict[str, Any] = scope.get("extensions", {}).get(CONNECTION_EXTENSION, {})
        self._abort_connection = connection.get("abort")
        self._receive = receive
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()

    async def stream_response(self, send: Send) -> None:
        if not await self._write(send, {"type": "http.response.start", "status": self.status_code,
                                        "headers": self.raw_headers}):
            return
        async for chunk in self.body_iterator:
            if not await self._write(send, {"type": "http.response.body", "body": chunk, "more_body": True}):
                return
        await self._write(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _write(self, send: Send, message: Message) -> bool:
        """Send ``message``; False (and the stream given up on) when the client left it waiting too long."""
        since = anyio.current_time()  # the clock of the deadline below
        deadline = self._bound.deadline(since)
        self._waits.waiting += 1
        try:
            with anyio.CancelScope(deadline=float("inf") if deadline is None else deadline) as waiting:
                await send(message)
        finally:
            self._waits.waiting -= 1
        if not waiting.cancelled_caught:
            return True
        self._waits.stalled += 1
        await self._give_up(anyio.current_time() - since)
        return False

    async def _give_up(self, waited_s: float) -> None:
        with anyio.CancelScope(shield=True):
            await self._on_stall(waited_s)
            await self._events.aclose()
        if self._abort_connection is None or self._receive is None:
            return  # the server closes the connection its own way
        self._abort_connection()
        with anyio.move_on_after(DISCONNECT_GRACE_S):
            while (await self._receive())["type"] != "http.disconnect":
                pass
