"""The built-in engine over real HTTP on 127.0.0.1, serving the real tiny preset model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def engine(tiny_preset, start_engine):
    return start_engine(tiny_preset.model_dir, max_running_requests=4)


@pytest.fixture(scope="module")
def tokenizer(tiny_preset):
    return AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))


@pytest.fixture(scope="module")
def prompt_text(tokenizer) -> str:
    return tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)


@pytest.fixture
def served_as() -> tuple[str, torch.dtype | None]:
    """How this engine holds the checkpoint (layout, dtype): what its /weights_checker checksums are of."""
    return "hf", None


@pytest.fixture
async def client(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=60, trust_env=False) as c:
        yield c


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels:
                out[s.name] = s.value
    return out


async def _poll(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():  # type: ignore[misc]
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met before the deadline")


async def _freeze_running(client: httpx.AsyncClient, bodies: list[dict], attempts: int = 5) -> list[asyncio.Task]:
    """Start the requests, wait until all of them run, and freeze the batch there (pause in place).

    A 220-token request can finish on a busy machine between seeing it run and pausing; then the
    precondition did not hold, so let that round finish and start again. Callers must continue_generation.
    """
    for _ in range(attempts):
        tasks = [asyncio.create_task(client.post("/generate", json=body)) for body in bodies]

        async def all_running_or_one_done(tasks: list[asyncio.Task] = tasks) -> bool:
            running = (await _metrics(client))["sglang:num_running_reqs"]
            return running >= len(bodies) or any(t.done() for t in tasks)

        await _poll(all_running_or_one_done)
        await client.post("/pause_generation", json={"mode": "in_place"})
        frozen = (await _metrics(client))["sglang:num_running_reqs"]
        if frozen == len(bodies) and not any(t.done() for t in tasks):
            return tasks
        await client.post("/continue_generation")
        await asyncio.gather(*tasks)
    raise AssertionError(f"could not catch {len(bodies)} request(s) running in {attempts} attempts")


def teacher_forced_logprobs(model_dir: Path, prompt_ids: list[int], output_ids: list[int], temperature: float):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    n = len(prompt_ids)
    return [logprobs[n - 1 + j, tok].item() for j, tok in enumerate(output_ids)]


# ---------------------------------------------------------------------- generate


async def test_generate_from_text_returns_sglang_shape(client, prompt_text) -> None:
    r = await client.post("/generate", json={"text": prompt_text, "sampling_params": {"max_new_tokens": 16},
                                             "rid": "shape-1"})
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] == len(body["output_ids"]) > 0
    assert meta["weight_version"] == "0"
    assert "output_token_logprobs" not in meta
    assert isinstance(body["text"], str)


async def test_generate_from_input_ids_with_n_and_batch(client, tokenizer, prompt_text) -> None:
    ids = tokenizer.encode(prompt_text)
    r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "n": 3}})
    outs = r.json()
    assert r.status_code == 200 and isinstance(outs, list) and len(outs) == 3
    assert all(o["meta_info"]["prompt_tokens"] == len(ids) for o in outs)
    r = await client.post("/generate", json={"text": [prompt_text, "hello"], "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and len(r.json()) == 2


async def test_greedy_is_deterministic_and_stop_strings_trim(client, prompt_text) -> None:
    params = {"max_new_tokens": 16, "temperature": 0.0}
    a = (await client.post("/generate", json={"text": prompt_text, "sampling_params": params})).json()
    b = (await client.post("/generate", json={"text": prompt_text, "sampling_params": params})).json()
    assert a["output_ids"] == b["output_ids"]
    assert a["text"].startswith("Answer:")
    r = (await client.post("/generate", json={"text": prompt_text, "sampling_params": {**params, "stop": [":"]}}))
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": ":"}
    assert body["text"] == "Answer"


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1)])
async def test_logprobs_match_teacher_forced_forward(client, tiny_preset, tokenizer, prompt_text,
                                                     temperature, top_p, top_k, logprob_tol) -> None:
    ids = tokenizer.encode(prompt_text)
    r = await client.post("/generate", json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                            "ignore_eos": True, "n": 4},
    })
    for out in r.json():
        pairs = out["meta_info"]["output_token_logprobs"]
        assert [tok for _, tok, _ in pairs] == out["output_ids"]
        expected = teacher_forced_logprobs(tiny_preset.model_dir, ids, out["output_ids"], temperature or 1.0)
        got = [lp for lp, _, _ in pairs]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < logprob_tol


async def test_requests_joining_a_running_batch_keep_exact_logprobs(client, tiny_preset, tokenizer,
                                                                    logprob_tol) -> None:
    """Newcomers are encoded alone and merged into the running batch's cache (padding aligned and masked):
    the running request and every joiner must still see exactly the teacher-forced distribution."""
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         return_dict=False)
           for content in ("What is 3 + 4?", "Add 9 and 8, then say the answer twice please.", "1 + 1?")]
    await check_joiners_logprobs(client, tiny_preset.model_dir, ids, max_new_tokens=40, first_tokens=120,
                                 temperature=1.0, tol=logprob_tol)


async def check_joiners_logprobs(client: httpx.AsyncClient, model_dir: Path, ids: list[list[int]], *,
                                 max_new_tokens: int, first_tokens: int, temperature: float,
                                 tol: float = 1e-4) -> None:
    """Freeze ``ids[0]`` mid-generation, queue the others so they join its cached batch, then check every
    request's log-probs against a teacher-forced forward (< ``tol``) and that the joiners had their own encode."""
    assert len({len(i) for i in ids}) > 1  # different prompt lengths: the merge must pad and align them
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
    before = (await client.get("/server_info")).json()["stats"]
    (first,) = await _freeze_running(client, [{
        "input_ids": ids[0], "return_logprob": True, "sampling_params": {**params, "max_new_tokens": first_tokens}}])
    try:  # the first request is frozen mid-generation with its cache: the others must join it
        joiners = [asyncio.create_task(client.post("/generate", json={
            "input_ids": i, "return_logprob": True, "sampling_params": params})) for i in ids[1:]]
        await _poll(lambda: _queued_at_least(client, len(joiners)))
    finally:
        await client.post("/continue_generation")
    outs = [(await t).json() for t in (first, *joiners)]
    after = (await client.get("/server_info")).json()["stats"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [first_tokens] + [max_new_tokens] * len(joiners)
    assert after["prefills"] - before["prefills"] >= 2  # the first one's prefill, then the joiners' own encode
    for prompt_ids, out in zip(ids, outs, strict=True):
        expected = teacher_forced_logprobs(model_dir, prompt_ids, out["output_ids"], temperature)
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < tol


async def _queued_at_least(client: httpx.AsyncClient, n: int) -> bool:
    return (await _metrics(client))["sglang:num_queue_reqs"] >= n


async def test_concurrent_requests_are_batched(client, engine, prompt_text) -> None:
    params = {"max_new_tokens": 32, "ignore_eos": True}
    before = (await client.get("/server_info")).json()["stats"]
    results = await asyncio.gather(*[
        client.post("/generate", json={"text": prompt_text, "sampling_params": params}) for _ in range(12)
    ])
    assert all(r.json()["meta_info"]["completion_tokens"] == 32 for r in results)
    after = (await client.get("/server_info")).json()["stats"]
    assert after["max_batch_size"] == 4  # the engine's --max-running-requests
    assert after["steps"] - before["steps"] < 12 * 32  # fewer forward steps than tokens

    # arriving together, 12 requests x 32 tokens take about 12 / 4 waves of 32 steps
    r = await client.post("/generate", json={"text": [prompt_text] * 12, "sampling_params": params})
    assert [o["meta_info"]["completion_tokens"] for o in r.json()] == [32] * 12
    final = (await client.get("/server_info")).json()["stats"]
    assert final["steps"] - after["steps"] <= 12 * 32 / 4 + 4


async def test_a_client_that_hangs_up_has_its_requests_aborted(engine, client, prompt_text) -> None:
    """SGLang aborts a request whose HTTP client disconnected; so must we, or a stopped load generator leaves
    its whole queue behind. Paused, nothing can finish: the queue empties only through the abort."""
    await client.post("/pause_generation", json={"mode": "in_place"})
    try:
        async with httpx.AsyncClient(base_url=engine.url, trust_env=False) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await asyncio.gather(*[impatient.post("/generate", timeout=1.0, json={
                    "text": prompt_text, "sampling_params": {"max_new_tokens": 50}}) for _ in range(3)])

        async def queue_emptied() -> bool:
            return (await _metrics(client))["sglang:num_queue_reqs"] == 0

        await _poll(queue_emptied, timeout=15)
    finally:
        await client.post("/continue_generation")
    after = await _metrics(client)
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0  # nothing left to run


async def test_queue_metrics_rise_under_load_and_empty_when_idle(client, prompt_text) -> None:
    before = await _metrics(client)
    params = {"max_new_tokens": 230, "ignore_eos": True}
    # Hold generation while the burst arrives, so the queue is there by construction, not by timing.
    await client.post("/pause_generation", json={"mode": "in_place"})
    try:
        load = asyncio.gather(*[
            client.post("/generate", json={"text": prompt_text, "sampling_params": params}) for _ in range(16)
        ])

        async def all_queued() -> bool:
            return (await _metrics(client))["sglang:num_queue_reqs"] == 16

        await _poll(all_queued)
    finally:
        await client.post("/continue_generation")
    seen: dict[str, float] = {}

    async def batch_full() -> bool:
        m = await _metrics(client)
        seen.update({k: max(v, seen.get(k, 0.0)) for k, v in m.items()})
        assert m["sglang:num_running_reqs"] <= 4
        return m["sglang:num_running_reqs"] == 4 and m["sglang:num_queue_reqs"] > 0

    await _poll(batch_full)  # four waves of four: the batch is full while the queue holds the rest
    assert seen["sglang:token_usage"] > 0 and seen["sglang:num_used_tokens"] > 0
    # a full batch was seen, so the step that filled it had already recorded its tokens in the window
    assert seen["sglang:gen_throughput"] > 0
    await load

    async def idle() -> bool:
        m = await _metrics(client)
        return m["sglang:num_queue_reqs"] == 0 and m["sglang:num_running_reqs"] == 0

    await _poll(idle)
    after = await _metrics(client)
    assert after["sglang:token_usage"] == 0
    for name in ("queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds"):
        key = f"sglang:{name}_count"
        assert after[key] - before.get(key, 0) >= 16
    assert after["sglang:inter_token_latency_seconds_count"] > before.get("sglang:inter_token_latency_seconds_count", 0)
    assert after["sglang:queue_time_seconds_sum"] > before.get("sglang:queue_time_seconds_sum", 0)


# ---------------------------------------------------------------------- control endpoints


async def test_health_info_and_cache_endpoints(client, tiny_preset) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).json() == {"status": "ok"}
    assert (await client.post("/flush_cache")).json()["success"] is True
    info = (await client.get("/server_info")).json()
    assert info["engine"] == "relax-builtin" and info["max_running_requests"] == 4
    assert info["model_impl"] == "auto" and info["served_by"] == "native"  # a Qwen3: the built-in decoder
    model = (await client.get("/model_info")).json()
    assert model["is_generation"] is True and model["model_path"] == str(tiny_preset.model_dir)
    assert (await client.get("/model_info")).json()["weight_version"] == "0"


async def test_abort_by_rid_and_all(client, prompt_text) -> None:
    params = {"max_new_tokens": 220, "ignore_eos": True}
    long_a, long_b = await _freeze_running(client, [
        {"text": prompt_text, "rid": "abort-a", "sampling_params": params},
        {"text": prompt_text, "rid": "abort-b", "sampling_params": params},
    ])
    try:
        r = await client.post("/abort_request", json={"rid": "abort-a"})
        assert r.status_code == 200 and r.json()["aborted"] == 1
        a = (await long_a).json()
        assert a["meta_info"]["finish_reason"]["type"] == "abort"
        assert a["meta_info"]["completion_tokens"] < 220
        r = await client.post("/abort_request", json={"abort_all": True})
        assert r.json()["aborted"] == 1
        assert (await long_b).json()["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        await client.post("/continue_generation")
    unknown = await client.post("/abort_request", json={"rid": "no-such-request"})
    assert unknown.status_code == 404 and "no-such-request" in unknown.json()["error"]["message"]


async def test_pause_in_place_holds_requests_until_continue(client, prompt_text) -> None:
    assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    try:
        task = asyncio.create_task(client.post("/generate", json={"text": prompt_text,
                                                                  "sampling_params": {"max_new_tokens": 4}}))

        async def queued() -> bool:
            return (await _metrics(client))["sglang:num_queue_reqs"] == 1

        await _poll(queued)
        assert not task.done()
        health = asyncio.create_task(client.get("/health"))  # as SGLang's: a generation, so it waits too
    finally:
        await client.post("/continue_generation")
    assert (await task).status_code == 200
    assert (await health).status_code == 200


async def test_health_fails_like_sglangs_while_generation_is_paused(tiny_preset, start_engine) -> None:
    """SGLang's /health runs a one-token generation and answers 503 when none comes within
    SGLANG_HEALTH_CHECK_TIMEOUT (20 s): a paused engine (or one loading behind the writer lock) looks
    unhealthy. The manager must know and not probe what it paused."""
    server = start_engine(tiny_preset.model_dir, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as http:
        assert (await http.get("/health")).status_code == 200
        await http.post("/pause_generation", json={"mode": "retract"})
        try:
            # right after a success: a paused engine is not answered for by that success
            r = await http.get("/health")
            assert r.status_code == 503 and "did not answer within 1s" in r.json()["error"]["message"]
            assert (await _metrics(http))["sglang:num_queue_reqs"] == 0  # the timed-out probe left no request
            # concurrent probes share the failing probe (sent together, they arrive well within its 1 s)
            before = (await http.get("/server_info")).json()["health_generations"]
            answers = await asyncio.gather(*(http.get("/health_generate") for _ in range(8)))
            assert [r.status_code for r in answers] == [503] * 8
            assert (await http.get("/server_info")).json()["health_generations"] - before <= 2  # not 8
        finally:
            await http.post("/continue_generation", json={})
        assert (await http.get("/health_generate")).status_code == 200  # a failure is not served again


async def test_concurrent_health_checks_share_one_probe_generation(client) -> None:
    """32 probers cost one generation: checks arriving while a probe runs wait for its outcome. Paused in place,
    the probe cannot answer, so every check arrives while it runs."""
    before = (await client.get("/server_info")).json()
    await client.post("/pause_generation", json={"mode": "in_place"})
    try:
        checks = [asyncio.create_task(client.get("/health_generate")) for _ in range(32)]

        async def all_arrived() -> bool:
            info = (await client.get("/server_info")).json()
            return info["health_checks"] - before["health_checks"] == 32

        await _poll(all_arrived)
        assert (await _metrics(client))["sglang:num_queue_reqs"] == 1  # one probe generation waits, not 32
        assert not any(c.done() for c in checks)
    finally:
        await client.post("/continue_generation")
    assert [r.status_code for r in await asyncio.gather(*checks)] == [200] * 32
    after = (await client.get("/server_info")).json()
    assert after["health_generations"] - before["health_generations"] == 1
    assert after["stats"]["finished_requests"] - before["stats"]["finished_requests"] == 1


async def test_pause_abort_mode_aborts_in_flight(client, prompt_text) -> None:
    (task,) = await _freeze_running(client, [
        {"text": prompt_text, "sampling_params": {"max_new_tokens": 220, "ignore_eos": True}}])
    try:
        await client.post("/pause_generation", json={"mode": "abort"})
    finally:
        await client.post("/continue_generation")
    assert (await task).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_pause_retract_resumes_requests_to_completion(client, prompt_text) -> None:
    (task,) = await _freeze_running(client, [
        {"text": prompt_text, "sampling_params": {"max_new_tokens": 230, "ignore_eos": True}}])
    try:
        await client.post("/pause_generation", json={"mode": "retract"})
        m = await _metrics(client)
        # still in flight (held for the pause), not demand: counted as running, never as queued
        assert m["sglang:num_queue_reqs"] == 0 and m["sglang:num_running_reqs"] == 1
        info = (await client.get("/server_info")).json()
        assert info["paused"] is True
    finally:
        await client.post("/continue_generation")
    body = (await task).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 230}


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("payload,needle", [
    ({}, "exactly one of 'text' or 'input_ids'"),
    ({"text": "a", "input_ids": [1]}, "exactly one of"),
    ({"text": 123}, "text"),
    ({"text": ""}, "empty"),
    ({"input_ids": [1, "x"]}, "input_ids"),
    ({"input_ids": [100000]}, "outside the vocabulary"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}, "context length"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "10"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_tokens": 5}}, "max_tokens"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "n"),
    ({"text": "hi", "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
    ({"text": "hi", "sampling_params": "greedy"}, "sampling_params"),
])
async def test_bad_generate_input_is_a_4xx_naming_the_problem(client, payload, needle) -> None:
    r = await client.post("/generate", json=payload)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


async def test_bad_control_input_and_server_keeps_serving(client, tmp_path, prompt_text) -> None:
    r = await client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = await client.post("/abort_request", json={})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    r = await client.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    # Absent, empty and unreadable paths get the same answer (naming only the caller's own path): an answer
    # that differed would tell a caller which directories exist on the engine's node.
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")
    answers = []
    broken = tmp_path / "broken"
    for path in (tmp_path / "missing", tmp_path / "no-weights", broken, broken / "config.json"):
        r = await client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert r.status_code == 400
        answers.append(r.json()["error"]["message"].replace(str(path), "<path>"))
    assert len(set(answers)) == 1 and "not a loadable checkpoint" in answers[0], answers
    r = await client.post("/generate", json={"text": prompt_text, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    assert (await client.get("/model_info")).json()["weight_version"] == "0"


async def test_weights_checker_answers_every_served_tensor_in_sglangs_shape(client, tiny_preset, served_as) -> None:
    """``/weights_checker {"action": "checksum"}``: SGLang's answer, and the checksums are the checkpoint's as this
    engine serves it (what a verified refit compares with the trainer's)."""
    import hashlib

    from safetensors.torch import load_file

    from relax.weights.digest import layout_checksums, version_digest

    r = await client.post("/weights_checker", json={"action": "checksum"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and len(body["ranks"]) == 1
    rank = body["ranks"][0]
    layout, dtype = served_as
    state = load_file(str(tiny_preset.model_dir / "model.safetensors"))
    state = {n: t.to(dtype) if dtype is not None and t.is_floating_point() else t for n, t in state.items()}
    assert rank["checksums"] == layout_checksums(state, layout)
    assert rank["per_gpu_checksum"] == version_digest(rank["checksums"])
    assert body["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert [(p["role"], p["tp_size"]) for p in rank["parallelism_info"]] == [("target", 1)]
