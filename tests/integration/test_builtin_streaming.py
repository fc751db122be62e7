"""``"stream": true`` on the built-in engine's /generate, checked over real HTTP against SGLang 0.5.23's contract.

The contract rows (SGLANG-CONTRACT.md, "streaming" and "client disconnect") are checked with a client written
from the contract alone (httpx, the raw bytes of the response split into server-sent events), not with Relax's
own client; one test then runs Relax's ``EngineClient.generate_stream`` against the same engine, and against
one that is SIGKILLed mid-stream.

The module's engine is started with ``--stream-interval 3`` (the ``start_engine`` fixture passes no extra
flags), so the server default and the per-request ``sampling_params.stream_interval`` are told apart.

Not here: a non-streaming client that hangs up is aborted — test_builtin_engine.py's
``test_a_client_that_hangs_up_has_its_requests_aborted`` covers that row.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.engine_http import in_flight, poll

SERVER_INTERVAL = 3  # the module engine's --stream-interval


def _start_with_flags(model_dir: Path, logs: Path, extra: tuple[str, ...], name: str):
    """A built-in engine with extra server flags (start_engine cannot pass them); the caller stops it."""
    from relax.cluster.network import free_port
    from relax.engines.launcher import BuiltinOptions, ServerLaunchError, ServerProcess, builtin_spec

    for attempt in range(3):  # the port can be taken between choosing it and the server binding it
        spec = builtin_spec(str(model_dir), "127.0.0.1", free_port(), str(logs / f"{name}-{attempt}.log"),
                            options=BuiltinOptions(max_running_requests=8, num_threads=1), name=name)
        proc = ServerProcess(replace(spec, argv=(*spec.argv, *extra)))
        proc.start()
        try:
            proc.wait_healthy(timeout=120)
            return proc
        except ServerLaunchError as exc:
            proc.stop(grace_s=5)
            if attempt == 2 or not exc.port_was_taken:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def engine(tiny_preset, tmp_path_factory: pytest.TempPathFactory):
    proc = _start_with_flags(tiny_preset.model_dir, tmp_path_factory.mktemp("stream-engine-logs"),
                             ("--stream-interval", str(SERVER_INTERVAL)), "stream-engine")
    try:
        yield proc
    finally:
        proc.stop(grace_s=5)


@pytest.fixture(scope="module")
def prompt_ids(tiny_preset) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))
    return tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                   return_dict=False)


@pytest.fixture
async def http(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=30, trust_env=False) as c:
        yield c


# ---------------------------------------------------------------------- a client written from the contract


def _split_events(raw: bytes) -> list[bytes]:
    """Server-sent events: each ends with a blank line; the stream ends with one too."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    return raw[:-2].split(b"\n\n")


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[bytes], list[dict[str, Any]]]:
    """POST a streaming /generate; returns the raw events and the parsed chunks (``[DONE]`` excluded)."""
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        raw = await r.aread()
        assert r.status_code == 200, raw
        assert r.headers["content-type"].startswith("text/event-stream")
    events = _split_events(raw)
    for event in events:
        assert event.startswith(b"data: "), event
    assert events[-1] == b"data: [DONE]"
    assert b"[DONE]" not in b"".join(events[:-1])
    return events, [json.loads(e[len(b"data: "):]) for e in events[:-1]]


def _check_cumulative(chunks: list[dict[str, Any]], *, logprobs: bool) -> None:
    """Every chunk a self-consistent prefix of the next; finish_reason only on the last."""
    previous: list[int] = []
    for i, chunk in enumerate(chunks):
        ids, meta = chunk["output_ids"], chunk["meta_info"]
        assert ids[:len(previous)] == previous and len(ids) >= len(previous), (previous, ids)
        assert meta["completion_tokens"] == len(ids)
        if logprobs:
            pairs = meta["output_token_logprobs"]
            assert len(pairs) == len(ids)
            assert [tok for _, tok, _ in pairs] == ids
            assert all(isinstance(lp, float) and lp <= 0.0 and extra is None for lp, _, extra in pairs)
        assert meta["weight_version"] == "0"
        assert meta["weight_versions"] and meta["weight_versions"][-1]["version"] == "0"
        if i < len(chunks) - 1:
            assert meta["finish_reason"] is None, chunk
        else:
            assert meta["finish_reason"] is not None, chunk
        previous = ids


def _partial_lengths(chunks: list[dict[str, Any]]) -> list[int]:
    return [len(c["output_ids"]) for c in chunks if c["meta_info"]["finish_reason"] is None]


# ---------------------------------------------------------------------- the contract rows


async def test_chunks_are_cumulative_sse_at_the_requested_interval(http, prompt_ids) -> None:
    params = {"max_new_tokens": 17, "ignore_eos": True, "temperature": 0.0, "stream_interval": 4}
    body = {"input_ids": prompt_ids, "return_logprob": True, "sampling_params": params}
    events, chunks = await _stream(http, body)
    _check_cumulative(chunks, logprobs=True)
    assert all("index" not in c for c in chunks)  # one request, not batched: no index

    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 17}
    assert len(final["output_ids"]) == 17 and final["meta_info"]["completion_tokens"] == 17

    partial = _partial_lengths(chunks)
    assert len(partial) >= 2, partial
    assert all(n > 0 and n % 4 == 0 for n in partial), partial  # coalescing may skip one, never misalign

    # the final chunk is what the same request answers without streaming (greedy: the same tokens too)
    plain = (await http.post("/generate", json=body)).json()
    assert set(final) == set(plain)
    assert set(final["meta_info"]) == set(plain["meta_info"])
    assert final["output_ids"] == plain["output_ids"] and final["text"] == plain["text"]
    got = [lp for lp, _, _ in final["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


async def test_server_flag_sets_the_default_interval_and_a_request_overrides_it(http, prompt_ids) -> None:
    info = (await http.get("/server_info")).json()
    assert info["stream_interval"] == SERVER_INTERVAL
    base = {"input_ids": prompt_ids, "return_logprob": True}

    tokens = 40
    _, by_default = await _stream(http, {**base, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
    _check_cumulative(by_default, logprobs=True)
    lengths = _partial_lengths(by_default)  # 3, 6, ..., 39 unless some were coalesced
    assert 2 <= len(lengths) <= tokens // SERVER_INTERVAL, lengths
    assert all(n % SERVER_INTERVAL == 0 for n in lengths), lengths

    _, overridden = await _stream(http, {**base, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True,
                                                                     "stream_interval": 5}})
    _check_cumulative(overridden, logprobs=True)
    lengths = _partial_lengths(overridden)  # 5, 10, ..., 35 unless some were coalesced
    assert 2 <= len(lengths) <= tokens // 5 and all(n % 5 == 0 for n in lengths), lengths
    assert any(n % SERVER_INTERVAL for n in lengths), lengths  # not the server's default interval
    assert by_default[-1]["meta_info"]["finish_reason"] == overridden[-1]["meta_info"]["finish_reason"] == {
        "type": "length", "length": tokens}


@pytest.mark.parametrize("shape", ["n", "batch"])
async def test_several_requests_in_one_stream_carry_their_index(http, prompt_ids, shape) -> None:
    params = {"max_new_tokens": 10, "ignore_eos": True, "stream_interval": 4}
    if shape == "n":
        body = {"input_ids": prompt_ids, "sampling_params": {**params, "n": 3}, "return_logprob": True}
        count = 3
    else:
        body = {"input_ids": [prompt_ids, prompt_ids[:-2]], "sampling_params": params, "return_logprob": True}
        count = 2
    _, chunks = await _stream(http, body)
    assert all(isinstance(c.get("index"), int) for c in chunks)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        by_index.setdefault(c["index"], []).append(c)
    assert sorted(by_index) == list(range(count))
    for index, own in by_index.items():
        _check_cumulative(own, logprobs=True)  # each ends with exactly one final chunk, its last
        assert own[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}, index
        assert all(n % 4 == 0 for n in _partial_lengths(own)), index
    if shape == "batch":  # the prompts are told apart: each index has its own prompt
        assert by_index[0][-1]["meta_info"]["prompt_tokens"] == len(prompt_ids)
        assert by_index[1][-1]["meta_info"]["prompt_tokens"] == len(prompt_ids) - 2


async def test_a_streaming_client_that_hangs_up_before_any_chunk_is_aborted(engine, http, prompt_ids) -> None:
    """Paused in place, nothing can finish: the queued request leaves only through the abort of the hang-up."""
    rid = "stream-hangup-queued"
    await http.post("/pause_generation", json={"mode": "in_place"})
    try:
        body = {"input_ids": prompt_ids, "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=engine.url, timeout=30, trust_env=False) as impatient, \
                impatient.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200  # the headers came; no chunk can (paused)

            async def queued() -> bool:
                return await in_flight(http) == (0, 1)

            await poll(queued, what="the streamed request queued")
        # the response is closed unread and its connection with it

        async def gone() -> bool:
            return await in_flight(http) == (0, 0)

        await poll(gone, what="the hung-up stream's request aborted")
        r = await http.post("/abort_request", json={"rid": rid})
        assert r.status_code == 404, r.text
    finally:
        await http.post("/continue_generation", json={})


async def _first_chunk(response: httpx.Response) -> dict[str, Any]:
    received = b""
    async for data in response.aiter_bytes():
        received += data
        if b"\n\n" in received:
            break
    event = received.split(b"\n\n")[0]
    assert event.startswith(b"data: {"), received[:200]
    return json.loads(event[len(b"data: "):])


async def test_a_streaming_client_that_hangs_up_mid_generation_is_aborted(engine, http, prompt_ids) -> None:
    """A request frozen mid-generation (paused in place) whose client read a chunk and hung up leaves the batch.

    To catch it running without racing a 220-token generation on a busy machine: queue it paused, then let the
    engine run for one HTTP round trip at a time (continue, pause) until it is admitted. A round trip long enough
    to finish it (seen as (0, 0)) makes that attempt void and another request is tried.
    """
    for attempt in range(5):
        rid = f"stream-hangup-running-{attempt}"
        body = {"input_ids": prompt_ids, "rid": rid, "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 220, "ignore_eos": True, "stream_interval": 1}}
        await http.post("/pause_generation", json={"mode": "in_place"})
        try:
            async with httpx.AsyncClient(base_url=engine.url, timeout=30, trust_env=False) as impatient, \
                    impatient.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200

                async def queued() -> bool:
                    return await in_flight(http) == (0, 1)

                await poll(queued, what="the streamed request queued")
                deadline = time.monotonic() + 15
                while (state := await in_flight(http)) == (0, 1) and time.monotonic() < deadline:
                    await http.post("/continue_generation", json={})
                    await http.post("/pause_generation", json={"mode": "in_place"})
                if state != (1, 0):
                    continue  # finished within one round trip (or never admitted): try again
                first = await _first_chunk(r)  # generated before the pause: the chunk is on its way
                assert first["meta_info"]["finish_reason"] is None and 1 <= len(first["output_ids"]) < 220
                assert first["meta_info"]["id"] == rid
            # the response was closed mid-stream and its connection with it, while the request is frozen

            async def gone() -> bool:
                return await in_flight(http) == (0, 0)

            await poll(gone, what="the hung-up stream's running request aborted")
            r = await http.post("/abort_request", json={"rid": rid})
            assert r.status_code == 404, r.text
            return
        finally:
            await http.post("/continue_generation", json={})
    raise AssertionError("could not freeze a streamed request mid-generation in 5 attempts")


@pytest.mark.parametrize("payload,needle", [
    ({"input_ids": [10**6]}, "outside the vocabulary"),
    ({"text": ""}, "empty"),
    ({"text": "hi", "sampling_params": {"stream_interval": 0}}, "stream_interval"),
])
async def test_a_bad_streaming_request_is_a_plain_400(http, payload, needle) -> None:
    async with http.stream("POST", "/generate", json={**payload, "stream": True}) as r:
        raw = await r.aread()
        assert r.status_code == 400, raw
        assert r.headers["content-type"].startswith("application/json")
    assert not raw.startswith(b"data:")
    assert needle in json.loads(raw)["error"]["message"]


# ---------------------------------------------------------------------- Relax's own client


async def test_engine_client_generate_stream_round_trip_and_engine_death(engine, http, prompt_ids, tiny_preset,
                                                                          start_engine) -> None:
    from relax.engines.client import EngineClient, EngineUnavailable
    from relax.engines.event_stream import EventStream

    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0, "stream_interval": 2}
    async with EngineClient(engine.url, timeout=30) as client:
        held = EventStream()
        final = await client.generate_stream(held, input_ids=prompt_ids, sampling_params=params, rid="client-rt",
                                             return_logprob=True)
    assert held.done and held.chunks >= 2
    assert final == held.latest()
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert final["meta_info"]["id"] == "client-rt"
    plain = (await http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": params,
                                                "return_logprob": True})).json()
    assert final["output_ids"] == plain["output_ids"] and set(final["meta_info"]) == set(plain["meta_info"])

    # An engine SIGKILLed mid-stream: the caller gets EngineUnavailable and holds a consistent prefix.
    doomed = start_engine(tiny_preset.model_dir)
    assert os.getpgid(doomed.pid) == doomed.pid  # its own process group: killpg reaches the whole server
    async with EngineClient(doomed.url, timeout=30) as client, \
            httpx.AsyncClient(base_url=doomed.url, timeout=30, trust_env=False) as control:
        held = EventStream()
        task = asyncio.create_task(client.generate_stream(
            held, input_ids=prompt_ids, return_logprob=True,
            sampling_params={"max_new_tokens": 220, "ignore_eos": True, "stream_interval": 1}))

        async def some_chunks() -> bool:
            assert not task.done(), task
            return held.chunks >= 3

        await poll(some_chunks, what="three chunks streamed")
        await control.post("/pause_generation", json={"mode": "in_place"})  # unfinished when it dies
        os.killpg(doomed.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(task, timeout=15)
    prefix = held.latest()
    assert prefix is not None and not held.done
    ids, meta = prefix["output_ids"], prefix["meta_info"]
    assert 0 < len(ids) < 220 and meta["finish_reason"] is None
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == ids
    assert meta["completion_tokens"] == len(ids)
