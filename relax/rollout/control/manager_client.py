"""The one client of the RolloutManager actor, for the control plane and the autoscaler.

Its methods are the manager's control API with the same arguments and plain results. What can go wrong
*between* the processes becomes one of three errors, so callers never see Ray's exception zoo: a dead or
restarting manager is :class:`ManagerUnavailable`, a call that outlives ``call_timeout_s`` is
:class:`ManagerTimeout` (an HTTP client or the autoscaler loop must not hang on a stuck actor), and an
unexpected exception inside the manager is :class:`ManagerInternalError` naming it. A domain error the
manager raised on purpose (a scaling rule, an unknown request id) is re-raised as itself.

Ray is imported lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from relax.logs import failure_cause
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec, ScalingError

log = logging.getLogger("relax.rollout")


class ManagerCallError(RuntimeError):
    """A call to the rollout manager did not get an answer from it."""


class ManagerUnavailable(ManagerCallError):
    """The manager actor is dead or restarting."""


class ManagerTimeout(ManagerCallError):
    """The manager did not answer within the call timeout."""


class ManagerInternalError(ManagerCallError):
    """The manager raised something that is not a domain error: a bug, named in the message."""


class ManagerClient:
    """``await client.<method>(...)`` over a RolloutManager actor handle."""

    def __init__(self, handle: Any, *, call_timeout_s: float = 30.0) -> None:
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be positive, got {call_timeout_s}")
        self._handle = handle
        self._timeout = call_timeout_s

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            ref = getattr(self._handle, method).remote(*args)
            return await asyncio.wait_for(_await(ref), timeout=self._timeout)
        except asyncio.TimeoutError:
            raise ManagerTimeout(f"the rollout manager did not answer {method} within {self._timeout:g}s") from None
        except (RayActorError, ActorUnavailableError) as exc:
            raise ManagerUnavailable(f"the rollout manager is unavailable: {failure_cause(exc, 300)}") from None
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ScalingError | _rest_errors()):
                raise cause from None
            log.error("rollout manager %s raised: %s", method, exc)
            shown = cause if cause is not None else exc
            raise ManagerInternalError(
                f"internal error in {method}: {failure_cause(shown, 300)}") from None

    async def engines_view(self, model_name: str | None = None) -> dict[str, Any]:
        return await self._call("engines_view", model_name)

    async def engine_urls(self) -> dict[str, str]:
        return await self._call("engine_urls")

    async def relax_status(self) -> dict[str, Any]:
        return await self._call("relax_status")

    async def events(self, limit: int = 100, kind: str | None = None) -> dict[str, Any]:
        return await self._call("events", limit, kind)

    async def scale_out(self, spec: ScaleOutSpec) -> dict[str, Any]:
        return await self._call("scale_out", spec)

    async def scale_in(self, spec: ScaleInSpec) -> dict[str, Any]:
        return await self._call("scale_in", spec)

    async def list_scale_requests(self, direction: str, status: str | None = None,
                                  model_name: str | None = None) -> list[dict[str, Any]]:
        return await self._call("list_scale_requests", direction, status, model_name)

    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return await self._call("get_scale_request", direction, request_id)

    async def cancel_scale_out(self, request_id: str) -> dict[str, Any]:
        return await self._call("cancel_scale_out", request_id)

    async def verify_engine(self, engine_id: str) -> dict[str, Any]:
        return await self._call("verify_engine", engine_id)

    async def engine_view(self, engine_id: str) -> dict[str, Any]:
        return await self._call("engine_view", engine_id)

    async def cancel_scale_out_batch(self, status_filter: list[str] | None = None,
                                     dry_run: bool = False) -> dict[str, Any]:
        return await self._call("cancel_scale_out_batch", status_filter, dry_run)


def _rest_errors() -> type[BaseException]:
    from relax.rollout.control.api_models import RequestError

    return RequestError


async def _await(ref: Any) -> Any:
    return await ref


__all__ = ["ManagerCallError", "ManagerClient", "ManagerInternalError", "ManagerTimeout", "ManagerUnavailable"]
