"""The control plane's HTTP routes: ``/rollout/*``, ``/metrics``, ``/health``, and the autoscaler mount.

Routes are deliberately thin. Each one validates what the client sent with the strict pydantic bodies of
:mod:`relax.rollout.control.api_models` (so a malformed request is a 4xx naming the field and never reaches the
backend), turns the body into the scaling core's spec, makes one call on the *backend* and answers its
result. All rules (absolute targets, the initial-engine floor, one operation at a time, sticky cancel) live
behind the backend, in :mod:`relax.rollout.scaling` and :mod:`relax.rollout.fleet.executor`, where the autoscaler
reaches them through the same methods (docs/architecture.md, "Scale requests").

The backend is any object with the async methods of :class:`RolloutBackend`: the
:class:`~relax.rollout.control.manager_client.ManagerClient` of a run, or an in-process
``relax.testing.local_rollout.LocalRollout``. It returns plain values and raises typed errors; this module
is the only place where an error becomes an HTTP status code (:func:`status_of`).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Mapping
from typing import Annotated, Any, Protocol, runtime_checkable

from fastapi import APIRouter, Body, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from relax.pace import Pace, PaceAnonymous
from relax.rollout.control.api_models import (
    CancelBatchBody,
    CancelBatchResponse,
    EngineDetailView,
    EnginesResponse,
    ErrorResponse,
    ScaleAccepted,
    ScaleInBody,
    ScaleInDryRun,
    ScaleInRequestView,
    ScaleNoop,
    ScaleOutBody,
    ScaleOutRequestView,
    WeightVerificationView,
    _error_items,
    describe_validation_error,
    http_status_of,
)
from relax.rollout.control.manager_client import ManagerInternalError, ManagerTimeout, ManagerUnavailable
from relax.rollout.control.metrics import CONTENT_TYPE, render_metrics
from relax.rollout.control.prometheus_sd import sd_groups
from relax.rollout.pool.events import EventKind
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec
from relax.single_flight import SharedCall

log = logging.getLogger("relax.api")

__all__ = ["RolloutBackend", "create_app", "status_of"]

OPEN_PATHS = frozenset({"/health", "/metrics"})
#: How old the ``/metrics`` snapshot may be: Prometheus scrapes every 15 s by default, so a second is fresh.
METRICS_MAX_AGE_S = 1.0
"""Paths served without a token: a load balancer, a liveness probe or Prometheus must not need the secret."""

MAX_EVENTS_LIMIT = 10_000

_CALL_ERRORS: dict[type[BaseException], int] = {ManagerUnavailable: 503, ManagerTimeout: 504,
                                                ManagerInternalError: 500}


def status_of(error: BaseException) -> int | None:
    """The HTTP status for an error a backend raised; ``None`` for an unexpected one (a bug: 500)."""
    status = http_status_of(error)
    if status is not None:
        return status
    for kind, code in _CALL_ERRORS.items():
        if isinstance(error, kind):
            return code
    return None


@runtime_checkable
class RolloutBackend(Protocol):
    """What the routes call: the rollout manager's control API (see ``rollout.control.backend``)."""

    def engines_view(self, model_name: str | None) -> Awaitable[dict[str, Any]]: ...

    def engine_view(self, engine_id: str) -> Awaitable[dict[str, Any]]: ...

    def scale_out(self, spec: ScaleOutSpec) -> Awaitable[dict[str, Any]]: ...

    def scale_in(self, spec: ScaleInSpec) -> Awaitable[dict[str, Any]]: ...

    def list_scale_requests(
        self, direction: str, status: str | None, model_name: str | None
    ) -> Awaitable[list[dict[str, Any]]]: ...

    def get_scale_request(self, direction: str, request_id: str) -> Awaitable[dict[str, Any]]: ...

    def cancel_scale_out(self, request_id: str) -> Awaitable[dict[str, Any]]: ...

    def cancel_scale_out_batch(self, status_filter: list[str] | None, dry_run: bool) -> Awaitable[dict[str, Any]]: ...

    def events(self, limit: int, kind: str | None) -> Awaitable[dict[str, Any]]: ...

    def verify_engine(self, engine_id: str) -> Awaitable[dict[str, Any]]: ...

    def relax_status(self) -> Awaitable[dict[str, Any]]: ...


class EventView(BaseModel):
    """One entry of ``GET /rollout/events`` (see :class:`relax.rollout.pool.events.Event`)."""

    seq: int
    kind: EventKind
    timestamp: float
    message: str
    engine_ids: list[str]
    request_id: str | None
    details: dict[str, Any]


class EventsResponse(BaseModel):
    """``GET /rollout/events``: newest first; ``total`` counts every event ever, ``dropped`` those forgotten."""

    events: list[EventView]
    total: int
    dropped: int


class PrometheusTargetGroup(BaseModel):
    """One group of ``GET /rollout/prometheus_sd`` (Prometheus's http_sd format): one ACTIVE engine."""

    targets: list[str]
    labels: dict[str, str]


# -- answering --------------------------------------------------------------------------------------


async def _answer(call: Awaitable[Any]) -> JSONResponse:
    """Await one backend call; its result is the 200 body, an error it raises is answered by its status."""
    try:
        return JSONResponse(await call, status_code=200)
    except Exception as exc:
        status = status_of(exc)
        if status is None:  # a bug behind the backend: say so in JSON instead of a bare 500 page
            log.exception("rollout backend call failed")
            return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)
        body = exc.to_dict() if callable(getattr(exc, "to_dict", None)) else {"detail": str(exc), "field": None}
        return JSONResponse(body, status_code=status)


_ERROR_DESCRIPTIONS = {
    400: "a rule refused the request, or the body is not JSON (the message names the field)",
    401: "missing or wrong bearer token",
    404: "unknown model or request id",
    409: "another scale operation is running (running_request_id says which)",
    415: "the body is not JSON",
    422: "the body does not have the contract's shape (wrong type, unknown field, bad URL...)",
    503: "the rollout manager is not reachable",
    504: "the rollout manager did not answer in time",
}


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI documentation of the 4xx answers; all share :class:`ErrorResponse`'s shape."""
    return {code: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]} for code in codes}


# -- validation errors -------------------------------------------------------------------------------

_BODY_MODELS: dict[str, type[BaseModel]] = {
    "/rollout/scale_out": ScaleOutBody,
    "/rollout/scale_in": ScaleInBody,
    "/rollout/scale_out_cancel": CancelBatchBody,
}


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """One-line ``detail`` naming the field, for body and query errors alike.

    Status: 400 when the body is not even JSON (a syntax error), 415 when it was sent as something else
    than JSON (``curl -d`` without ``-H 'Content-Type: application/json'`` is the usual cause), 422 for a
    JSON body or query of the wrong shape.
    """
    assert isinstance(exc, RequestValidationError)
    route = request.scope.get("route")
    model = _BODY_MODELS.get(getattr(route, "path", ""))
    errors = exc.errors()
    kinds = {e.get("type") for e in errors}
    if "json_invalid" in kinds:
        status = 400
    elif any(e.get("type") == "model_attributes_type" and isinstance(e.get("input"), bytes) for e in errors):
        content_type = request.headers.get("content-type", "none")
        return JSONResponse(
            {
                "detail": f"body: send a JSON object with 'Content-Type: application/json' (got {content_type})",
                "field": "body",
            },
            status_code=415,
        )
    else:
        status = 422
    items = _error_items(exc, model)
    return JSONResponse(
        {
            "detail": describe_validation_error(exc, model),
            "field": items[0]["field"] if items else None,
            "errors": items,
        },
        status_code=status,
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own HTTP errors in :class:`ErrorResponse`'s shape (``detail`` and ``field``).

    The routes never raise ``HTTPException``; FastAPI does for an unknown path (404) or method (405), and with a
    bare ``400 There was an error parsing the body`` when ``json.loads`` fails other than by a syntax error: an
    integer of more than 4300 digits, or nesting deeper than the recursion limit. That 400 is answered like any
    other undecodable body, naming ``body`` and saying why.
    """
    assert isinstance(exc, StarletteHTTPException)
    detail, field = exc.detail, None
    if exc.status_code == 400 and exc.__cause__ is not None:
        reason = str(exc.__cause__) or type(exc.__cause__).__name__
        detail, field = f"body: invalid JSON: {reason if len(reason) <= 200 else reason[:197] + '...'}", "body"
    return JSONResponse({"detail": detail, "field": field}, status_code=exc.status_code, headers=exc.headers)


# -- auth -------------------------------------------------------------------------------------------


class BearerAuth:
    """Require ``Authorization: Bearer <token>`` on every path except :data:`OPEN_PATHS`.

    An ASGI middleware rather than a route dependency so that nothing can be mounted unguarded: the
    autoscaler router, ``/metrics``, ``/openapi.json`` and ``/docs`` are covered whoever adds them. The
    comparison is constant-time (``hmac.compare_digest``) so the token cannot be guessed byte by byte.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        problem = _token_problem(header, self._token)
        if problem is None:
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {"detail": problem, "field": None}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)


def _token_problem(header: str | None, token: bytes) -> str | None:
    """What is wrong with ``Authorization: header`` for the run's ``token``; None when it carries the token.

    The comparison is constant-time (``hmac.compare_digest``) so the token cannot be guessed byte by byte."""
    scheme, _, credentials = (header or "").partition(" ")
    if not header:
        return "missing 'Authorization: Bearer <token>' header (the token is RELAX_API_TOKEN)"
    if scheme.lower() != "bearer" or not credentials.strip():
        return "the Authorization header must be 'Bearer <token>'"
    if not hmac.compare_digest(credentials.strip().encode("latin-1", "replace"), token):
        return "invalid token: it does not match the run's RELAX_API_TOKEN"
    return None


def _refusal(message: str, retry_after_s: int) -> JSONResponse:
    return JSONResponse({"detail": message, "field": None}, status_code=503,
                        headers={"Retry-After": str(retry_after_s)})


# -- the app ----------------------------------------------------------------------------------------

# Module level, not inside the router factory: with postponed annotations FastAPI resolves these names in
# the module's globals.
RequestId = Annotated[str, Path(min_length=1, max_length=128, description="so-<n> or si-<n>")]
EngineId = Annotated[str, Path(min_length=1, max_length=128, description="engine_<n>")]
ModelFilter = Annotated[str | None, Query(min_length=1, max_length=256, description="only this model")]
StatusFilter = Annotated[str | None, Query(min_length=1, max_length=32, description="a request status name")]
EventsLimit = Annotated[int, Query(ge=1, le=MAX_EVENTS_LIMIT, description="newest N events")]
EventKindFilter = Annotated[EventKind | None, Query(description="only events of this kind")]
CancelBody = Annotated[CancelBatchBody | None, Body()]


def _rollout_router(backend: RolloutBackend) -> APIRouter:
    # strict_content_type=False: a JSON body sent without a Content-Type header is still parsed as JSON.
    router = APIRouter(prefix="/rollout", tags=["rollout"], strict_content_type=False)

    @router.get("/engines", response_model=EnginesResponse, responses=_error_responses(401, 404, 503))
    async def engines(model_name: ModelFilter = None) -> JSONResponse:
        """Engines of the pool with their lifecycle status; removed and failed ones are hidden."""
        return await _answer(backend.engines_view(model_name))

    @router.get("/engines/{engine_id}", response_model=EngineDetailView, responses=_error_responses(401, 404, 503))
    async def engine(engine_id: EngineId) -> JSONResponse:
        """One engine, live or recently gone: its bring-up phase by phase, its states and its last error."""
        return await _answer(backend.engine_view(engine_id))

    @router.post("/engines/{engine_id}/verify", response_model=WeightVerificationView,
                 responses=_error_responses(400, 401, 404, 503))
    async def verify_engine(engine_id: EngineId) -> JSONResponse:
        """Check an ACTIVE engine's served weights against the trainer's publication of the version it holds (its
        ``/weights_checker``, the engine paused); a mismatch reloads the version once, a second fails the engine."""
        return await _answer(backend.verify_engine(engine_id))

    @router.get(
        "/prometheus_sd", response_model=list[PrometheusTargetGroup], responses=_error_responses(401, 503)
    )
    async def prometheus_sd() -> JSONResponse:
        """Prometheus HTTP service discovery: the ACTIVE engines' metrics addresses (``http_sd_configs``)."""

        async def groups() -> list[dict[str, Any]]:
            return sd_groups(await backend.engines_view(None))

        return await _answer(groups())

    @router.post(
        "/scale_out",
        response_model=ScaleAccepted | ScaleNoop,
        responses=_error_responses(400, 401, 404, 409, 415, 422, 503),
    )
    async def scale_out(body: ScaleOutBody) -> JSONResponse:
        """Grow the pool to ``num_replicas`` engines in total (an absolute target), or attach ``engine_urls``."""
        return await _answer(backend.scale_out(body.to_spec()))

    @router.get(
        "/scale_out", response_model=list[ScaleOutRequestView], responses=_error_responses(400, 401, 404, 503)
    )
    async def list_scale_out(status: StatusFilter = None, model_name: ModelFilter = None) -> JSONResponse:
        """Scale-out requests, newest first (the newest 100 finished ones are kept)."""
        return await _answer(backend.list_scale_requests("scale_out", status, model_name))

    @router.get("/scale_out/{request_id}", response_model=ScaleOutRequestView, responses=_error_responses(401, 404))
    async def get_scale_out(request_id: RequestId) -> JSONResponse:
        """One scale-out request with its per-engine phase timings."""
        return await _answer(backend.get_scale_request("scale_out", request_id))

    @router.post(
        "/scale_out/{request_id}/cancel",
        response_model=ScaleOutRequestView,
        responses=_error_responses(400, 401, 404, 503),
    )
    async def cancel_scale_out(request_id: RequestId) -> JSONResponse:
        """Cancel a running scale-out (sticky: it ends CANCELLED; engines not yet ACTIVE are rolled back)."""
        return await _answer(backend.cancel_scale_out(request_id))

    @router.post(
        "/scale_out_cancel",
        response_model=CancelBatchResponse,
        responses=_error_responses(400, 401, 415, 422, 503),
    )
    async def cancel_scale_out_batch(body: CancelBody = None) -> JSONResponse:
        """Cancel every running scale-out whose status is in ``status_filter`` (all of them without a body)."""
        parsed = body if body is not None else CancelBatchBody()
        return await _answer(backend.cancel_scale_out_batch(parsed.status_filter, parsed.dry_run))

    @router.post(
        "/scale_in",
        response_model=ScaleAccepted | ScaleNoop | ScaleInDryRun,
        responses=_error_responses(400, 401, 404, 409, 415, 422, 503),
    )
    async def scale_in(body: ScaleInBody) -> JSONResponse:
        """Shrink the pool to ``num_replicas`` engines (elastic ones, newest first, after a real drain)."""
        return await _answer(backend.scale_in(body.to_spec()))

    @router.get("/scale_in", response_model=list[ScaleInRequestView], responses=_error_responses(400, 401, 404, 503))
    async def list_scale_in(status: StatusFilter = None, model_name: ModelFilter = None) -> JSONResponse:
        """Scale-in requests, newest first."""
        return await _answer(backend.list_scale_requests("scale_in", status, model_name))

    @router.get("/scale_in/{request_id}", response_model=ScaleInRequestView, responses=_error_responses(401, 404))
    async def get_scale_in(request_id: RequestId) -> JSONResponse:
        """One scale-in request with its victims' drain and shutdown times."""
        return await _answer(backend.get_scale_request("scale_in", request_id))

    @router.get("/events", response_model=EventsResponse, responses=_error_responses(400, 401, 422, 503))
    async def events(limit: EventsLimit = 100, kind: EventKindFilter = None) -> JSONResponse:
        """Scale actions, engine transitions, evictions and failures, newest first."""
        return await _answer(backend.events(limit, None if kind is None else kind.value))

    return router


def _autoscaler_router(autoscaler: Any) -> APIRouter:
    """The router to mount under ``/autoscaler``: an ``APIRouter``, or an object carrying one as ``.router``."""
    router = getattr(autoscaler, "router", autoscaler)
    if not isinstance(router, APIRouter):
        raise TypeError(
            f"autoscaler must be a fastapi.APIRouter or have one as .router, got {type(autoscaler).__name__}"
        )
    return router


def create_app(backend: RolloutBackend, *, token: str | None, autoscaler: Any | None = None,
               pace: Pace | None = None) -> FastAPI:
    """The control plane's FastAPI app over ``backend``.

    ``token`` (the run's ``RELAX_API_TOKEN``) guards every path but ``/health``; ``None`` or ``""`` serves
    without auth, which is only safe on the loopback address the control plane binds by default.
    ``autoscaler`` (an ``APIRouter`` or an object with ``.router``) is mounted under ``/autoscaler``.
    ``pace`` paces callers without the token (default: :class:`relax.pace.Pace`'s terms).
    """
    missing = [name for name in _BACKEND_METHODS if not callable(getattr(backend, name, None))]
    if missing:
        raise TypeError(f"backend {type(backend).__name__} lacks the method(s): {', '.join(missing)}")
    app = FastAPI(
        title="Relax control plane",
        summary="Elastic rollout pool of a Relax RL run: engines, scale requests, events, metrics",
        version="1",
    )
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(_rollout_router(backend))

    @app.get("/health", tags=["control plane"])
    async def health() -> dict[str, str]:
        """Liveness of the control plane itself (no token needed; says nothing about the run)."""
        return {"status": "ok"}

    async def relax_status() -> Any:
        try:
            return await backend.relax_status()
        except Exception as exc:
            if status_of(exc) is None:
                log.exception("relax_status failed")  # once per snapshot, not once per waiting scraper
            raise

    status = SharedCall(relax_status, METRICS_MAX_AGE_S)

    @app.get(
        "/metrics",
        tags=["control plane"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text"}, 503: {}},
    )
    async def metrics() -> Response:
        """Relax's own Prometheus metrics: engines per state, training progress, staleness, scale events.

        Open to anyone, so served from a snapshot taken at most once per :data:`METRICS_MAX_AGE_S`: a flood
        of scrapers costs the rollout manager one call a second, not one per scrape."""
        try:
            body = await status.get()
        except Exception as exc:  # keep the scrape answer a plain-text 503, never a half-written page
            return Response(f"# relax status unavailable: {exc}\n", status_code=503, media_type="text/plain")
        if not isinstance(body, Mapping):
            return Response(f"# relax status unavailable: not a mapping: {body!r:.200}\n", status_code=503,
                            media_type="text/plain")
        return Response(render_metrics(body), media_type=CONTENT_TYPE)

    if autoscaler is not None:
        app.include_router(_autoscaler_router(autoscaler), prefix="/autoscaler")
    _document_error_bodies(app)
    if token:
        app.add_middleware(BearerAuth, token=token)
        _document_bearer_auth(app)
        # callers without the token are answered at a bounded pace, on every path (their 401s cost as much as
        # an answer); callers with it skip the pace (relax.pace). Without a token every route is open to all:
        # pacing would slow the run's own callers and stop no one
        secret = token.encode()
        app.add_middleware(PaceAnonymous, pace=pace or Pace(),
                           trusted=lambda header: _token_problem(header, secret) is None, refusal=_refusal)
    return app


_BACKEND_METHODS = (
    "engines_view",
    "engine_view",
    "scale_out",
    "scale_in",
    "list_scale_requests",
    "get_scale_request",
    "cancel_scale_out",
    "cancel_scale_out_batch",
    "events",
    "relax_status",
)


def _document_error_bodies(app: FastAPI) -> None:
    """Make ``/openapi.json`` describe the error answers the app really sends.

    FastAPI documents a 422 with its own ``HTTPValidationError`` (``detail`` a list) on every operation that
    takes parameters, but :func:`_validation_error` answers every validation error, on every router, with
    :class:`ErrorResponse` (``detail`` a string, ``field``): a client generated from the schema could not read
    them. Operations that read a JSON body may also answer 400 (not JSON) and 415 (not sent as JSON) whether or
    not their router declared them (the autoscaler router declares none).
    """
    build = app.openapi
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.setdefault("ErrorResponse", ErrorResponse.model_json_schema())
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    responses = operation.setdefault("responses", {})
                    codes = (400, 415, 422) if "requestBody" in operation else (422,) if "422" in responses else ()
                    for code in codes:
                        answer = responses.setdefault(str(code), {"description": _ERROR_DESCRIPTIONS[code]})
                        if "HTTPValidationError" in str(answer.get("content")) or "content" not in answer:
                            answer["content"] = error_body
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_bearer_auth(app: FastAPI) -> None:
    """Declare the bearer scheme in ``/openapi.json`` (enforcement is :class:`BearerAuth`'s job)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearerAuth"] = {
                "type": "http",
                "scheme": "bearer",
                "description": "the run's RELAX_API_TOKEN",
            }
            schema["security"] = [{"bearerAuth": []}]
            for path in OPEN_PATHS:
                for operation in schema.get("paths", {}).get(path, {}).values():
                    operation["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
