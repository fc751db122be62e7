"""The autoscaler's REST routes (docs/architecture.md, "The autoscaler"), mounted by the control plane under
``/autoscaler``.

    GET   /status                       bounds, pool, last decision, pending request, timers, last frame
    POST  /enable         {enabled}     turn acting on or off (strict bool; unknown fields are 422)
    GET   /conditions                   every condition of the last evaluation and what blocks acting now
    GET   /health                       is the loop alive, how old is its last scrape, last error
    GET   /scale_history  ?limit=&action=   decisions that acted, newest first
    GET   /config                       the config in effect
    PATCH /config         {partial}     deep-merge, validate, swap in whole; 400 naming the key on error

The handlers are thin on purpose (no logic in route handlers: docs/architecture.md, "Where decisions live"):
each validates what the client sent and makes one call on :class:`~relax.autoscaler.service.AutoscalerService`.
Every answer is built with ``strict_json`` and sent by ``JSONResponse`` (which refuses NaN/inf), so a client
never receives the non-standard ``NaN``/``Infinity`` tokens that strict JSON parsers reject, and with
non-ASCII characters escaped (see :class:`_AsciiJSONResponse`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from relax.autoscaler.config import AutoscalerConfigError
from relax.autoscaler.service import HISTORY_LIMIT, AutoscalerService, config_error_field, strict_json

__all__ = ["EnableBody", "autoscaler_router"]


class EnableBody(BaseModel):
    """``POST /autoscaler/enable``: ``{"enabled": true|false}``; ``"true"`` or ``1`` are refused, not guessed."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool


# Module level (not inside the factory): with postponed annotations FastAPI resolves these in module globals.
HistoryLimit = Annotated[int, Query(ge=1, le=HISTORY_LIMIT, description="newest N decisions")]
HistoryAction = Annotated[Literal["scale_out", "scale_in"] | None, Query(description="only this direction")]
ConfigPatch = Annotated[Any, Body(description='a partial config, e.g. {"scale_out_policy": {"max_delta": 2}}')]


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped, so that any string can be sent.

    Answers echo what the client sent (a config key in ``field``, a URL in the config), and JSON text may carry
    a lone surrogate (``"\\ud800"``) that has no UTF-8 encoding: ``JSONResponse`` failed on it with a 500, and a
    config holding one made every later ``GET /config`` a 500 too. Escaped, it is valid JSON like any other.
    """

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _json(body: Any, status: int = 200) -> JSONResponse:
    return _AsciiJSONResponse(strict_json(body), status_code=status)


def autoscaler_router(service: AutoscalerService) -> APIRouter:
    """An ``APIRouter`` (no prefix: the control plane mounts it under ``/autoscaler``) over ``service``."""
    router = APIRouter(tags=["autoscaler"], strict_content_type=False)

    @router.get("/status")
    async def status() -> JSONResponse:
        """Bounds (floor/ceiling), engines, last decision, pending request, cooldowns, backoff, last frame."""
        return _json(service.status())

    @router.post("/enable")
    async def enable(body: EnableBody) -> JSONResponse:
        """Turn the autoscaler's actions on or off; it keeps scraping and evaluating either way."""
        previous = service.set_enabled(body.enabled)
        return _json({"enabled": service.enabled, "was_enabled": previous})

    @router.get("/conditions")
    async def conditions() -> JSONResponse:
        """Each scale-out (ANY) and scale-in (ALL) condition: value, threshold, streak, and current blockers."""
        return _json(service.conditions())

    @router.get("/health")
    async def health() -> JSONResponse:
        """Loop liveness, last scrape age, error counts and the last error."""
        return _json(service.health())

    @router.get("/scale_history")
    async def scale_history(limit: HistoryLimit = 50, action: HistoryAction = None) -> JSONResponse:
        """Decisions that acted (newest first): time, from -> to, reason, driving metrics, request id, outcome."""
        entries = service.scale_history(limit, action)
        return _json({"entries": entries, "count": len(entries)})

    @router.get("/config")
    async def get_config() -> JSONResponse:
        """The configuration in effect (the ``--autoscaler-config`` YAML plus any PATCHes)."""
        return _json(service.config_dict())

    @router.patch("/config")
    async def patch_config(body: ConfigPatch) -> JSONResponse:
        """Change settings while running; 400 naming the key for unknown keys, wrong types or broken rules."""
        try:
            service.patch_config(body)
        except AutoscalerConfigError as exc:
            message = str(exc)
            return _json({"detail": message, "field": config_error_field(body, message)}, 400)
        return _json(service.config_dict())

    return router
