"""Relax's vLLM front (relax.engines.vllm.front) in front of the real vLLM 0.32 of this session.

The front is the only way to a vLLM engine: these tests hold that Relax's own engine client generates through
it as from any engine (greedy tokens equal to vLLM's token route, streamed prefixes Relax's reader keeps, per-token
versions across a refit's pause), and that without the admin key nobody pauses vLLM, relabels its weights or
reaches a route the front does not serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from relax.cluster.network import free_port
from relax.engines.client import EngineClient
from relax.engines.event_stream import EventStream
from relax.engines.keys import is_admin_route
from tests.vllm.conftest import STARTUP_TIMEOUT_S, vllm_interpreter
from tests.vllm.test_contract import QUESTION

pytestmark = pytest.mark.timeout(400)

FRONT_KEY, FRONT_ADMIN_KEY = "front-generation-key", "front-admin-key"


@dataclass
class Front:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self) -> EngineClient:
        return EngineClient(self.url, token=FRONT_KEY, admin_token=FRONT_ADMIN_KEY, timeout=120)

    def vllm(self) -> psutil.Process:
        """The vLLM API server the front started."""
        (server,) = [p for p in psutil.Process(self.proc.pid).children()
                     if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
        return server


@pytest.fixture(scope="module")
def front(smollm2_preset, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """``python -m relax.engines.vllm`` as an engine runs it: the front starts its own vLLM (CPU choices its own,
    plus the small context and batch of these tests after ``--``)."""
    port, log = free_port(), tmp_path_factory.mktemp("front") / "front.log"
    env = {**os.environ, "RELAX_ENGINE_API_KEY": FRONT_KEY, "RELAX_ENGINE_ADMIN_API_KEY": FRONT_ADMIN_KEY,
           "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "relax.engines.vllm", "--port", str(port), "--vllm-python",
                                 vllm_interpreter(), "--model-path", str(smollm2_preset.model_dir), "--",
                                 "--max-model-len", "1024", "--max-num-seqs", "8"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    front = Front(proc, f"http://127.0.0.1:{port}", log)
    vllm_family: list[psutil.Process] = []
    workdir = ""
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # a start with no event to wait on: the port answers or it does not
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{front.url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        server = front.vllm()
        vllm_family = [server, *server.children(recursive=True)]
        workdir = str(Path(_uds(server)).parent)
        assert os.stat(workdir).st_mode & 0o777 == 0o700  # nobody else reaches vLLM's socket
        yield front
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    # keys never in argv (the front's or vLLM's); the stop is clean: vLLM's processes and directory gone
    args = " ".join(proc.args) + " ".join(" ".join(p.cmdline()) for p in vllm_family if p.is_running())
    assert FRONT_KEY not in args and FRONT_ADMIN_KEY not in args
    assert code in (0, -signal.SIGTERM), log.read_text()[-3000:]  # uvicorn re-raises the SIGTERM it handled
    assert [p for p in vllm_family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert workdir and not os.path.exists(workdir)


def _uds(server: psutil.Process) -> str:
    argv = server.cmdline()
    return argv[argv.index("--uds") + 1]


@pytest.fixture(scope="module")
def vllm(front: Front) -> Iterator[httpx.Client]:
    """vLLM itself, behind the front: through its socket with the key the front gave it (from its environment)."""
    server = front.vllm()
    key = server.environ()["VLLM_API_KEY"]
    with httpx.Client(transport=httpx.HTTPTransport(uds=_uds(server)), base_url="http://vllm", timeout=120,
                      trust_env=False, headers={"Authorization": f"Bearer {key}"}) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(smollm2_preset) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_preset.model_dir))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def vllm_generate(client: httpx.Client, ids: list[int], max_tokens: int) -> dict:
    """vLLM's own greedy answer on its token route (the front's key-free way in)."""
    answer = client.post("/inference/v1/generate", json={
        "token_ids": ids, "sampling_params": {"max_tokens": max_tokens, "temperature": 0}})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_relax_client_generates_through_the_front_as_vllm_answers(front: Front, vllm: httpx.Client,
                                                                  prompt_ids: list[int]) -> None:
    direct = vllm_generate(vllm, prompt_ids, 24)
    sampling = {"max_new_tokens": 24, "temperature": 0}

    async def both() -> tuple[dict, dict, EventStream]:
        async with front.client() as client:
            answer = await client.generate(input_ids=prompt_ids, sampling_params=sampling, return_logprob=True,
                                           rid="front-1")
            held = EventStream()
            streamed = await client.generate_stream(held, input_ids=prompt_ids, sampling_params=sampling,
                                                    return_logprob=True, rid="front-2")
            return answer, streamed, held

    answer, streamed, held = _run(both())
    ids = direct["token_ids"]
    assert answer["output_ids"] == ids and streamed["output_ids"] == ids
    assert "Paris" in answer["text"] and answer["text"] == streamed["text"]
    meta = answer["meta_info"]
    assert meta["id"] == "front-1" and meta["completion_tokens"] == len(ids)
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": len(ids)}]  # the front's label
    assert len(meta["output_token_logprobs"]) == len(ids) and all(lp <= 0 for lp, *_ in meta["output_token_logprobs"])
    if direct["finish_reason"] == "stop":
        assert meta["finish_reason"] == {"type": "stop", "matched": ids[-1]}
    else:
        assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert held.chunks >= len(ids)  # one cumulative chunk a token, of which the reader kept only the newest
    # what vLLM would silently ignore is refused by name
    refused = httpx.post(f"{front.url}/generate", timeout=30, trust_env=False,
                         headers={"Authorization": f"Bearer {FRONT_KEY}"},
                         json={"input_ids": prompt_ids, "sampling_params": {"max_tokens": 4}})
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]
    # a body that is not JSON, and what vLLM itself refuses (a token id past the vocabulary): one line each
    gen = {"Authorization": f"Bearer {FRONT_KEY}"}
    garbled = httpx.post(f"{front.url}/generate", content=b"{", headers=gen, timeout=30, trust_env=False)
    assert garbled.status_code == 400 and garbled.json()["error"]["message"] == "the body is not JSON"
    past = httpx.post(f"{front.url}/generate", headers=gen, timeout=30, trust_env=False,
                      json={"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}})
    assert past.status_code == 400 and past.json()["error"]["message"].startswith("vLLM answered 400: "), past.text
    none = httpx.post(f"{front.url}/pause_generation", json={"mode": "none"}, timeout=30, trust_env=False,
                      headers={"Authorization": f"Bearer {FRONT_ADMIN_KEY}"})
    assert none.status_code == 400 and "abort, retract, in_place" in none.json()["error"]["message"]


@pytest.mark.parametrize("key", [None, FRONT_KEY], ids=["no key", "generation key"])
def test_without_the_admin_key_nobody_pauses_relabels_or_reaches_vllm(front: Front, vllm: httpx.Client,
                                                                       key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=front.url, headers=headers, timeout=30, trust_env=False) as client:
        for path, body in [("/pause_generation", {"mode": "in_place"}), ("/update_weight_version",
                                                                          {"new_version": "666"}),
                           ("/abort_request", {"abort_all": True}), ("/continue_generation", {})]:
            assert client.post(path, json=body).status_code == 401, path
        # vLLM's own open routes are not the front's: refused without a key (and SGLang's control routes without
        # the admin key), unknown with the generation key
        for path in ("/pause", "/resume", "/collective_rpc", "/init_weight_transfer_engine", "/start_weight_update",
                     "/update_weights", "/update_weights_from_disk", "/abort_requests"):
            assert client.post(path, json={}).status_code == (401 if key is None or is_admin_route(path) else 404), path
    assert httpx.get(f"{front.url}/get_weight_version", headers={"Authorization": f"Bearer {FRONT_KEY}"},
                     timeout=30, trust_env=False).json()["weight_version"] == "0"
    assert vllm.get("/is_paused").json() == {"is_paused": False}
    # the admin key opens control and nothing else: it does not generate (SGLang's rule)
    admin = {"Authorization": f"Bearer {FRONT_ADMIN_KEY}"}
    assert httpx.post(f"{front.url}/generate", headers=admin, json={"input_ids": [1]}, timeout=30,
                      trust_env=False).status_code == 401


def test_a_stream_across_a_paused_relabel_reports_both_versions(front: Front, vllm: httpx.Client,
                                                                prompt_ids: list[int]) -> None:
    """A refit's pause in place through the front: the prefix before the relabel keeps its label, later tokens
    take the new one, and the last chunk carries vLLM's own spans, which agree."""
    body = {"input_ids": prompt_ids, "stream": True, "rid": "across",
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    gen = {"Authorization": f"Bearer {FRONT_KEY}"}
    chunks: list[dict] = []
    with httpx.Client(base_url=front.url, timeout=120, trust_env=False) as client:
        admin = {"Authorization": f"Bearer {FRONT_ADMIN_KEY}"}
        try:
            with client.stream("POST", "/generate", json=body, headers=gen) as stream:
                lines = stream.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks[-1]["output_ids"]) >= 8:
                            break
                assert client.post("/pause_generation", json={"mode": "in_place"}, headers=admin).status_code == 200
                assert vllm.get("/is_paused").json() == {"is_paused": True}
                assert client.post("/update_weight_version", json={"new_version": "5"},
                                   headers=admin).json()["new_version"] == "5"
                assert client.post("/continue_generation", json={}, headers=admin).status_code == 200
                for line in lines:
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
        finally:
            client.post("/update_weight_version", json={"new_version": "0"}, headers=admin)
    final = chunks[-1]
    assert len(final["output_ids"]) == 400 and final["meta_info"]["finish_reason"]["type"] == "length"
    spans = final["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "5"] and spans[0]["start"] == 0 and spans[-1]["end"] == 400
    assert spans[0]["end"] >= 8  # the tokens streamed before the pause are the old version's
    # every chunk is cumulative: each extends the one before
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    # a prefix held before the finish labels its tokens as the final spans do
    held = chunks[-2]["meta_info"]["weight_versions"]
    assert held[0]["version"] == "0" and held[-1]["version"] == "5"


def test_a_stop_while_vllm_starts_leaves_nothing(smollm2_preset) -> None:
    """SIGTERM to the front while its vLLM is still loading: the front ends the start, stops vLLM's processes and
    removes its directory (the first vLLM child seen is enough: the stop collects its family then)."""
    proc = subprocess.Popen([sys.executable, "-m", "relax.engines.vllm", "--port", str(free_port()), "--vllm-python",
                             vllm_interpreter(), "--model-path", str(smollm2_preset.model_dir), "--",
                             "--max-model-len", "1024", "--max-num-seqs", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    front = Front(proc, "", Path())
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not family:  # vLLM's engine core started: the API server is mid-start
            assert proc.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(ValueError, psutil.Error):
                server = front.vllm()
                family = [server, *server.children(recursive=True)] if server.children() else []
            time.sleep(0.2)
        workdir = Path(_uds(family[0])).parent
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert "stopped while vLLM was starting" in output
    assert [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == [], output[-2000:]
    assert not workdir.exists()
