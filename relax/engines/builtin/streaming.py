"""``"stream": true`` on ``/generate``: server-sent events carrying each request's output so far, as SGLang does.

Why the engine streams at all: a caller that holds the prefix of every generation in flight loses almost
nothing when the engine dies without notice — it continues each request elsewhere from the last chunk it
received (``relax.rollout.dispatch``). SGLang's contract (``SGLANG-CONTRACT.md``, "streaming"):

* ``data: {...}`` per chunk, then ``data: [DONE]``; every chunk is *cumulative* — ``text``, ``output_ids`` and
  ``meta_info`` (``output_token_logprobs`` with ``return_logprob``, ``weight_version(s)``, ``completion_tokens``,
  ``finish_reason`` null until the last chunk) cover the whole output so far, so any one complete chunk is a
  self-consistent prefix;
* ``--stream-interval N`` tokens between chunks (SGLang's default 1); the last chunk always comes;
* batched input or ``n > 1``: each chunk names its request with ``index``;
* a client that disconnects has its requests aborted (as a non-streaming one does).

The engine thread calls :meth:`StreamFeed.progress` after each step; it only compares two integers and, when a
chunk is due, wakes the event loop (one ``call_soon_threadsafe``), so streaming costs the engine loop nothing
per token. The chunk itself is built on the event loop from the request's lists, which the engine thread only
ever appends to (ids before log-probs: the log-prob count bounds a consistent prefix).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from relax.engines.builtin.scheduler import Request
from relax.engines.builtin.versions import version_spans

log = logging.getLogger("relax.engine")

__all__ = ["DONE", "StreamFeed", "abort_unfinished", "sse"]

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event (SGLang's framing: ``data: <json>`` and a blank line)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class StreamFeed:
    """The requests of one streaming call: when a chunk is due, and the chunks themselves."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1 token, got {interval}")
        self._loop = loop
        self._interval = interval
        self._wake = asyncio.Event()
        self._notified: dict[int, int] = {}  # id(request) -> output length at its last wake-up (engine thread)
        self._sent: dict[int, int] = {}  # id(request) -> output length of its last chunk (event loop)

    # -- engine thread ------------------------------------------------------------------------------

    def progress(self, req: Request) -> None:
        """``Request.on_progress``: wake the loop once ``interval`` tokens arrived since the last wake-up."""
        n = len(req.output_logprobs)
        if n - self._notified.get(id(req), 0) >= self._interval:
            self._notified[id(req)] = n
            self._loop.call_soon_threadsafe(self._wake.set)

    def finished(self, req: Request) -> None:
        """``Request.on_finish``: the last chunk is always sent."""
        self._loop.call_soon_threadsafe(self._wake.set)

    # -- event loop ---------------------------------------------------------------------------------

    async def chunks(self, requests: list[Request], *, indexed: bool, return_logprob: bool,
                     decode: Callable[[list[int], bool], str], current_version: Callable[[], str],
                     final: Callable[[Request], dict[str, Any]]) -> AsyncIterator[bytes]:
        """Events until every request finished, then ``[DONE]``."""
        done: set[int] = set()
        while len(done) < len(requests):
            await self._wake.wait()
            self._wake.clear()
            for index, req in enumerate(requests):
                if id(req) in done:
                    continue
                if req.finished:
                    done.add(id(req))
                    payload = final(req)
                else:
                    n = len(req.output_logprobs)  # ids are appended first: ids[:n] pairs with logprobs[:n]
                    if n - self._sent.get(id(req), 0) < self._interval:
                        continue
                    payload = self._partial(req, n, return_logprob, decode, current_version())
                    self._sent[id(req)] = n
                if indexed:
                    payload["index"] = index
                yield sse(payload)
        yield DONE

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


async def abort_unfinished(requests: list[Request], abort: Callable[[str, str], int]) -> None:
    """A streaming client went away (or the response failed): abort what it was still waiting for.

    Runs while the response's task is being cancelled, so it is shielded: without that, the first ``await``
    would be cancelled too and the requests would generate on for nobody.
    """
    parents = sorted({r.parent_rid for r in requests if not r.finished})
    if not parents:
        return
    log.info("streaming client disconnected: aborting %s", ", ".join(parents))
    with anyio.CancelScope(shield=True):
        for rid in parents:
            await anyio.to_thread.run_sync(abort, rid, "client disconnected")
