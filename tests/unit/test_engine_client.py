"""EngineClient against a small in-process engine double served by uvicorn over real HTTP."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from relax.cluster.network import free_port
from relax.engines.client import EngineClient, EngineError, EngineUnavailable, normalize_base_url
from tests.loopback import LoopbackServer


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class Recorder:
    """What the double received, so tests can check the exact JSON the client sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any, dict[str, str]]] = []

    def last(self, path: str) -> tuple[Any, dict[str, str]]:
        for _method, p, body, headers in reversed(self.calls):
            if p == path:
                return body, headers
        raise AssertionError(f"no call to {path}; got {[c[1] for c in self.calls]}")


class NeedsField(BaseModel):
    required_field: int


def build_app(rec: Recorder, state: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        rec.calls.append((request.method, request.url.path, body, dict(request.headers)))
        return await call_next(request)

    def one(text: str, rid: str, version: str) -> dict[str, Any]:
        return {
            "text": text,
            "output_ids": [5, 6],
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": 2},
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "weight_version": version,
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
            },
        }

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        if body.get("text") == "boom":
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        if body.get("text") == "slow":
            await asyncio.sleep(5)
        n = body.get("sampling_params", {}).get("n", 1)
        rid = body.get("rid") or "r"
        if n > 1:
            return [one(f"out{k}", f"{rid}-{k}", state["version"]) for k in range(n)]
        return one("out", rid, state["version"])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state["unhealthy"]:
            return JSONResponse({"error": {"message": "engine is paused"}}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 2.0\n")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause() -> dict[str, str]:
        return {"message": "paused"}

    @app.post("/continue_generation")
    async def cont() -> Response:
        return Response(status_code=200)

    @app.post("/abort_request")
    async def abort() -> Response:
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> Any:
        body = await request.json()
        if body["model_path"] == "/missing":
            return JSONResponse({"success": False, "message": "no such directory"}, status_code=400)
        if body["model_path"] == "/soft-fail":
            return {"success": False, "message": "shape mismatch"}
        state["version"] = body["weight_version"]
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    # SGLang 0.5.23's shape: the version is in /model_info, /get_weight_version does not exist, the /get_*
    # aliases are deprecated. state["legacy"] plays an older build: /model_info without the version, and
    # /get_weight_version present. state["no_version"]: neither.
    @app.get("/get_weight_version")
    async def weight_version() -> Any:
        if not state.get("legacy"):
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"weight_version": state["version"]}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"tp_size": 1, "weight_version": state["version"]}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        info: dict[str, Any] = {"model_path": "/m", "is_generation": True}
        if not (state.get("legacy") or state.get("no_version")):
            info["weight_version"] = state["version"]
        return info

    @app.post("/validated")
    async def validated(body: NeedsField) -> dict[str, int]:
        return {"ok": body.required_field}

    @app.get("/overloaded")
    async def overloaded() -> Response:
        return PlainTextResponse("try later", status_code=503)

    @app.get("/crash")
    async def crash() -> Response:
        return PlainTextResponse("x" * 2000, status_code=500)

    @app.get("/not_json")
    async def not_json() -> Response:
        return PlainTextResponse("hello")

    return app


class EngineDouble:
    def __init__(self) -> None:
        self.rec = Recorder()
        self.state: dict[str, Any] = {"version": "0", "unhealthy": False}
        # force_exit: do not wait for the deliberately slow request to finish
        self.http = LoopbackServer(build_app(self.rec, self.state), name="engine-double", force_exit=True)
        self.url = self.http.url

    def __enter__(self) -> EngineDouble:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.stop()


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineDouble]:
    with EngineDouble() as double:
        yield double


@pytest.fixture
async def client(engine: EngineDouble):
    engine.state.update(version="0", unhealthy=False, legacy=False, no_version=False)
    async with EngineClient(engine.url, timeout=5.0, token="s3cret") as c:
        yield c


# -- URL validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        ("  https://engine.example:443/prefix/ ", "https://engine.example:443/prefix"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://10.0.0.5", "http://10.0.0.5"),
    ],
)
def test_normalize_base_url_accepts_engine_urls(url: str, expected: str) -> None:
    assert normalize_base_url(url) == expected


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("", "non-empty"),
        ("127.0.0.1:30000", "http:// or https://"),
        ("ftp://host:21", "http:// or https://"),
        ("http://:30000", "no host"),
        ("http://host:99999", "invalid port"),
        ("http://host:abc", "invalid port"),
        ("http://host:0", "invalid port"),
        ("http://user:pw@host:1", "credentials"),
        ("http://host:1/?x=1", "query"),
    ],
)
def test_normalize_base_url_rejects_malformed_urls(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="engine URL") as info:
        normalize_base_url(url)
    assert fragment in str(info.value)


def test_client_rejects_bad_url_and_timeout() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        EngineClient("localhost:30000", timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        EngineClient("http://localhost:30000", timeout=0)


# -- generate -------------------------------------------------------------------------------------


async def test_generate_sends_the_sglang_payload_and_parses_the_result(
    client: EngineClient, engine: EngineDouble
) -> None:
    result = await client.generate(
        "hello",
        sampling_params={"temperature": 0.7, "max_new_tokens": 2, "stop": ["\n"]},
        rid="req-1",
        return_logprob=True,
    )
    assert isinstance(result, dict)
    assert result["text"] == "out"
    assert result["meta_info"]["id"] == "req-1"
    assert result["meta_info"]["output_token_logprobs"][0] == [-0.5, 5, None]
    body, headers = engine.rec.last("/generate")
    assert body == {
        "text": "hello",
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 2, "stop": ["\n"]},
        "rid": "req-1",
        "return_logprob": True,
    }
    assert headers["authorization"] == "Bearer s3cret"


async def test_generate_with_input_ids_and_n_returns_a_list(client: EngineClient, engine: EngineDouble) -> None:
    result = await client.generate(input_ids=[1, 2, 3], sampling_params={"n": 3}, rid="g")
    assert isinstance(result, list)
    assert [r["meta_info"]["id"] for r in result] == ["g-0", "g-1", "g-2"]
    body, _ = engine.rec.last("/generate")
    assert body == {"input_ids": [1, 2, 3], "sampling_params": {"n": 3}, "rid": "g"}


async def test_generate_needs_exactly_one_input(client: EngineClient) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        await client.generate()
    with pytest.raises(ValueError, match="exactly one"):
        await client.generate("a", input_ids=[1])


async def test_engine_refusal_is_an_engine_error_with_the_server_message(client: EngineClient) -> None:
    with pytest.raises(EngineError) as info:
        await client.generate("boom")
    err = info.value
    assert not isinstance(err, EngineUnavailable)
    assert err.status_code == 400
    assert err.server_message == "prompt too long"
    assert err.endpoint == "/generate"
    assert err.url == client.base_url
    assert "prompt too long" in str(err) and "400" in str(err)


async def test_generate_timeout_is_unavailable(client: EngineClient) -> None:
    with pytest.raises(EngineUnavailable, match="timed out") as info:
        await client.generate("slow", timeout=0.2)
    assert info.value.status_code is None
    assert info.value.endpoint == "/generate"


async def test_connection_refused_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with EngineClient(url, timeout=2.0) as c:
        with pytest.raises(EngineUnavailable) as info:
            await c.health()
        assert info.value.url == url
        assert await c.is_healthy() is False


# -- error mapping --------------------------------------------------------------------------------


async def test_503_is_unavailable_and_500_is_an_error(client: EngineClient) -> None:
    with pytest.raises(EngineUnavailable) as info:
        await client._get_json("/overloaded")
    assert info.value.status_code == 503
    assert info.value.server_message == "try later"
    with pytest.raises(EngineError) as info2:
        await client._get_json("/crash")
    assert not isinstance(info2.value, EngineUnavailable)
    assert len(info2.value.server_message or "") < 600  # long bodies are cut


async def test_fastapi_validation_detail_is_quoted(client: EngineClient) -> None:
    with pytest.raises(EngineError) as info:
        await client._post_json("/validated", {"wrong": 1})
    assert info.value.status_code == 422
    assert "required_field" in (info.value.server_message or "")


async def test_non_json_body_is_an_engine_error(client: EngineClient) -> None:
    with pytest.raises(EngineError, match="not JSON"):
        await client._get_json("/not_json")


def test_errors_survive_pickling() -> None:
    err = EngineUnavailable("down", url="http://h:1", endpoint="/generate", status_code=503, server_message="m")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is EngineUnavailable
    assert (back.url, back.endpoint, back.status_code, back.server_message) == ("http://h:1", "/generate", 503, "m")
    assert str(back) == "down"


# -- health, metrics, control, identity -----------------------------------------------------------


async def test_health_and_metrics(client: EngineClient, engine: EngineDouble) -> None:
    await client.health()
    await client.health_generate()
    assert await client.is_healthy() is True
    engine.state["unhealthy"] = True
    assert await client.is_healthy() is False
    assert await client.is_healthy(generate=False) is True
    with pytest.raises(EngineUnavailable, match="engine is paused"):
        await client.health_generate()
    text = await client.metrics_text()
    assert "sglang:num_running_reqs 2.0" in text


async def test_control_endpoints_send_sglang_bodies(client: EngineClient, engine: EngineDouble) -> None:
    await client.flush_cache()
    assert await client.pause_generation("retract") == {"message": "paused"}
    assert engine.rec.last("/pause_generation")[0] == {"mode": "retract"}
    assert await client.continue_generation() is None
    assert await client.abort_request("rid-7") is None
    assert engine.rec.last("/abort_request")[0] == {"rid": "rid-7", "abort_all": False}
    await client.abort_request(abort_all=True)
    assert engine.rec.last("/abort_request")[0] == {"rid": "", "abort_all": True}
    with pytest.raises(ValueError, match="pause mode"):
        await client.pause_generation("stop")
    with pytest.raises(ValueError, match="rid"):
        await client.abort_request()


async def test_update_weights_from_disk(client: EngineClient, engine: EngineDouble) -> None:
    result = await client.update_weights_from_disk("/dev/shm/v3", 3, load_format="safetensors")
    assert result["success"] is True
    assert engine.rec.last("/update_weights_from_disk")[0] == {
        "model_path": "/dev/shm/v3",
        "weight_version": "3",
        "load_format": "safetensors",
    }
    assert await client.get_weight_version() == "3"
    with pytest.raises(EngineError, match="no such directory") as info:
        await client.update_weights_from_disk("/missing", 4)
    assert info.value.status_code == 400
    with pytest.raises(EngineError, match="shape mismatch"):
        await client.update_weights_from_disk("/soft-fail", 4)
    assert await client.get_weight_version() == "3"


async def test_identity_endpoints(client: EngineClient, engine: EngineDouble) -> None:
    engine.rec.calls.clear()
    assert (await client.get_server_info())["tp_size"] == 1
    assert await client.get_weight_version() == "0"
    # the current routes only: SGLang logs a deprecation warning for every /get_* call
    assert [path for _m, path, _b, _h in engine.rec.calls] == ["/server_info", "/model_info"]


async def test_weight_version_falls_back_to_the_legacy_route(client: EngineClient, engine: EngineDouble) -> None:
    engine.state.update(legacy=True, version="7")
    engine.rec.calls.clear()
    assert await client.get_weight_version() == "7"
    assert [path for _m, path, _b, _h in engine.rec.calls] == ["/model_info", "/get_weight_version"]


async def test_no_weight_version_anywhere_is_one_clear_error(client: EngineClient, engine: EngineDouble) -> None:
    engine.state.update(no_version=True)
    with pytest.raises(EngineError, match="reports no weight version: /model_info has no 'weight_version'"):
        await client.get_weight_version()


async def test_aclose_and_context_manager(engine: EngineDouble) -> None:
    c = EngineClient(engine.url + "/", timeout=2)
    assert c.base_url == engine.url
    assert (await c.get_server_info())["tp_size"] == 1
    await c.aclose()
    with pytest.raises(RuntimeError, match="is closed"):
        await c.get_server_info()


class ResettingEngine:
    """A raw HTTP/1.1 server that keeps connections alive, but resets one that a request reuses after it sat
    idle for ``idle_limit_s``: what a client meets when its request crosses uvicorn's keep-alive close."""

    def __init__(self, idle_limit_s: float) -> None:
        self.idle_limit_s = idle_limit_s
        self.connections = 0
        self.resets = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import socket
        import struct

        self.connections += 1
        answered_at: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answered_at is not None and time.monotonic() - answered_at > self.idle_limit_s:
                    self.resets += 1
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close as RST
                    writer.transport.abort()
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                body = json.dumps({"text": "ok", "meta_info": {"finish_reason": {"type": "stop"}}}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                answered_at = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.mark.parametrize(("keepalive_s", "resets"), [(0.2, False), (30.0, True)])
async def test_idle_connections_are_given_up_before_the_server_closes_them(keepalive_s: float, resets: bool) -> None:
    """After a lull longer than the server's keep-alive, the next requests must open fresh connections: a
    reused one is reset (the engine closed it), and every pooled connection went idle at the same moment."""
    double = ResettingEngine(idle_limit_s=0.4)
    server = await asyncio.start_server(double.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with EngineClient(url, timeout=5, keepalive_s=keepalive_s) as c:
            await asyncio.gather(*(c.generate("x") for _ in range(8)))
            await asyncio.sleep(0.6)  # the lull itself is the scenario: longer than the server keeps them
            if resets:  # the check can fail: a client that keeps connections too long is reset
                with pytest.raises(EngineUnavailable, match="reset|disconnected"):
                    await asyncio.gather(*(c.generate("x") for _ in range(8)))
            else:
                assert len(await asyncio.gather(*(c.generate("x") for _ in range(8)))) == 8
                assert double.resets == 0 and double.connections >= 16
    finally:
        server.close()
        await server.wait_closed()


def test_keepalive_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keepalive_s must be a positive"):
        EngineClient("http://127.0.0.1:1", keepalive_s=0)
