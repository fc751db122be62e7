"""A streaming client that stops reading: the stall rule (pure) and the response that carries it out (no sockets)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from relax.engines.builtin.stream_response import (
    CONNECTION_EXTENSION,
    ClientWaits,
    StallGuardedStream,
    expose_connection_abort,
)
from relax.engines.builtin.stream_stall import (
    DEFAULT_STREAM_STALL_TIMEOUT_S,
    STREAM_STALL_TIMEOUT_ENV,
    StallBound,
    stall_timeout_from_env,
)

# ---------------------------------------------------------------------- the rule


def test_a_write_is_stalled_from_the_bound_on_not_a_millisecond_before() -> None:
    bound = StallBound(2.0)
    assert bound.deadline(100.0) == 102.0
    assert not bound.stalled(100.0, 100.0)
    assert not bound.stalled(100.0, 101.999)
    assert bound.stalled(100.0, 102.0)
    assert bound.stalled(100.0, 102.001)


def test_no_write_waiting_is_never_stalled() -> None:
    assert not StallBound(0.001).stalled(None, 1e9)


def test_a_zero_bound_never_gives_up() -> None:
    bound = StallBound(0)
    assert not bound.enabled
    assert bound.deadline(5.0) is None
    assert not bound.stalled(0.0, 1e9)


@pytest.mark.parametrize("seconds", [-0.001, math.nan, math.inf])
def test_a_bound_that_is_not_a_finite_duration_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="stall timeout"):
        StallBound(seconds)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, DEFAULT_STREAM_STALL_TIMEOUT_S),
    ({STREAM_STALL_TIMEOUT_ENV: ""}, DEFAULT_STREAM_STALL_TIMEOUT_S),
    ({STREAM_STALL_TIMEOUT_ENV: "1.5"}, 1.5),
    ({STREAM_STALL_TIMEOUT_ENV: " 0 "}, 0.0),
])
def test_the_bound_comes_from_the_environment_or_the_default(env: dict[str, str], expected: float) -> None:
    assert stall_timeout_from_env(env) == expected


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_mistyped_bound_in_the_environment_is_refused_not_defaulted(raw: str) -> None:
    with pytest.raises(ValueError, match=STREAM_STALL_TIMEOUT_ENV):
        stall_timeout_from_env({STREAM_STALL_TIMEOUT_ENV: raw})


def test_the_default_is_at_most_thirty_seconds() -> None:
    assert 0 < DEFAULT_STREAM_STALL_TIMEOUT_S <= 30


# ---------------------------------------------------------------------- the response, over a fake ASGI server


class FakeConnection:
    """An ASGI server's side of one request: a body write completes while the client reads, waits while it does
    not (the headers always fit the buffers)."""

    def __init__(self, read_delay_s: float = 0.0) -> None:
        self.read_delay_s = read_delay_s
        self.reading = asyncio.Event()
        self.reading.set()
        self.waiting = asyncio.Event()  # a write waits for the client
        self.sent: list[dict[str, Any]] = []
        self.aborted = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.sent.append(message)
            return
        if not self.reading.is_set():
            self.waiting.set()
        await self.reading.wait()
        await asyncio.sleep(self.read_delay_s)  # how long the client takes to read it
        self.sent.append(message)

    async def receive(self) -> dict[str, Any]:
        await self.aborted.wait()  # the request body was read; the next message is the disconnect
        return {"type": "http.disconnect"}

    def scope(self, *, abortable: bool = True) -> dict[str, Any]:
        scope: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.3"}}
        if abortable:
            scope["extensions"] = {CONNECTION_EXTENSION: {"abort": self.aborted.set}}
        return scope

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


class Events:
    """A stream's events; records whether its cleanup (``finally``) ran."""

    def __init__(self, chunks: list[bytes], *, engine_delay_s: float = 0.0) -> None:
        self.chunks = chunks
        self.engine_delay_s = engine_delay_s
        self.closed = False

    async def run(self) -> AsyncGenerator[bytes, None]:
        try:
            for chunk in self.chunks:
                await asyncio.sleep(self.engine_delay_s)  # how long the engine takes to generate it
                yield chunk
        finally:
            self.closed = True


async def test_a_client_that_stops_reading_is_given_up_on_after_the_bound() -> None:
    conn, events, stalls = FakeConnection(), Events([b"a", b"b", b"c"]), []

    async def on_stall(waited: float) -> None:
        assert not events.closed  # the requests are aborted before the events are closed
        stalls.append(waited)

    conn.reading.clear()  # the client never reads
    waits = ClientWaits()
    response = StallGuardedStream(events.run(), StallBound(0.05), on_stall, media_type="text/event-stream",
                                  waits=waits)
    task = asyncio.ensure_future(response(conn.scope(), conn.receive, conn.send))
    await asyncio.wait_for(conn.waiting.wait(), timeout=10)
    assert waits == ClientWaits(waiting=1, stalled=0)  # counted while it waits
    await asyncio.wait_for(task, timeout=10)
    assert waits == ClientWaits(waiting=0, stalled=1)
    assert len(stalls) == 1 and stalls[0] >= 0.05
    assert events.closed
    assert conn.aborted.is_set()  # the connection was reset
    assert conn.body == b""  # nothing got through


async def test_a_stall_mid_stream_stops_it_there() -> None:
    conn, stalls = FakeConnection(), []
    events = Events([b"a", b"b", b"c"])

    async def send(message: dict[str, Any]) -> None:
        if message.get("body") == b"b":
            conn.reading.clear()  # the client stops reading after the first chunk
        await FakeConnection.send(conn, message)

    async def on_stall(waited: float) -> None:
        stalls.append(waited)

    response = StallGuardedStream(events.run(), StallBound(0.05), on_stall, media_type="text/event-stream")
    await asyncio.wait_for(response(conn.scope(), conn.receive, send), timeout=10)
    assert conn.body == b"a" and len(stalls) == 1 and events.closed and conn.aborted.is_set()


async def test_a_slow_but_reading_client_and_a_slow_engine_are_not_stalled() -> None:
    """Each write completes within the bound (the client reads, slowly), and the waits for the engine between
    them add up to more than the bound: neither counts against the client."""
    conn = FakeConnection(read_delay_s=0.01)
    events = Events([b"a", b"b", b"c", b"d"], engine_delay_s=0.2)  # 0.8 s of generation in all
    stalls: list[float] = []

    async def on_stall(waited: float) -> None:
        stalls.append(waited)

    waits = ClientWaits()
    response = StallGuardedStream(events.run(), StallBound(0.5), on_stall, media_type="text/event-stream",
                                  waits=waits)
    await asyncio.wait_for(response(conn.scope(), conn.receive, conn.send), timeout=10)
    assert stalls == [] and waits == ClientWaits()
    assert conn.body == b"abcd" and conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert events.closed and not conn.aborted.is_set()


async def test_with_the_check_off_a_long_wait_is_not_a_stall() -> None:
    conn, events, stalls = FakeConnection(), Events([b"a"]), []

    async def on_stall(waited: float) -> None:
        stalls.append(waited)

    conn.reading.clear()
    response = StallGuardedStream(events.run(), StallBound(0), on_stall, media_type="text/event-stream")
    task = asyncio.ensure_future(response(conn.scope(), conn.receive, conn.send))
    await asyncio.sleep(0.1)  # far past any bound the other tests use
    assert not task.done() and stalls == []
    conn.reading.set()
    await asyncio.wait_for(task, timeout=10)
    assert conn.body == b"a" and stalls == []


async def test_without_the_connection_extension_a_stalled_stream_just_ends() -> None:
    conn, events, stalls = FakeConnection(), Events([b"a"]), []

    async def on_stall(waited: float) -> None:
        stalls.append(waited)

    conn.reading.clear()
    response = StallGuardedStream(events.run(), StallBound(0.05), on_stall, media_type="text/event-stream")
    await asyncio.wait_for(response(conn.scope(abortable=False), conn.receive, conn.send), timeout=10)
    assert len(stalls) == 1 and events.closed and not conn.aborted.is_set()


async def test_a_client_that_hangs_up_has_the_events_closed_at_once() -> None:
    """Cancelled while a write waits (the server saw the client go): the events' cleanup runs now, not whenever
    the generator is collected."""
    conn, events = FakeConnection(), Events([b"a", b"b"])

    async def on_stall(waited: float) -> None:
        raise AssertionError("a hang-up is not a stall")

    conn.reading.clear()
    response = StallGuardedStream(events.run(), StallBound(60), on_stall, media_type="text/event-stream")
    task = asyncio.ensure_future(response(conn.scope(), conn.receive, conn.send))
    await asyncio.wait_for(conn.waiting.wait(), timeout=10)  # the first write waits for the client
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events.closed


# ---------------------------------------------------------------------- the connection extension


class FakeSocket:
    def __init__(self) -> None:
        self.options: list[tuple[int, int, bytes]] = []

    def setsockopt(self, level: int, name: int, value: bytes) -> None:
        self.options.append((level, name, value))


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sock = FakeSocket()
        self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default

    def abort(self) -> None:
        self.aborted = True


async def test_the_wrapper_offers_a_reset_of_the_requests_connection() -> None:
    import socket
    import struct

    transport = FakeTransport()
    cycle = SimpleNamespace(transport=transport)

    async def send(message: dict[str, Any]) -> None:  # a method of the cycle, as uvicorn's is
        return None

    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(scope)

    bound_send = send.__get__(cycle)  # type: ignore[attr-defined]
    await expose_connection_abort(app)({"type": "http"}, None, bound_send)
    seen["extensions"][CONNECTION_EXTENSION]["abort"]()
    assert transport.aborted
    assert transport.sock.options == [(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))]

    seen.clear()
    await expose_connection_abort(app)({"type": "http"}, None, send)  # a send that is no server's method
    assert CONNECTION_EXTENSION not in seen.get("extensions", {})
