"""A stream's feed: its slot is given back when its generation ends inside the engine, whatever its client read."""

from __future__ import annotations

import asyncio
import threading

from relax.engines.builtin.sampling import SamplingParams
from relax.engines.builtin.scheduler import Request
from relax.engines.builtin.streaming import StreamFeed, Wakeups, parent_rids


def _request(rid: str, parent: str) -> Request:
    return Request(rid=rid, parent_rid=parent, prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=4), arrival=0.0)


def _finish_on_engine_thread(feed: StreamFeed, req: Request) -> None:
    """What the engine does: set the finish reason, then call on_finish, on its own thread."""

    def finish() -> None:
        req.finish_reason = {"type": "length", "length": 4}
        feed.finished(req)

    t = threading.Thread(target=finish)
    t.start()
    t.join()


async def test_the_callback_runs_once_on_the_loop_when_every_request_finished() -> None:
    loop = asyncio.get_running_loop()
    feed = StreamFeed(Wakeups(loop), interval=1)
    requests = [_request("p-0", "p"), _request("p-1", "p")]
    generated = asyncio.Event()
    calls: list[threading.Thread] = []

    def on_generated() -> None:
        calls.append(threading.current_thread())
        generated.set()

    feed.when_generated(requests, on_generated)
    _finish_on_engine_thread(feed, requests[0])
    for _ in range(10):  # the wake-up of the first finish runs
        await asyncio.sleep(0)
    assert calls == []  # one request still generates
    _finish_on_engine_thread(feed, requests[1])
    await asyncio.wait_for(generated.wait(), timeout=5)
    feed.finished(requests[1])  # a late duplicate notification changes nothing
    for _ in range(10):
        await asyncio.sleep(0)
    assert calls == [threading.main_thread()]


async def test_the_callback_does_not_wait_for_the_chunks_to_be_read() -> None:
    """Nobody iterates the chunks (the client stopped reading): the generation's end is still seen."""
    feed = StreamFeed(Wakeups(asyncio.get_running_loop()), interval=1)
    req = _request("solo", "solo")
    generated = asyncio.Event()
    feed.when_generated([req], generated.set)
    for _ in range(3):
        req.output_ids.append(7)
        req.output_logprobs.append(-0.1)
        feed.progress(req)
    _finish_on_engine_thread(feed, req)
    await asyncio.wait_for(generated.wait(), timeout=5)


def test_parent_rids_name_each_prompt_once_in_order() -> None:
    reqs = [_request("b-0", "b"), _request("a-0", "a"), _request("b-1", "b")]
    assert parent_rids(reqs) == ["b", "a"]
