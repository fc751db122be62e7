"""What Relax's vLLM backend builds on, held against the real vLLM 0.32 on this CPU (tests/vllm/conftest.py).

Each test pins one behaviour the backend depends on or must defend against: that ``--uds`` takes the HTTP routes
off TCP; that ``--api-key`` guards generation but not the control routes (so vLLM must never be reachable by
others); the token route's answer and stream with per-token weight versions; a version set while paused
labelling what follows, and splitting the versions of a request in flight; and that a closed stream or a pause
in ``abort`` mode ends the requests in flight.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from relax.demo.elastic import wait_until
from relax.engines.loadgen import scrape_metrics
from tests.vllm.conftest import GENERATION_KEY, VllmServer

pytestmark = pytest.mark.timeout(400)  # the session's server starts inside the first test: ~1 min, more under load

GEN = {"Authorization": f"Bearer {GENERATION_KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(vllm_server: VllmServer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vllm_server.model_dir))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def generate(client: httpx.Client, ids: list[int], max_tokens: int, **sampling: Any) -> dict:
    answer = client.post("/inference/v1/generate", headers=GEN, json={
        "token_ids": ids, "sampling_params": {"max_tokens": max_tokens, "temperature": 0, **sampling}})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Server-sent events of the token route: each ``data:`` line's JSON, then the closing ``[DONE]``."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def metric(client: httpx.Client, name: str) -> float:
    """A vLLM series of one sample (this server has one engine), read with Prometheus's own parser."""
    return scrape_metrics(client.get("/metrics").text)[name]


def vllm_stream(client: httpx.Client, ids: list[int], max_tokens: int = 900):
    return client.stream("POST", "/inference/v1/generate", headers=GEN, json={
        "token_ids": ids, "stream": True,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})


def test_with_uds_http_is_on_the_socket_only_and_the_rest_on_loopback(vllm_server: VllmServer,
                                                                      vllm: httpx.Client) -> None:
    """``--uds`` takes vLLM's HTTP routes off TCP; its worker still listens on loopback TCP ports (gloo's sockets
    for its world-size-1 groups: 13 seen), which other local users could reach but which carry no HTTP route."""
    group = vllm_server.group()
    assert len(group) >= 3, group  # the API server, its engine core, the worker
    listening = {(p.pid, c.laddr.ip) for p in group for c in p.net_connections(kind="inet") if c.status == "LISTEN"}
    assert {ip for _, ip in listening} <= {"127.0.0.1"}
    assert vllm_server.proc.pid not in {pid for pid, _ in listening}  # the HTTP server: on its socket only
    assert vllm_server.socket.parent.stat().st_mode & 0o777 == 0o700  # vLLM leaves the socket's mode to umask
    assert vllm.get("/health").status_code == 200


def test_the_api_key_guards_generation_but_not_pause_or_resume(vllm: httpx.Client, prompt_ids: list[int]) -> None:
    """Why the backend keeps vLLM off TCP: anyone who reaches the port can pause it (and load weights)."""
    refused = vllm.post("/inference/v1/generate", json={"token_ids": prompt_ids, "sampling_params": {"max_tokens": 1}})
    assert refused.status_code == 401
    assert vllm.post("/pause", params={"mode": "keep"}).status_code == 200  # no key at all
    assert vllm.get("/is_paused").json() == {"is_paused": True}
    assert vllm.post("/resume").status_code == 200
    assert vllm.get("/is_paused").json() == {"is_paused": False}


def test_the_token_route_answers_greedily_with_eos_and_versions(vllm: httpx.Client, prompt_ids: list[int],
                                                                 tokenizer: Any) -> None:
    choice = generate(vllm, prompt_ids, 32)
    ids = choice["token_ids"]
    assert "Paris" in tokenizer.decode(ids, skip_special_tokens=True)
    if choice["finish_reason"] == "stop":
        assert ids[-1] == tokenizer.eos_token_id  # the EOS is part of the answer's tokens
    else:
        assert choice["finish_reason"] == "length" and len(ids) == 32
    spans = choice["weight_versions"]
    assert [(s["start"], s["end"]) for s in spans] == [(0, len(ids))]  # one version covers every token
    # the same prompt streamed: the same tokens, one chunk at a time; the finish reason and the versions only on
    # the last chunk, then [DONE]
    with vllm.stream("POST", "/inference/v1/generate", headers=GEN, json={
            "token_ids": prompt_ids, "stream": True, "sampling_params": {"max_tokens": 32, "temperature": 0}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        chunks = list(events(s.iter_lines()))
    assert chunks[-1] == "[DONE]"
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert [t for c in choices for t in c["token_ids"]] == ids
    assert all(c["finish_reason"] is None and c["weight_versions"] is None for c in choices[:-1])
    assert choices[-1]["finish_reason"] == choice["finish_reason"] and choices[-1]["weight_versions"] == spans


def test_a_version_set_while_paused_labels_the_tokens_generated_after(vllm: httpx.Client,
                                                                      prompt_ids: list[int]) -> None:
    assert vllm.post("/pause", params={"mode": "keep"}).status_code == 200
    answer = vllm.post("/update_weight_version", json={"new_version": "7"})
    assert answer.status_code == 200, answer.text
    assert vllm.post("/resume").status_code == 200
    choice = generate(vllm, prompt_ids, 4)
    assert choice["weight_versions"] == [{"version": "7", "start": 0, "end": len(choice["token_ids"])}]


def test_a_request_across_a_paused_version_change_reports_both_versions(vllm: httpx.Client,
                                                                         prompt_ids: list[int]) -> None:
    """What per-token versions across a refit rest on: a request in flight when the engine is paused (``keep``)
    and relabelled goes on after the resume, and its spans split where the pause fell."""
    seen: list[dict] = []
    five = threading.Event()

    def stream() -> None:
        with vllm_stream(vllm, prompt_ids, max_tokens=120) as s:
            for event in events(s.iter_lines()):
                if isinstance(event, dict):
                    seen.append(event["choices"][0])
                    if len(seen) >= 5:
                        five.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert five.wait(120), "fewer than five chunks"
    assert vllm.post("/pause", params={"mode": "keep"}).status_code == 200
    assert vllm.post("/update_weight_version", json={"new_version": "9"}).status_code == 200
    assert vllm.post("/resume").status_code == 200
    reader.join(240)
    assert not reader.is_alive()
    tokens = [t for c in seen for t in c["token_ids"]]
    assert len(tokens) == 120 and seen[-1]["finish_reason"] == "length"
    spans = seen[-1]["weight_versions"]
    assert len(spans) >= 2 and spans[-1]["version"] == "9" and spans[0]["version"] != "9", spans
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 120
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))
    assert 5 <= spans[0]["end"] < 120  # the tokens streamed before the pause kept the old version


def test_closing_a_stream_aborts_its_request(vllm: httpx.Client, prompt_ids: list[int]) -> None:
    """The client going is the abort: nothing more is generated for it. vLLM does not count such a request in
    ``vllm:request_success_total{finished_reason="abort"}`` (seen: 0), so a backend cannot read aborts from it."""
    generated = metric(vllm, "vllm:generation_tokens_total")
    with vllm.stream("POST", "/inference/v1/generate", headers=GEN, json={
            "token_ids": prompt_ids, "stream": True,
            "sampling_params": {"max_tokens": 900, "temperature": 0, "ignore_eos": True}}) as s:
        first = next(e for e in events(s.iter_lines()) if isinstance(e, dict))
        assert first["choices"][0]["token_ids"]
    wait_until(lambda: metric(vllm, "vllm:num_requests_running") == 0, 120, "the closed stream's request to end",
               poll_s=0.2)
    # had it run on, its 900 tokens would all be counted before it left the running set
    assert metric(vllm, "vllm:generation_tokens_total") - generated < 100


def test_a_pause_in_abort_mode_ends_a_stream_with_its_partial_output(vllm: httpx.Client,
                                                                      prompt_ids: list[int]) -> None:
    seen: list[dict] = []
    started = threading.Event()

    def stream() -> None:
        with vllm_stream(vllm, prompt_ids) as s:
            for event in events(s.iter_lines()):
                if isinstance(event, dict):
                    seen.append(event["choices"][0])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(120), "no first chunk"
    assert vllm.post("/pause", params={"mode": "abort"}).status_code == 200
    reader.join(120)
    assert not reader.is_alive()
    assert vllm.post("/resume").status_code == 200
    tokens = [t for c in seen for t in c["token_ids"]]
    assert seen[-1]["finish_reason"] == "abort" and 0 < len(tokens) < 900
    assert seen[-1]["weight_versions"] and seen[-1]["weight_versions"][-1]["end"] == len(tokens)
