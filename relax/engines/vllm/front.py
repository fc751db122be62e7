"""The front: the vLLM engine's TCP listener, speaking Relax's engine contract, with vLLM behind it on a socket.

Why a process of its own: vLLM's ``--api-key`` leaves ``/pause``, ``/resume``, its weight routes and
``/collective_rpc`` open, so vLLM must not listen where anyone else can reach it (``--uds`` in a directory of
mode 0700). The front is the only way in, and it opens the routes it knows by the run's two keys
(``relax.engines.keys``): the generation key generates, only the admin key pauses, aborts or relabels, and no
key reaches anything the front does not translate. ``python -m relax.engines.vllm`` runs it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from relax.engines.event_stream import sse
from relax.engines.keys import EngineKeys, authorized, is_admin_route
from relax.engines.vllm.translate import (
    GenerateCall,
    Output,
    RequestRefused,
    abort_body,
    generate_call,
    pause_query,
    sample_rids,
    version_body,
)

log = logging.getLogger("relax.engines.vllm")

TOKEN_ROUTE = "/inference/v1/generate"
#: The routes the front serves; every other path is answered 404 (after the key check).
ROUTES = frozenset({"/generate", "/health", "/health_generate", "/metrics", "/pause_generation",
                    "/continue_generation", "/abort_request", "/update_weight_version", "/get_weight_version",
                    "/model_info", "/server_info"})


@dataclass
class FrontState:
    """What the front knows that vLLM does not tell per request: the label it gave the weights last."""

    version: str
    model_path: str


def _error(status: int, message: str) -> JSONResponse:
    """SGLang's error shape (the one Relax's client reads ``message`` from)."""
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


@dataclass(frozen=True)
class Answer:
    """vLLM's answer to a call that is not a stream, read whole."""

    status: int
    body: bytes
    content_type: str

    def json(self) -> Any:
        return json.loads(self.body)


class Upstream:
    """The vLLM server behind the front, through its Unix socket.

    aiohttp, as Relax's engine client (``relax.engines.client``): the front holds one generation in flight per
    sample, and httpx's pool costs CPU per request in proportion to the connections it holds. No total timeout:
    generations are long, and the caller's own timeout ends a call by closing its connection to the front.
    """

    def __init__(self, socket_path: str, key: str | None) -> None:
        self.socket_path = socket_path
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use: it binds to the running loop
            self._session = aiohttp.ClientSession(
                "http://vllm", connector=aiohttp.UnixConnector(path=self.socket_path, limit=0),
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def call(self, method: str, path: str, **kwargs: Any) -> Answer:
        async with self.session().request(method, path, **kwargs) as answer:
            return Answer(answer.status, await answer.read(), answer.headers.get("content-type", "text/plain"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class UpstreamFailed(Exception):
    """vLLM answered a call with an error; the front answers with vLLM's status and message."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(f"vLLM answered {answer.status}")
        self.answer = answer


def create_app(upstream: Upstream, keys: EngineKeys, state: FrontState,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The front's routes. ``on_shutdown`` runs in uvicorn's graceful stop (stopping the vLLM it started: uvicorn
    re-raises the SIGTERM it caught once it has stopped, so nothing after the server's return would run)."""
    app = FastAPI(title="Relax vLLM front")
    if on_shutdown is not None:
        app.router.on_shutdown.append(on_shutdown)

    @app.middleware("http")
    async def _require_key(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if not authorized(path, request.headers.get("authorization"), keys.generation, keys.admin):
            which = "admin" if is_admin_route(path) and keys.admin else "API"
            return _error(401, f"unauthorized: {path} needs 'Authorization: Bearer <this engine's {which} key>'")
        if path not in ROUTES:
            return _error(404, f"{path}: not a route of Relax's vLLM front (it serves {', '.join(sorted(ROUTES))})")
        return await call_next(request)

    @app.exception_handler(RequestRefused)
    async def _refused(_: Request, refused: RequestRefused) -> JSONResponse:
        return _error(400, str(refused))

    @app.exception_handler(UpstreamFailed)
    async def _failed(_: Request, failed: UpstreamFailed) -> JSONResponse:
        return _error(failed.answer.status, upstream_message(failed.answer))

    forward = upstream.call

    async def forward_ok(method: str, path: str, **kwargs: Any) -> Answer:
        """vLLM's answer to a control call, or the front's error carrying vLLM's message."""
        answer = await upstream.call(method, path, **kwargs)
        if answer.status != 200:
            raise UpstreamFailed(answer)
        return answer

    @app.get("/health")
    async def health() -> Response:
        answer = await forward("GET", "/health")
        return Response(status_code=answer.status)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        answer = await forward("POST", TOKEN_ROUTE, json={"token_ids": [0], "sampling_params": {"max_tokens": 1},
                                                          "request_id": f"health-{uuid.uuid4().hex}"})
        return Response(status_code=200 if answer.status == 200 else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        answer = await forward("GET", "/metrics")
        return Response(answer.body, status_code=answer.status, media_type=answer.content_type)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        call = generate_call(await _json(request), lambda: uuid.uuid4().hex)
        if call.stream:
            return StreamingResponse(_stream(upstream, call, state), media_type="text/event-stream")
        answer = await forward_ok("POST", TOKEN_ROUTE, json=call.vllm_body)
        choices = sorted(answer.json().get("choices") or [], key=lambda c: c.get("index", 0))
        outputs = []
        for rid, choice in zip(sample_rids(call), choices, strict=True):
            output = Output(rid, call.prompt_tokens, call.return_logprob)
            output.add(choice, state.version)
            outputs.append(output.answer(state.version))
        return JSONResponse(outputs[0] if call.n == 1 else outputs)

    @app.post("/pause_generation")
    async def pause(request: Request) -> Response:
        query = pause_query(await _json(request))
        await forward_ok("POST", "/pause", params=query)
        log.info("paused (vLLM mode %s, clear_cache %s)", query["mode"], query.get("clear_cache", "default"))
        return JSONResponse({"success": True, "message": f"paused ({json.dumps(query)})"})

    @app.post("/continue_generation")
    async def resume() -> Response:
        await forward_ok("POST", "/resume")
        return JSONResponse({"success": True, "message": "resumed"})

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        body = abort_body(await _json(request))
        if body is None:
            return JSONResponse({"success": True, "aborted": 0})
        answer = await forward_ok("POST", "/abort_requests", json=body)
        return JSONResponse({"success": True, "aborted": answer.json().get("aborted", 0)})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        version = version_body(await _json(request))
        await forward_ok("POST", "/update_weight_version", json={"new_version": version})
        state.version = version
        return JSONResponse({"success": True, "new_version": version})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return JSONResponse({"weight_version": state.version})

    @app.get("/model_info")
    async def model_info() -> Response:
        return JSONResponse({"model_path": state.model_path, "weight_version": state.version, "backend": "vllm"})

    @app.get("/server_info")
    async def server_info() -> Response:
        return JSONResponse({"weight_version": state.version, "backend": "vllm", "model_path": state.model_path})

    return app


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        raise RequestRefused("the body is not JSON") from None


def upstream_message(answer: Answer) -> str:
    """vLLM's error message (its ``{"error": {...}}`` or ``{"detail"}`` shapes), prefixed so it reads as vLLM's."""
    try:
        body = answer.json()
    except ValueError:
        return f"vLLM answered {answer.status}: {answer.body[:300].decode(errors='replace')}"
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error or (body.get("detail")
                                                                             if isinstance(body, dict) else body)
    return f"vLLM answered {answer.status}: {message}"


async def _stream(upstream: Upstream, call: GenerateCall, state: FrontState) -> AsyncIterator[bytes]:
    """vLLM's delta events folded into SGLang's cumulative ones; closing this stream closes vLLM's (an abort)."""
    output = Output(call.rid, call.prompt_tokens, call.return_logprob)
    async with upstream.session().post(TOKEN_ROUTE, json=call.vllm_body) as answer:
        if answer.status != 200:
            failed = Answer(answer.status, await answer.read(), "")
            yield sse({"error": {"message": upstream_message(failed), "code": answer.status}})
            yield b"data: [DONE]\n\n"
            return
        async for raw in answer.content:  # one line at a time
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                yield sse(event)
                continue
            for choice in event.get("choices") or []:
                output.add(choice, state.version)
                yield sse(output.answer(state.version))
    yield b"data: [DONE]\n\n"
