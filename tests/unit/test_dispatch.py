"""The dispatcher's rules (``rollout.dispatch.journey``) and its shell (``rollout.dispatch.dispatcher``), no engine.

The rules in milliseconds: answers, aborts and crashes with and without a prefix, what a crashed engine's
prefix is trusted with, retries and losses, the accounting. The shell with scripted clients over the real
``Router`` and ``EnginePool``: a stream that breaks continues elsewhere from its last chunk, an engine the
fleet fails takes its streams with it, a request is held while its engine syncs, in-flight counts stay exact.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from relax.engines.client import EngineUnavailable
from relax.engines.event_stream import EventStream
from relax.rollout.dispatch.dispatcher import Dispatcher, SampleLostError
from relax.rollout.dispatch.journey import MAX_CHUNKS, Action, RequestJourney, stream_interval
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.routing.router import FailureKind, RetryPolicy, Router
from relax.rollout.settings import DispatchSettings

PROMPT = [10, 11, 12]
EOS = 2


def answer(ids: list[int], finish: str = "length", version: str = "1", lp0: float = -0.1) -> dict[str, Any]:
    return {"text": "".join(f"<{t}>" for t in ids), "output_ids": list(ids),
            "meta_info": {"finish_reason": {"type": finish}, "completion_tokens": len(ids), "weight_version": version,
                          "weight_versions": [{"version": version, "start": 0, "end": len(ids)}] if ids else [],
                          "output_token_logprobs": [[lp0 - i, t, None] for i, t in enumerate(ids)]}}


def chunk(ids: list[int], version: str = "1") -> dict[str, Any]:
    out = answer(ids, version=version)
    out["meta_info"]["finish_reason"] = None
    return out


def journey(max_new_tokens: int = 10, migrate: bool = True, attempts: int = 4, **params: Any) -> RequestJourney:
    return RequestJourney(PROMPT, {"max_new_tokens": max_new_tokens, **params}, policy=RetryPolicy(attempts),
                          migrate=migrate, eos_ids={EOS}, max_context=64)


# -- rules -----------------------------------------------------------------------------------------------------


def test_an_answer_is_the_sample() -> None:
    j = journey()
    assert j.send().input_ids == tuple(PROMPT)
    step = j.answered("e0", answer([5, 6, 7]), version=1)
    assert step.action is Action.DONE and step.output["output_ids"] == [5, 6, 7] and step.dispatch_version == 1
    assert step.generated == 3 and step.kept == step.regenerated == 0


def test_a_crash_continues_elsewhere_from_the_streamed_prefix_with_the_remaining_budget() -> None:
    j = journey(max_new_tokens=10)
    j.send()
    step = j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, chunk([5, 6, 7, 8]), version=1)
    assert step.action is Action.SEND and step.exclude == {"e0"}
    assert step.input_ids == (*PROMPT, 5, 6, 7, 8) and step.sampling_params["max_new_tokens"] == 6
    assert step.kept == 4 and step.regenerated == 0
    assert j.send() is step
    done = j.answered("e1", answer([9, 3, 4, 4, 4, 4], version="2", lp0=-0.9), version=2)
    out = done.output
    assert done.action is Action.DONE and done.segments == 2
    assert out["output_ids"] == [5, 6, 7, 8, 9, 3, 4, 4, 4, 4]
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]][:5] == pytest.approx(
        [-0.1, -1.1, -2.1, -3.1, -0.9])
    assert out["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 4},
                                                   {"version": "2", "start": 4, "end": 10}]
    assert done.dispatch_version == 1  # the oldest segment's: the staleness rule counts the oldest token


def test_a_crash_before_the_first_chunk_starts_again_from_the_prompt() -> None:
    j = journey()
    j.send()
    step = j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, None, version=1)
    assert step.action is Action.SEND and step.input_ids == tuple(PROMPT) and step.kept == step.regenerated == 0


def test_an_inconsistent_prefix_is_not_trusted_and_counts_as_regenerated() -> None:
    bad = chunk([5, 6, 7])
    bad["meta_info"]["output_token_logprobs"] = bad["meta_info"]["output_token_logprobs"][:2]  # 2 for 3 tokens
    j = journey()
    j.send()
    step = j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, bad, version=1)
    assert step.input_ids == tuple(PROMPT) and step.kept == 0 and step.regenerated == 3
    assert "not trusted" in step.reason


def test_a_prefix_that_ends_the_sample_completes_it_without_another_engine() -> None:
    j = journey(max_new_tokens=10)
    j.send()
    step = j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, chunk([5, 6, EOS]), version=1)
    assert step.action is Action.DONE and step.output["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                       "matched": EOS}
    j = journey(max_new_tokens=3)
    j.send()
    assert j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, chunk([5, 6, 7]), 1).output["meta_info"][
        "finish_reason"]["type"] == "length"


def test_an_abort_answer_migrates_like_a_crash_but_does_not_avoid_the_engine() -> None:
    j = journey()
    j.send()
    step = j.answered("e0", answer([5, 6], finish="abort"), version=1)
    assert step.action is Action.SEND and step.input_ids == (*PROMPT, 5, 6) and step.exclude == frozenset()


def test_without_migration_the_prefix_is_regenerated() -> None:
    j = journey(migrate=False)
    j.send()
    step = j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, chunk([5, 6, 7]), version=1)
    assert step.input_ids == tuple(PROMPT) and step.kept == 0 and step.regenerated == 3


def test_a_request_that_runs_out_of_attempts_is_lost_loudly_and_a_client_error_is_not_retried() -> None:
    j = journey(attempts=2)
    j.send()
    assert j.failed("e0", FailureKind.ENGINE_UNAVAILABLE, chunk([5]), 1).action is Action.SEND
    j.send()
    lost = j.failed("e1", FailureKind.ENGINE_UNAVAILABLE, chunk([6]), 1)
    assert lost.action is Action.LOST and "gave up after 2" in lost.reason and lost.regenerated == 2
    with pytest.raises(RuntimeError, match="nothing to send"):
        j.send()
    j = journey()
    j.send()
    assert j.failed("e0", FailureKind.CLIENT_ERROR, None, 1).action is Action.LOST


def test_chunks_are_few_tokens_apart_but_never_more_than_max_chunks_per_request() -> None:
    assert stream_interval(32, floor=8) == 8 and stream_interval(200, floor=8) == 8
    assert stream_interval(16384, floor=8) == 256 == 16384 // MAX_CHUNKS
    assert stream_interval(1000, floor=8) == 16  # ceil(1000 / 64)
    assert stream_interval(1, floor=0) == 1
    # a budget a crash could cost in full for less than its chunks would: unstreamed
    assert stream_interval(64, floor=8, min_tokens=64) is None and stream_interval(65, floor=8, min_tokens=64) == 8


# -- the shell -------------------------------------------------------------------------------------------------


def active_pool(n: int) -> EnginePool:
    pool = EnginePool(time.time)
    for _ in range(n):
        record = pool.add(EngineKind.INITIAL)
        for state in (EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING):
            pool.transition(record.engine_id, state)
        pool.set_weight_version(record.engine_id, 1)
        pool.transition(record.engine_id, EngineState.ACTIVE)
    return pool


class ScriptedClient:
    """Streams the chunks of its script, then answers, raises, or hangs until cancelled."""

    def __init__(self, chunks: list[list[int]], end: str = "answer", final: list[int] | None = None) -> None:
        self.chunks, self.end, self.final = chunks, end, final or []
        self.calls: list[dict[str, Any]] = []
        self.streaming = asyncio.Event()

    async def generate_stream(self, held: EventStream, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        import json

        for ids in self.chunks:
            held.feed(b"data: " + json.dumps(chunk(ids)).encode() + b"\n\n")
        held.feed(b"data: {\"text\": \"cut of")  # a chunk cut off mid-way: never trusted
        self.streaming.set()
        if self.end == "crash":
            raise EngineUnavailable("connection reset", url="http://e", endpoint="/generate")
        if self.end == "hang":
            await asyncio.Event().wait()
        return answer(self.final)


class FakeFleet:
    def __init__(self, clients: dict[str, ScriptedClient]) -> None:
        self.clients = clients
        self.routable = asyncio.Event()
        self.failed: list[str] = []
        self.released: list[str] = []
        self.syncing: dict[str, asyncio.Event] = {}
        self.at_gate = asyncio.Event()

    def client(self, engine_id: str) -> ScriptedClient:
        return self.clients[engine_id]

    async def wait_not_syncing(self, engine_id: str) -> None:
        if engine_id in self.syncing:
            self.at_gate.set()
            await self.syncing[engine_id].wait()

    def note_release(self, engine_id: str) -> None:
        self.released.append(engine_id)

    def note_answer(self, engine_id: str, version: int) -> None:
        pass

    async def on_engine_failure(self, engine_id: str, exc: BaseException) -> None:
        self.failed.append(engine_id)


def make(clients: dict[str, ScriptedClient], **settings: Any) -> tuple[Dispatcher, Router, FakeFleet]:
    pool, router, fleet = active_pool(len(clients)), Router(), FakeFleet(clients)
    for engine_id in clients:
        router.add(engine_id)
    d = Dispatcher(router, pool, fleet, RetryPolicy(4),
                   DispatchSettings(eos_ids=frozenset({EOS}), stream_min_tokens=0, **settings),
                   sync=fleet)  # the fake fleet is also the weight sync's gate
    pool._on_transition = d.on_transition  # rollout.assembly composes it the same way
    return d, router, fleet


def idle(router: Router, *engine_ids: str) -> bool:
    """No request is counted in flight on these engines any more (a failed one's included)."""
    return all(router.in_flight(e) == 0 for e in engine_ids)


def test_a_stream_that_breaks_continues_on_another_engine_from_its_last_complete_chunk() -> None:
    crashing = ScriptedClient([[5], [5, 6, 7]], end="crash")
    survivor = ScriptedClient([], final=[8, 9, 4])

    async def run() -> Any:
        d, router, fleet = make({"engine_0": crashing, "engine_1": survivor})
        gen = await d.generate("g", PROMPT, {"max_new_tokens": 6})
        return gen, d, router, fleet

    gen, d, router, fleet = asyncio.run(run())
    assert gen.engine_id == "engine_1" and gen.output["output_ids"] == [5, 6, 7, 8, 9, 4]
    assert survivor.calls[0]["input_ids"] == [*PROMPT, 5, 6, 7]
    assert survivor.calls[0]["sampling_params"] == {"max_new_tokens": 3, "stream_interval": 8}
    assert fleet.failed == ["engine_0"] and idle(router, "engine_0", "engine_1")
    assert d.migration.tokens_kept == 3 and d.migration.migrated_requests == 1 and d.tokens_generated == 6


def test_an_engine_the_fleet_fails_takes_its_streams_with_it() -> None:
    silent = ScriptedClient([[5, 6]], end="hang")  # a node gone without a reset: the socket never answers
    survivor = ScriptedClient([], final=[7, 8])

    async def run() -> Any:
        d, router, fleet = make({"engine_0": silent, "engine_1": survivor})
        task = asyncio.create_task(d.generate("g", PROMPT, {"max_new_tokens": 4}))
        await silent.streaming.wait()
        d.pool.transition("engine_0", EngineState.FAILED, error="actor died")
        return await asyncio.wait_for(task, 5), router

    gen, router = asyncio.run(run())
    assert gen.output["output_ids"] == [5, 6, 7, 8] and idle(router, "engine_0", "engine_1")


def test_a_request_is_held_while_its_engine_syncs_weights_and_cancellation_is_not_a_crash() -> None:
    client = ScriptedClient([], end="hang")

    async def run() -> Any:
        d, router, fleet = make({"engine_0": client})
        fleet.syncing["engine_0"] = asyncio.Event()
        task = asyncio.create_task(d.generate("g", PROMPT, {"max_new_tokens": 4}))
        await fleet.at_gate.wait()
        held = client.calls == []
        fleet.syncing["engine_0"].set()
        await client.streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return held, router, fleet

    held, router, fleet = asyncio.run(run())
    assert held and fleet.failed == [] and idle(router, "engine_0")


def test_a_request_failing_everywhere_raises_sample_lost() -> None:
    async def run() -> None:
        d, _, _ = make({"engine_0": ScriptedClient([], end="crash")})
        await d.generate("g", PROMPT, {"max_new_tokens": 4})

    with pytest.raises(SampleLostError, match="gave up after 4"):
        asyncio.run(run())
