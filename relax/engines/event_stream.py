"""Reading SGLang's streamed ``/generate`` (server-sent events) while keeping only what a caller may need.

Every chunk of SGLang's stream is cumulative (the output so far), so the newest complete chunk is all there is
to keep; older ones are dropped unparsed. Parsing is deferred too: a chunk is JSON-decoded only when somebody
asks for it — the final answer, or the prefix of a generation whose engine died mid-way. A stream therefore
costs the caller a byte search per network read, not a JSON parse per chunk (a 16k-token response streamed in
cumulative chunks would otherwise parse gigabytes).

What may be trusted of a stream that broke off: the last *complete* event (terminated by its blank line). A
partial event — the connection cut mid-chunk — is discarded, never repaired; a complete one is a consistent
snapshot (ids, log-probs and version spans of one moment), which ``relax.rollout.dispatch.migration.Segment`` checks
again (as many log-probs as tokens) before a single token of it is kept.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["EventStream", "StreamError", "sse"]

_SEP = b"\n\n"
_DONE = b"[DONE]"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event as SGLang frames it (``data: <json>`` and a blank line): what this module reads."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class StreamError(ValueError):
    """The stream carried an error event (``data: {"error": ...}``) or an event that is not JSON."""


class EventStream:
    """Feed it the bytes of one streamed generation; it holds the newest complete chunk, raw."""

    __slots__ = ("_buffer", "_latest", "_parsed", "done", "chunks")

    def __init__(self) -> None:
        self._buffer = b""
        self._latest: bytes | None = None  # the newest complete event's data, unparsed
        self._parsed: dict[str, Any] | None = None
        self.done = False  # ``data: [DONE]`` seen: the newest chunk is the final answer
        self.chunks = 0  # complete events seen, [DONE] excluded

    def feed(self, data: bytes) -> None:
        """Take the next bytes off the wire; raises :class:`StreamError` on an error event."""
        buffer = self._buffer + data if self._buffer else data
        end = buffer.rfind(_SEP)
        if end < 0:
            self._buffer = buffer
            return
        self._buffer = buffer[end + 2:]
        complete = buffer[:end]
        if _DONE in complete or b'"error"' in complete:
            events = complete.split(_SEP)
        else:  # the usual case: only the newest event matters, the others are counted and dropped unread
            self.chunks += complete.count(_SEP)
            events = [complete[complete.rfind(_SEP) + 2:]] if _SEP in complete else [complete]
        for event in events:
            payload = _data(event)
            if payload is None:
                continue
            if payload == _DONE:
                self.done = True
                continue
            if payload.startswith(b'{"error"'):
                raise StreamError(_error_message(payload))
            self.chunks += 1
            self._latest, self._parsed = payload, None

    def latest(self) -> dict[str, Any] | None:
        """The newest complete chunk (parsed once, on demand); None before the first one."""
        if self._parsed is None and self._latest is not None:
            try:
                parsed = json.loads(self._latest)
            except ValueError as exc:
                raise StreamError(f"a stream chunk is not JSON: {self._latest[:120]!r}") from exc
            if not isinstance(parsed, dict):
                raise StreamError(f"a stream chunk is {type(parsed).__name__}, expected an object")
            self._parsed = parsed
        return self._parsed


def _data(event: bytes) -> bytes | None:
    """The ``data:`` payload of one event (comments and other fields ignored, multi-line data joined)."""
    lines = [line[5:].lstrip(b" ") for line in event.strip(b"\r\n").split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


def _error_message(payload: bytes) -> str:
    try:
        error = json.loads(payload).get("error")
    except ValueError:
        return payload.decode(errors="replace")[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)
