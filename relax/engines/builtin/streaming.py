"""``"stream": true`` on ``/generate``: server-sent events carrying each request's output so far, as SGLang does.

Why the engine streams at all: a caller that holds the prefix of every generation in flight loses almost
nothing when the engine dies without notice — it continues each request elsewhere from the last chunk it
received (``relax.rollout.dispatch.journey``). SGLang's behaviour (docs/engine.md, "Endpoints", ``POST /generate``
with ``"stream": true``):

* ``data: {...}`` per chunk, then ``data: [DONE]``; every chunk is *cumulative* — ``text``, ``output_ids`` and
  ``meta_info`` (``output_token_logprobs`` with ``return_logprob``, ``weight_version(s)``, ``completion_tokens``,
  ``finish_reason`` null until the last chunk) cover the whole output so far, so any one complete chunk is a
  self-consistent prefix;
* ``--stream-interval N`` tokens between chunks (SGLang's default 1): a chunk covers a multiple of N tokens, the
  newest one when several fell due before it was sent; the last chunk always comes;
* batched input or ``n > 1``: each chunk names its request with ``index``;
* a client that disconnects has its requests aborted (as a non-streaming one does); one that stops reading is
  given up on after the stream stall timeout (``stream_stall``, ``stream_response``).

The stream's slot in the engine's update lock (a reader's, ``rwlock``) is given back when the last of its
requests finishes inside the engine (:meth:`StreamFeed.when_generated`), not when the client has the last
byte: an unpaused weight load waits for every reader, and every new request waits behind that load, so the
slot must not wait on a slow or stalled client.

The engine thread calls :meth:`StreamFeed.progress` after each step; it only compares two integers and, when a
chunk is due, marks the stream due in :class:`Wakeups`, which wakes the event loop once however many streams fell
due in that step (a batch's requests reach their interval in the same step: one wake-up instead of one each), so
streaming costs the engine loop almost nothing per token. The chunk itself is built on the event loop from the
request's lists, which the engine thread only ever appends to (ids before log-probs: the log-prob count bounds a
consistent prefix).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from relax.engines.builtin.scheduler import Request
from relax.engines.builtin.versions import version_spans
from relax.engines.event_stream import sse

__all__ = ["DONE", "StreamFeed", "Wakeups", "abort_unfinished", "parent_rids", "sse"]

DONE = b"data: [DONE]\n\n"


class Wakeups:
    """Callbacks that fell due on the engine thread (a stream's wake-up), run on the event loop in one go."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._due: set[Callable[[], None]] = set()
        self._scheduled = False

    def due(self, callback: Callable[[], None]) -> None:
        """Engine thread: run ``callback`` on the loop (once, however often it fell due before it ran); one
        flush is scheduled for all of them."""
        with self._lock:
            self._due.add(callback)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            due, self._due, self._scheduled = self._due, set(), False
        for callback in due:
            callback()


class StreamFeed:
    """The requests of one streaming call: when a chunk is due, and the chunks themselves."""

    def __init__(self, wakeups: Wakeups, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1 token, got {interval}")
        self._wakeups = wakeups
        self._interval = interval
        self._wake = asyncio.Event()
        self._notified: dict[int, int] = {}  # id(request) -> output length at its last wake-up (engine thread)
        self._sent: dict[int, int] = {}  # id(request) -> output length of its last chunk (event loop)
        self._requests: list[Request] = []
        self._on_generated: Callable[[], None] | None = None

    def when_generated(self, requests: list[Request], callback: Callable[[], None]) -> None:
        """Event loop, before ``requests`` are submitted: call ``callback`` on the loop, once, as soon as every
        one of them finished inside the engine (done, stopped or aborted), however far its chunks got."""
        self._requests = requests
        self._on_generated = callback

    # -- engine thread ------------------------------------------------------------------------------

    def progress(self, req: Request) -> None:
        """``Request.on_progress``: wake the loop once ``interval`` tokens arrived since the last wake-up."""
        n = len(req.output_logprobs)
        if n - self._notified.get(id(req), 0) >= self._interval:
            self._notified[id(req)] = n
            self._wakeups.due(self._wake.set)

    def finished(self, req: Request) -> None:
        """``Request.on_finish``: the last chunk is always sent."""
        self._wakeups.due(self._finished_on_loop)

    # -- event loop ---------------------------------------------------------------------------------

    def _finished_on_loop(self) -> None:
        self._wake.set()
        if self._on_generated is not None and all(r.finished for r in self._requests):
            callback, self._on_generated = self._on_generated, None
            callback()

    async def chunks(self, requests: list[Request], *, indexed: bool, return_logprob: bool,
                     decode: Callable[[list[int], bool], str], current_version: Callable[[], str],
                     final: Callable[[Request], dict[str, Any]]) -> AsyncIterator[bytes]:
        """Events until every request finished, then ``[DONE]``.

        What falls due together goes out as one write (the chunks of a batched call, the last chunk and ``[DONE]``):
        on a small model a socket write costs as much as generating a token.
        """
        done: set[int] = set()
        while len(done) < len(requests):
            await self._wake.wait()
            self._wake.clear()
            events: list[bytes] = []
            for index, req in enumerate(requests):
                if id(req) in done:
                    continue
                if req.finished:
                    done.add(id(req))
                    payload = final(req)
                else:
                    # at a multiple of the interval, as SGLang's scheduler emits them (the engine may be further
                    # on by now); ids are appended before log-probs, so ids[:n] pairs with logprobs[:n]
                    n = len(req.output_logprobs) // self._interval * self._interval
                    if n <= self._sent.get(id(req), 0):
                        continue
                    payload = self._partial(req, n, return_logprob, decode, current_version())
                    self._sent[id(req)] = n
                if indexed:
                    payload["index"] = index
                events.append(sse(payload))
            if len(done) == len(requests):
                events.append(DONE)
            if events:
                yield b"".join(events)

    @staticmethod
    def _partial(req: Request, n: int, return_logprob: bool, decode: Callable[[list[int], bool], str],
                 version: str) -> dict[str, Any]:
        ids = req.output_ids[:n]
        spans = version_spans(list(req.version_changes), version, n)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": spans[-1].version,
            "weight_versions": [s.to_json() for s in spans],
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs[:n], ids,
                                                                                   strict=True)]
        return {"text": decode(ids, req.params.skip_special_tokens), "output_ids": ids, "meta_info": meta}


def parent_rids(requests: list[Request]) -> list[str]:
    """The rids a stream's caller gave (one per prompt), in order: what its log lines name."""
    return list(dict.fromkeys(r.parent_rid for r in requests))


async def abort_unfinished(requests: list[Request], abort: Callable[[str, str], int], reason: str) -> list[str]:
    """A streaming client went away or stopped reading (or the response failed): abort what it was still
    waiting for; returns the parent rids aborted (the caller logs why).

    May run while the response's task is being cancelled, so it is shielded: without that, the first ``await``
    would be cancelled too and the requests would generate on for nobody.
    """
    parents = parent_rids([r for r in requests if not r.finished])
    with anyio.CancelScope(shield=True):
        for rid in parents:
            await anyio.to_thread.run_sync(abort, rid, reason)
    return parents
