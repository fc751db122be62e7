"""The domain errors of elastic scaling: what rule a request broke, and what to do instead.

They carry a ``message`` that says what to fix, the body ``field`` to blame when there is one, and a
``to_dict()`` JSON body (``{"detail", "field", ...}``). They carry **no HTTP status**: the REST layer alone
maps error types to status codes (its ``http_status_of``), so the scaling core stays
free of transport concerns. Every error survives pickling, so it can cross a Ray boundary whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from relax.rollout.scaling.states import KNOWN_MODELS

__all__ = [
    "IllegalRequestTransition",
    "NotCancellable",
    "RejectedRequest",
    "ScaleConflict",
    "ScalingError",
    "NoSuchEngine",
    "UnknownModel",
    "UnknownRequest",
]


def _rebuild_error(cls: type[ScalingError], state: dict[str, Any]) -> ScalingError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error


class ScalingError(Exception):
    """Base of every scaling rule violation; ``field`` names the offending request field when there is one."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, Any]:
        """The JSON error body (the REST layer's ``ErrorResponse``)."""
        return {"detail": self.message, "field": self.field}

    def __reduce__(self):  # keep every attribute across a Ray / pickle boundary
        return (_rebuild_error, (type(self), dict(self.__dict__)))


class UnknownModel(ScalingError):
    """``model_name`` names a model this run does not serve."""

    def __init__(self, model_name: str, known: Iterable[str] | None = None) -> None:
        if known is None:
            known = KNOWN_MODELS
        served = ", ".join(repr(m) for m in known)
        super().__init__(f"model_name: unknown model {model_name!r}; this run serves {served}", field="model_name")
        self.model_name = model_name


class RejectedRequest(ScalingError):
    """A well-formed request that the scaling rules refuse (below the initial count, URL not attached...).

    ``code`` is machine-readable (``below_initial``, ``above_max``, ``bad_url``, ``not_enough_victims``,
    ``bad_status``, ``rejected``...), for callers such as the autoscaler that react to the reason.
    """

    def __init__(self, message: str, *, field: str | None = None, code: str = "rejected") -> None:
        super().__init__(message, field=field)
        self.code = code


class ScaleConflict(ScalingError):
    """Another scale operation is running; carries its id so the client can poll or cancel it."""

    def __init__(self, running_request_id: str, running_status: str, direction: str) -> None:
        how = (
            f"cancel it with POST /rollout/scale_out/{running_request_id}/cancel"
            if direction == "scale_out"
            else "scale-in cannot be cancelled"
        )
        super().__init__(
            f"another scale operation is running: {running_request_id} ({direction}, {running_status}); "
            f"one scale operation runs at a time: wait for it to finish (GET /rollout/{direction}/"
            f"{running_request_id}) or {how}"
        )
        self.running_request_id = running_request_id
        self.running_status = running_status
        self.direction = direction

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "running_request_id": self.running_request_id}


class UnknownRequest(ScalingError):
    """No scale request with this id (never existed, other direction, or garbage-collected)."""

    def __init__(self, request_id: str, direction: str | None = None) -> None:
        where = f"{direction} " if direction else "scale "
        super().__init__(f"unknown {where}request id {request_id!r} (only the newest finished requests are kept)")
        self.request_id = request_id


class NoSuchEngine(ScalingError):
    """A request names an engine id the pool does not know (never started, or long gone): the REST answer, with
    the remedy, for what the pool reports as its own lookup error (``relax.rollout.pool.engines.UnknownEngine``)."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(f"unknown engine id {engine_id!r}: GET /rollout/engines lists the engines of this run")
        self.engine_id = engine_id


class NotCancellable(ScalingError):
    """The request can no longer be cancelled (it finished), or is a scale-in (never cancellable)."""

    def __init__(self, request_id: str, status: str, reason: str | None = None) -> None:
        super().__init__(reason or f"request {request_id} is no longer cancellable: it already ended {status}")
        self.request_id = request_id
        self.status = status


class IllegalRequestTransition(ValueError):
    """The shell tried a status move the request state machine forbids: a bug, not a client error."""

    def __init__(self, request_id: str, src: Enum, dst: Enum, why: str = "") -> None:
        super().__init__(f"{request_id}: illegal transition {src.value} -> {dst.value}" + (f" ({why})" if why else ""))
        self.request_id = request_id
        self.src = src
        self.dst = dst
        self.why = why

    def __reduce__(self):
        return (type(self), (self.request_id, self.src, self.dst, self.why))
