"""FastAPI/uvicorn server of the built-in engine: SGLang's native HTTP API over `Engine`.

Routes are thin: they validate (protocol.py), tokenize, and hand requests to the generation loop
(engine.py), which runs on its own thread. Started by `relax engine serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from relax import __version__
from relax.engines.builtin.decoder import DecoderForCausalLM
from relax.engines.builtin.engine import DuplicateRequestId, Engine
from relax.engines.builtin.health import shared_probe
from relax.engines.builtin.metrics import EngineMetrics
from relax.engines.builtin.model_impl import ModelImpl, ModelImplError
from relax.engines.builtin.model_runner import ModelRunner, load_model, resolve_device
from relax.engines.builtin.protocol import (
    AbortBody,
    GenerateBody,
    InitWeightsUpdateGroupBody,
    PauseBody,
    UpdateWeightsBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightVersionBody,
    WeightsGroupBody,
    WeightUpdateSessionBody,
)
from relax.engines.builtin.rwlock import WriterPreferringLock
from relax.engines.builtin.scheduler import Capacity
from relax.engines.builtin.scheduler import Request as EngineRequest
from relax.engines.builtin.stream_response import ClientWaits, StallGuardedStream, expose_connection_abort
from relax.engines.builtin.stream_stall import StallBound, stall_timeout_from_env
from relax.engines.builtin.streaming import StreamFeed, Wakeups, abort_unfinished, parent_rids
from relax.engines.builtin.tokenizer import load_tokenizer
from relax.engines.builtin.weight_checker import WeightsCheckerBody, weights_checksum_answer
from relax.engines.builtin.weight_updates import DistributedUpdates, WeightUpdateError
from relax.engines.event_stream import sse
from relax.engines.guard import parent_watchdog
from relax.engines.keys import authorized, carries_a_key, is_admin_route
from relax.pace import Pace, PaceAnonymous
from relax.weights.pause_mode import PauseMode

log = logging.getLogger("relax.engine")

# As SGLang: a health probe is a one-token generation that must answer within this many seconds
# (SGLANG_HEALTH_CHECK_TIMEOUT, default 20), else 503.
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
# How often a waiting /generate checks that its client is still there (SGLang checks every 4 s; we check
# sooner, since a test's load generator is stopped by closing its connections).
DISCONNECT_POLL_S = 1.0


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int = 64
    max_total_tokens: int = 32768
    weight_version: str = "0"
    device: str = "auto"
    num_threads: int = 1
    seed: int = 0
    served_model_name: str | None = None
    log_level: str = "info"
    model_impl: ModelImpl = ModelImpl.AUTO
    load_format: str = "auto"
    """``auto``: the checkpoint's weights; ``dummy``: random weights, no weight file read (SGLang's flag), for an
    engine whose first refit overwrites them; its ``weight_version`` is then meaningless until that refit."""
    api_key: str | None = field(default=None, repr=False)
    """SGLang's ``--api-key``: every route but ``/health*`` and ``/metrics`` needs ``Bearer <key>``."""
    admin_api_key: str | None = field(default=None, repr=False)
    """SGLang's ``--admin-api-key``: the only key the control routes take, refused on generation
    (``relax.engines.keys``)."""
    stream_interval: int = 1
    """SGLang's ``--stream-interval``: tokens between two chunks of a streamed generation."""
    stream_stall_timeout: float = field(default_factory=stall_timeout_from_env)
    """Seconds one write of a streamed generation may wait for a client that does not read before the stream is
    aborted and its connection closed; 0: never (``stream_stall``). Unless given, ``RELAX_ENGINE_STREAM_STALL_TIMEOUT``
    or 20."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _refusal(message: str, retry_after_s: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": 503}}, status_code=503,
                        headers={"Retry-After": str(retry_after_s)})


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def _check_weights_dir(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ApiError(400, f"model_path {path!r} is not a directory on the engine's node")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ApiError(400, f"model_path {path!r} holds no weight files (*.safetensors)")
    if not (p / "config.json").is_file():
        raise ApiError(400, f"model_path {path!r} has no config.json")
    return p


def _not_loadable(path: str) -> str:
    """One answer for every reason a weights path fails (absent, not a directory, no weights, unreadable):
    an answer that differed by reason would tell a caller which paths exist on the engine's node."""
    return (f"model_path {path!r} is not a loadable checkpoint on the engine's node (a directory with config.json "
            "and *.safetensors); the engine's log says why")


class BuiltinServer:
    """Owns the tokenizer, the model and the generation loop of one engine process."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        model_dir = _check_weights_dir(args.model_path)
        torch.set_num_threads(max(1, args.num_threads))
        self.device = resolve_device(args.device)
        self.model_impl = ModelImpl(args.model_impl)
        # the model first: a checkpoint that --model-impl refuses costs no tokenizer load
        model = load_model(model_dir, self.device, self.model_impl, dummy=args.load_format == "dummy")
        self.served_by = ModelImpl.NATIVE if isinstance(model, DecoderForCausalLM) else ModelImpl.TRANSFORMERS
        self.tokenizer = load_tokenizer(model_dir, prefer_file=self.model_impl is not ModelImpl.TRANSFORMERS)
        self.config = model.config
        self.model_name = args.served_model_name or model_dir.name
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(model.config.vocab_size)
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.metrics = EngineMetrics(self.model_name)
        self.engine = Engine(
            ModelRunner(model, self.device, pad_token_id=pad),
            decode=lambda ids, skip: self.tokenizer.decode(ids, skip_special_tokens=skip),
            eos_token_ids=self._eos_ids(model),
            capacity=Capacity(args.max_running_requests, args.max_total_tokens),
            metrics=self.metrics,
            weight_version=str(args.weight_version),
            seed=args.seed,
        )
        self.model_path = str(model_dir)
        self._started_at = time.time()
        # Every generation holds it as a reader; a weight load on an unpaused engine takes it as the writer
        # (waits for in-flight generations, blocks new ones), exactly as SGLang's tokenizer manager does.
        self.update_lock = WriterPreferringLock()
        self.weight_loads = 0  # successful /update_weights_from_disk calls since start (server_info)
        self.distributed = DistributedUpdates(self.engine, self.update_lock, self.device)
        self._wakeups: Wakeups | None = None  # streams due on the engine thread, woken on the loop together
        self.stall_bound = StallBound(args.stream_stall_timeout)
        self.client_waits = ClientWaits()  # streams whose client is not reading (server_info)
        # concurrent /health(_generate) calls share one probe generation (relax.engines.builtin.health)
        self.health = shared_probe(self._health_probe,
                                   generation_held=lambda: self.engine.paused or self.update_lock.writer_pending)
        self.anonymous_pace = Pace()  # callers without a key (relax.pace)

    def _eos_ids(self, model: torch.nn.Module) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ------------------------------------------------------------------ generate
    def _requests(self, body: GenerateBody, on_finish: Callable[[EngineRequest], None],
                  on_progress: Callable[[EngineRequest], None] | None = None) -> list[EngineRequest]:
        """The engine requests of one call (prompts x n), validated; nothing is submitted yet."""
        params = body.sampling_params.to_params()
        prompts = body.prompts()
        prompt_ids = [self._tokenize(p, i) for i, p in enumerate(prompts)]
        for i, ids in enumerate(prompt_ids):
            self._check_fits(ids, params.max_new_tokens, i)
        rids = self._rids(body, len(prompts))
        now = time.monotonic()
        return [
            EngineRequest(rid=parent if params.n == 1 else f"{parent}-{k}", parent_rid=parent, prompt_ids=list(ids),
                          params=params, arrival=now, on_finish=on_finish, on_progress=on_progress)
            for parent, ids in zip(rids, prompt_ids, strict=True) for k in range(params.n)
        ]

    def _submit(self, requests: list[EngineRequest]) -> None:
        try:
            self.engine.submit(requests)  # never waits for a step: the event loop keeps serving
        except DuplicateRequestId as exc:
            raise ApiError(400, str(exc)) from None

    async def generate(
        self, body: GenerateBody, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Run the prompts of one call to the end; a client that hangs up has its requests aborted (SGLang's
        rule), so a load generator or a router that gives up frees the batch instead of leaving work behind."""
        loop = asyncio.get_running_loop()
        futures: dict[int, asyncio.Future[EngineRequest]] = {}

        def done(req: EngineRequest) -> None:
            fut = futures[id(req)]
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

        requests = self._requests(body, done)
        for req in requests:
            futures[id(req)] = loop.create_future()
        async with self.update_lock.reader():
            self._submit(requests)
            finished = await self._wait(asyncio.gather(*futures.values()), {r.parent_rid for r in requests},
                                        disconnected)
        outputs = [self._format(req, body.return_logprob) for req in finished]
        return outputs if body.batched or len(requests) > 1 else outputs[0]

    def stream(self, body: GenerateBody) -> StallGuardedStream:
        """``"stream": true``: server-sent events of each request's output so far (relax.engines.builtin.streaming).

        Validated before the first byte, so a bad request is a plain 400, not a broken stream. Submitted when
        the response starts: a response that never starts (its client gone at once) leaves nothing running. A
        client that stops reading is given up on after the stall bound (relax.engines.builtin.stream_stall).
        """
        if self._wakeups is None:  # made on the server's loop, at its first stream
            self._wakeups = Wakeups(asyncio.get_running_loop())
        feed = StreamFeed(self._wakeups, body.sampling_params.stream_interval or self.args.stream_interval)
        requests = self._requests(body, feed.finished, feed.progress)
        for parent in {r.parent_rid for r in requests}:
            if self.engine.has_request(parent):
                raise ApiError(400, str(DuplicateRequestId(parent)))

        async def stalled(waited_s: float) -> None:
            aborted = await abort_unfinished(requests, self.engine.abort, "client stopped reading")
            log.warning("stream %s stalled: its client read nothing for %.1fs (stream stall timeout %gs); %s, "
                        "connection closed", ", ".join(parent_rids(requests)), waited_s, self.stall_bound.seconds,
                        f"aborted {', '.join(aborted)}" if aborted else "its generation had finished")

        return StallGuardedStream(self._events(feed, requests, body), self.stall_bound, stalled,
                                  media_type="text/event-stream", waits=self.client_waits)

    async def _events(self, feed: StreamFeed, requests: list[EngineRequest], body: GenerateBody
                      ) -> AsyncGenerator[bytes, None]:
        """The stream's events. It holds a reader's slot of the update lock (as a non-streaming generation does)
        only until its requests finished inside the engine: sending what is left must not hold a weight load."""
        lease = await self.update_lock.acquire_reader()
        feed.when_generated(requests, lease.release)
        try:
            try:
                self._submit(requests)
            except ApiError as exc:  # a rid submitted since the check: SGLang's in-stream error shape
                yield sse({"error": {"message": exc.message}})
                return
            async for chunk in feed.chunks(
                requests, indexed=body.batched or len(requests) > 1, return_logprob=body.return_logprob,
                decode=lambda ids, skip: self.tokenizer.decode(ids, skip_special_tokens=skip),
                current_version=lambda: self.engine.weight_version,
                final=lambda req: self._format(req, body.return_logprob),
            ):
                yield chunk
        finally:  # also when the client went away (the response's task is being cancelled: the abort is shielded)
            aborted = await abort_unfinished(requests, self.engine.abort, "client disconnected")
            if aborted:
                log.info("streaming client disconnected: aborted %s", ", ".join(aborted))
            lease.release()

    async def _wait(self, gathered: asyncio.Future[list[EngineRequest]], rids: set[str],
                    disconnected: Callable[[], Awaitable[bool]] | None) -> list[EngineRequest]:
        while disconnected is not None:
            done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await disconnected():
                log.info("client disconnected: aborting %s", ", ".join(sorted(rids)))
                for rid in rids:
                    await asyncio.to_thread(self.engine.abort, rid, "client disconnected")
                break
        return await gathered

    def _tokenize(self, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"input_ids of prompt {index} has token id {bad[0]} outside the vocabulary "
                                f"(size {self.vocab_size})")
        return prompt

    def _check_fits(self, ids: list[int], max_new_tokens: int, index: int) -> None:
        need = len(ids) + max_new_tokens
        if need > self.max_context:
            raise ApiError(400, f"prompt {index}: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} "
                                f"exceed the model's context length {self.max_context}")
        if need > self.args.max_total_tokens:
            raise ApiError(400, f"prompt {index}: {need} tokens can never fit the engine's token capacity "
                                f"(--max-total-tokens {self.args.max_total_tokens})")

    @staticmethod
    def _rids(body: GenerateBody, count: int) -> list[str]:
        if isinstance(body.rid, list):
            return body.rid
        if isinstance(body.rid, str):
            return [body.rid] if count == 1 else [f"{body.rid}-{i}" for i in range(count)]
        return [uuid.uuid4().hex for _ in range(count)]

    @staticmethod
    def _format(req: EngineRequest, return_logprob: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": req.weight_version,  # the newest version that produced a token, as SGLang
            "weight_versions": [span.to_json() for span in req.version_spans],
            "e2e_latency": (req.finished_at or 0.0) - req.arrival,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids, strict=True)
            ]
        return {"text": req.output_text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ health
    async def _health_probe(self) -> None:
        """One probe generation; raises a 503 when it does not answer within the timeout (SGLang's rule)."""
        probe = GenerateBody(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                             rid=f"health-{uuid.uuid4().hex}")
        began = time.monotonic()
        task = asyncio.ensure_future(self.generate(probe))
        try:
            # Healthy once the probe answers or the engine produced any token since it was sent (a busy
            # engine need not fit the probe into a full batch): SGLang's rule.
            while not task.done() and self.engine.last_output_at <= began:
                if time.monotonic() - began > HEALTH_CHECK_TIMEOUT_S:
                    raise ApiError(503, f"health generation did not answer within {HEALTH_CHECK_TIMEOUT_S:g}s")
                await asyncio.sleep(0.02)
            if task.done() and not task.cancelled() and task.exception() is not None:
                # the probe could not be generated (the engine is shutting down): not a healthy answer
                raise ApiError(503, f"health generation failed: {task.exception()}")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.to_thread(self.engine.abort, probe.rid, "health check answered")

    # ------------------------------------------------------------------ weights
    async def update_weights(self, body: UpdateWeightsBody) -> dict[str, Any]:
        """``/update_weights_from_disk``: on a paused engine at once; otherwise behind the writer lock.

        SGLang's rule, kept on purpose: an unpaused engine finishes every in-flight generation (and
        accepts no new one) before it loads, so a caller that does not pause stalls the engine for as long
        as its longest request — which is why the manager pauses, loads and continues.
        """
        try:
            path = _check_weights_dir(body.model_path)
        except ApiError as exc:  # the detail is for the operator's log, not for whoever sent the path
            log.warning("update_weights_from_disk refused: %s", exc.message)
            raise ApiError(400, _not_loadable(body.model_path)) from None
        lock = self.update_lock.writer() if not self.engine.paused else contextlib.nullcontext()
        async with lock:
            return await self._load_weights(path, body)

    async def _load_weights(self, path: Path, body: UpdateWeightsBody) -> dict[str, Any]:
        try:
            new_model = await asyncio.to_thread(load_model, path, torch.device("cpu"), self.model_impl)
        except Exception as exc:
            log.warning("update_weights_from_disk could not load %s: %s: %s", path, type(exc).__name__, exc)
            raise ApiError(400, _not_loadable(body.model_path)) from None
        if body.abort_all_requests:
            await asyncio.to_thread(self.engine.abort, None, "aborted by update_weights_from_disk")
        version = None if body.weight_version is None else str(body.weight_version)
        try:
            await asyncio.to_thread(self.engine.load_weights, new_model, version)
        except ValueError as exc:  # shape/key mismatch: the served weights are untouched
            raise ApiError(400, f"weights at {body.model_path!r} do not match the served model: {exc}") from exc
        self.model_path = str(path)
        self.weight_loads += 1
        return {"success": True, "message": f"loaded {path}", "weight_version": self.engine.weight_version,
                "num_paused_requests": 0}

    # ------------------------------------------------------------------ info
    def server_info(self) -> dict[str, Any]:
        info = {**asdict(self.args), "model_path": self.model_path, "engine": "relax-builtin",
                "served_by": self.served_by.value,
                "version": __version__, "tp_size": 1, "weight_version": self.engine.weight_version,
                "max_total_num_tokens": self.args.max_total_tokens, "device": str(self.device),
                "paused": self.engine.paused, "uptime_s": time.time() - self._started_at,
                "weight_loads": self.weight_loads,
                "weight_update_groups": sorted(self.distributed.groups),
                "distributed_buckets_loaded": self.distributed.buckets_loaded,
                "health_checks": self.health.gets, "health_generations": self.health.calls,
                "health_reused": self.health.reused,
                "anonymous_answered": self.anonymous_pace.answered, "anonymous_waited": self.anonymous_pace.waited,
                "anonymous_refused": self.anonymous_pace.refused,
                "stream_writes_waiting": self.client_waits.waiting, "streams_stalled": self.client_waits.stalled,
                "stats": asdict(self.engine.stats())}
        return info

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.args.model_path, "is_generation": True,
                "served_model_name": self.model_name, "weight_version": self.engine.weight_version,
                "architectures": list(getattr(self.config, "architectures", None) or []),
                "vocab_size": self.vocab_size, "max_context_length": self.max_context}


def create_app(server: BuiltinServer) -> FastAPI:
    app = FastAPI(title="Relax built-in engine", version=__version__)
    engine = server.engine
    key, admin_key = server.args.api_key, server.args.admin_api_key

    if key or admin_key:
        @app.middleware("http")
        async def _require_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            path = request.url.path
            if authorized(path, request.headers.get("authorization"), key, admin_key):
                return await call_next(request)
            which = "admin" if is_admin_route(path) and admin_key else "API"
            return _error(401, f"unauthorized: {path} needs 'Authorization: Bearer <this engine's {which} key>'")

    if key or admin_key:
        # callers without a key are answered at a bounded pace, on every route (their 401s cost as much as an
        # answer); the run's own calls carry a key (relax.pace). An engine without keys is open to all for
        # everything: pacing would slow its callers and stop no one
        app.add_middleware(PaceAnonymous, pace=server.anonymous_pace,
                           trusted=lambda header: carries_a_key(header, key, admin_key), refusal=_refusal)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _describe_validation(exc))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(WeightUpdateError)
    async def _weight_update_error(_: Request, exc: WeightUpdateError) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=400)  # SGLang's shape

    @app.on_event("shutdown")
    async def _shutdown() -> None:
        await asyncio.to_thread(engine.stop)
        server.distributed.close()

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Any:
        if body.stream:
            return server.stream(body)
        return await server.generate(body, disconnected=request.is_disconnected)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> dict[str, str]:
        """SGLang's health check: a one-token generation, 503 when it does not answer in time; concurrent checks
        share one generation (relax.engines.builtin.health).

        So, as on SGLang, a probe fails while generation is paused for longer than the timeout or while a
        weight load holds the writer lock; the manager does not probe an engine it is loading.
        """
        await server.health.get()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        text = server.metrics.render(engine.snapshot(), engine.weight_version)  # never waits for a step
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        await asyncio.to_thread(engine.flush_cache)
        return {"success": True, "message": "cache flushed"}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None) -> dict[str, Any]:
        mode = PauseMode((body or PauseBody()).mode)
        await asyncio.to_thread(engine.pause, mode)
        return {"success": True, "mode": mode.value}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await asyncio.to_thread(engine.resume)
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict[str, Any]:
        if body.abort_all:
            return {"success": True, "aborted": await asyncio.to_thread(engine.abort, None, "aborted by abort_request")}
        count = await asyncio.to_thread(engine.abort, body.rid, "aborted by abort_request")
        if count == 0:
            raise ApiError(404, f"no request with rid {body.rid!r} is queued or running")
        return {"success": True, "aborted": count}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsBody) -> dict[str, Any]:
        return await server.update_weights(body)

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionBody) -> dict[str, Any]:
        """SGLang's route, with its trap: unless told ``abort_all_requests: false`` it aborts everything in flight."""
        if body.abort_all_requests:
            await asyncio.to_thread(engine.abort, None, "aborted by update_weight_version")
        await asyncio.to_thread(engine.set_weight_version, body.new_version)
        return {"success": True, "message": f"weight version set to {body.new_version}",
                "new_version": body.new_version}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> dict[str, Any]:
        return await server.distributed.init_group(body)

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: WeightUpdateSessionBody | None = None) -> dict[str, Any]:
        return server.distributed.begin()

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> dict[str, Any]:
        return await server.distributed.update(body)

    @app.post("/end_weight_update")
    async def end_weight_update(body: WeightUpdateSessionBody | None = None) -> dict[str, Any]:
        return server.distributed.end()

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: WeightsGroupBody | None = None) -> dict[str, Any]:
        return server.distributed.destroy_group((body or WeightsGroupBody()).group_name)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(body: WeightsCheckerBody | None = None) -> dict[str, Any]:
        """SGLang's checksum of every served tensor (``weight_checker``), read as a generation reads them (the
        reader side of the update lock): never half-way through a load from disk, never stalling generation."""
        body = body or WeightsCheckerBody()
        async with server.update_lock.reader():
            answer = await asyncio.to_thread(weights_checksum_answer, engine.runner.model, body)
        if answer is None:
            raise ApiError(400, f"action {body.action!r} is not supported by the built-in engine (checksum)")
        return answer

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang keeps this alias (deprecated, a warning per call)
    async def get_server_info() -> dict[str, Any]:
        return await asyncio.to_thread(server.server_info)

    @app.get("/model_info")  # carries weight_version: SGLang 0.5.23 has no /get_weight_version
    @app.get("/get_model_info")  # deprecated alias, as in SGLang
    async def get_model_info() -> dict[str, Any]:
        return server.model_info()

    return app


def _orphaned() -> None:
    """Our parent (the guard, or whoever started us) is gone: shut down as on SIGTERM, and surely exit."""
    log.warning("parent process gone: shutting down")
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown (the engine's hook runs)
    time.sleep(10)
    os._exit(137)


#: How long a SIGTERMed server waits for requests in flight before it cancels them and stops.
SHUTDOWN_GRACE_S = 1.0


def serve(args: ServerArgs) -> int:
    """Run the server until SIGTERM/SIGINT (uvicorn handles both and runs the shutdown hook); 2 when the
    checkpoint cannot be served as asked (the reason goes to stderr, not a traceback)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = BuiltinServer(args)
    except (ApiError, ModelImplError) as exc:
        print(f"relax engine serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(server)
    server.engine.start()
    parent_watchdog(_orphaned)
    log.info("built-in engine serving %s on http://%s:%d (weight_version=%s, device=%s, model_impl=%s, "
             "stream_stall_timeout=%gs)", server.model_path, args.host, args.port, server.engine.weight_version,
             server.device, server.served_by.value, args.stream_stall_timeout)
    # On SIGTERM uvicorn waits for requests in flight; requests held by a pause (a weight load) never finish,
    # so after SHUTDOWN_GRACE_S they are cancelled and the server stops (their callers retry elsewhere).
    # expose_connection_abort: a stream whose client stopped reading resets its connection (stream_response)
    uvicorn.run(expose_connection_abort(app), host=args.host, port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
