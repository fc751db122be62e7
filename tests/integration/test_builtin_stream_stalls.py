"""Streaming clients that stop reading, over real HTTP on 127.0.0.1 against the real built-in engine.

A stalled client is a raw socket with a small receive buffer that sends its request and never reads. On
loopback the server's send buffer grows to megabytes (up to ``tcp_wmem``'s maximum, 4 MiB here), so a stream
only waits for its client once it produced more than that: the streams below ask for ``n`` samples with
log-probabilities, one chunk per token.

* a stream gives its slot in the update lock back when its generation ends inside the engine, so an unpaused
  weight load does not wait for bytes a client does not read (an engine whose stall check is off shows it);
* a stream whose client read nothing for the stall bound is aborted in the engine, logged with its rid, and its
  connection reset (frozen mid-generation by an in-place pause, its requests can leave only that way);
* the measured case: stalled streams, then an unpaused load, which finishes within the bound plus a margin.

``/server_info``'s ``stream_writes_waiting`` (writes waiting for their client now) shows that a stream really
waits on its client, rather than having fitted in the buffers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.engine_http import engine_metrics, in_flight, poll

STALL_BOUND_S = 1.5  # the stall engine's RELAX_ENGINE_STREAM_STALL_TIMEOUT
MARGIN_S = 30.0  # generous: a loaded 2-core machine; the point is "bounded", not "fast"
SAMPLES = 32  # n of each stalled stream: many megabytes of chunks
MAX_NEW = 220  # the tiny model's context is 256
# The tests read /metrics between engine steps, as fast as the run's own callers do: with the engine's key, so
# the pace of anonymous callers (relax.pace) does not hold those reads back.
KEY = "stall-test-engine-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stall_engine(tiny_preset, start_engine):
    return start_engine(tiny_preset.model_dir, max_running_requests=2 * SAMPLES,
                        env={"RELAX_ENGINE_STREAM_STALL_TIMEOUT": str(STALL_BOUND_S), "RELAX_ENGINE_API_KEY": KEY})


@pytest.fixture(scope="module")
def prompt_ids(tiny_preset) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))
    return tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                   return_dict=False)


def _stream_body(prompt_ids: list[int], rid: str) -> dict[str, Any]:
    return {"input_ids": prompt_ids, "rid": rid, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "n": SAMPLES, "stream_interval": 1}}


def _stalled_stream(url: str, body: dict[str, Any]) -> socket.socket:
    """Send a streaming /generate and never read: a client that stopped reading."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window is agreed then
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (host.encode(), KEY.encode(), len(payload), payload))
    return sock


def _read_to_end(sock: socket.socket, timeout: float = 60.0) -> tuple[bytes, bool]:
    """Everything the server still sends; (bytes, whether the connection was reset)."""
    sock.settimeout(timeout)
    received = bytearray()
    try:
        while data := sock.recv(1 << 20):
            received += data
    except ConnectionResetError:
        return bytes(received), True
    return bytes(received), False


def _event_stream(raw: bytes) -> bytes:
    """The server-sent events of a raw HTTP/1.1 response (its body, chunked transfer encoding undone)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    events, at = bytearray(), 0
    while (end := body.find(b"\r\n", at)) >= 0 and (size := int(body[at:end], 16)):
        events += body[end + 2:end + 2 + size]
        at = end + 2 + size + 2
    return bytes(events)


async def _queue_paused(http: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]]) -> list[socket.socket]:
    """Pause in place, open a stalled stream per body and wait until all their requests are queued (paused)."""
    await http.post("/pause_generation", json={"mode": "in_place"})
    socks = [_stalled_stream(url, body) for body in bodies]

    async def queued() -> bool:
        return await in_flight(http) == (0, SAMPLES * len(bodies))

    await poll(queued, timeout=30.0, what="the stalled streams' requests queued")
    return socks


async def _load_unpaused(http: httpx.AsyncClient, model_dir: Path) -> float:
    began = time.monotonic()
    r = await http.post("/update_weights_from_disk", json={"model_path": str(model_dir)},
                        timeout=STALL_BOUND_S + MARGIN_S)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    return time.monotonic() - began


async def _generate_works(http: httpx.AsyncClient, prompt_ids: list[int]) -> None:
    r = await http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 4}},
                        timeout=MARGIN_S)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text


def _close(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


# ---------------------------------------------------------------------- the measured case


async def test_stalled_streams_do_not_hold_an_unpaused_weight_load(stall_engine, prompt_ids, tiny_preset) -> None:
    async with httpx.AsyncClient(base_url=stall_engine.url, timeout=30, trust_env=False, headers=AUTH) as http:
        bodies = [_stream_body(prompt_ids, f"held-{i}") for i in range(2)]
        socks = await _queue_paused(http, stall_engine.url, bodies)
        try:
            await http.post("/continue_generation", json={})
            # unpaused: it takes the writer lock, so it waits for every stream that holds a reader's slot
            took = await _load_unpaused(http, tiny_preset.model_dir)
            assert took < STALL_BOUND_S + MARGIN_S
            await _generate_works(http, prompt_ids)
        finally:
            await http.post("/continue_generation", json={})
            _close(socks)


# ---------------------------------------------------------------------- the slot goes back with the generation


async def test_a_stream_gives_its_slot_back_when_its_generation_ends(tiny_preset, start_engine, prompt_ids) -> None:
    """The stall check off (0): only the generation's end can give the slot back; the streams survive intact."""
    patient = start_engine(tiny_preset.model_dir, max_running_requests=2 * SAMPLES,
                           env={"RELAX_ENGINE_STREAM_STALL_TIMEOUT": "0", "RELAX_ENGINE_API_KEY": KEY})
    async with httpx.AsyncClient(base_url=patient.url, timeout=30, trust_env=False, headers=AUTH) as http:
        assert (await http.get("/server_info")).json()["stream_stall_timeout"] == 0
        bodies = [_stream_body(prompt_ids, f"patient-{i}") for i in range(2)]
        socks = await _queue_paused(http, patient.url, bodies)
        try:
            await http.post("/continue_generation", json={})

            async def generated() -> bool:
                return await in_flight(http) == (0, 0)

            await poll(generated, timeout=MARGIN_S, what="the streams' generations done in the engine")

            async def blocked() -> bool:  # what makes this a test: both streams still wait on their clients
                return (await http.get("/server_info")).json()["stream_writes_waiting"] == len(socks)

            await poll(blocked, timeout=30.0, what="both streams' writes waiting for their clients")
            await _load_unpaused(http, tiny_preset.model_dir)  # before the fix: forever (nobody reads)
            await _generate_works(http, prompt_ids)
            for sock in socks:  # the client reads at last: every chunk is there, the stream ends as usual
                raw, reset = await asyncio.to_thread(_read_to_end, sock)
                assert not reset and raw.endswith(b"\r\n0\r\n\r\n"), raw[-300:]  # the response's last chunk
                events = _event_stream(raw)
                assert events.endswith(b"data: [DONE]\n\n"), events[-300:]
                finals = [json.loads(line[len(b"data: "):]) for line in events.split(b"\n")
                          if line.startswith(b"data: {") and b'"finish_reason":{' in line]
                assert sorted(f["index"] for f in finals) == list(range(SAMPLES))
                assert all(f["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW} for f in finals)
            info = (await http.get("/server_info")).json()
            assert info["stream_writes_waiting"] == 0 and info["streams_stalled"] == 0
        finally:
            await http.post("/continue_generation", json={})
            _close(socks)


# ---------------------------------------------------------------------- a stalled stream is aborted


async def _freeze_mid_generation(http: httpx.AsyncClient, url: str, prompt_ids: list[int], rid: str,
                                 min_tokens: int) -> socket.socket | None:
    """A stalled stream whose requests all run with at least ``min_tokens`` generated, frozen there (paused in
    place); None when they finished first (a loaded machine ran many steps in one round trip): try again."""
    (sock,) = await _queue_paused(http, url, [_stream_body(prompt_ids, rid)])
    want_used = SAMPLES * (len(prompt_ids) + min_tokens)
    while True:  # let the engine run one HTTP round trip at a time
        await http.post("/continue_generation", json={})
        await http.post("/pause_generation", json={"mode": "in_place"})
        m = await engine_metrics(http)
        running, queued = m["sglang:num_running_reqs"], m["sglang:num_queue_reqs"]
        if running + queued < SAMPLES:
            sock.close()
            return None
        if running == SAMPLES and m["sglang:num_used_tokens"] >= want_used:
            return sock


async def test_a_stalled_stream_is_aborted_logged_and_its_connection_reset(stall_engine, prompt_ids,
                                                                            tiny_preset) -> None:
    async with httpx.AsyncClient(base_url=stall_engine.url, timeout=30, trust_env=False, headers=AUTH) as http:
        stalled_before = (await http.get("/server_info")).json()["streams_stalled"]
        try:
            for attempt in range(5):
                rid = f"stalled-{attempt}"
                sock = await _freeze_mid_generation(http, stall_engine.url, prompt_ids, rid, min_tokens=150)
                if sock is not None:
                    break
                await http.post("/continue_generation", json={})
            else:
                raise AssertionError("could not freeze a stalled stream mid-generation in 5 attempts")
            try:
                # frozen, its requests cannot finish: they leave only when the stall aborts them
                async def aborted() -> bool:
                    return await in_flight(http) == (0, 0)

                await poll(aborted, timeout=STALL_BOUND_S + MARGIN_S, what="the stalled stream aborted")
                # the connection is closed (reset; or, should the reset come late, ended): the read returns
                raw, _ = await asyncio.to_thread(_read_to_end, sock)
                assert b"data: [DONE]" not in raw
            finally:
                sock.close()
            lines = [line for line in Path(stall_engine.spec.log_path).read_text().splitlines()
                     if "stalled" in line]
            mine = [line for line in lines if f"stream {rid} stalled" in line]
            assert len(mine) == 1, lines
            assert f"aborted {rid}" in mine[0] and "connection closed" in mine[0], mine
            # an attempt that did not freeze closed its socket unread, and its stream may have stalled as well
            # (before this one was aborted, as in_flight counts every request): one count per logged stall
            tried = [line for line in lines if any(f"stream stalled-{k} stalled" in line for k in range(attempt + 1))]
            info = (await http.get("/server_info")).json()
            assert info["streams_stalled"] == stalled_before + len(tried) and info["stream_writes_waiting"] == 0
        finally:
            await http.post("/continue_generation", json={})
        await _generate_works(http, prompt_ids)
        assert await _load_unpaused(http, tiny_preset.model_dir) < MARGIN_S
