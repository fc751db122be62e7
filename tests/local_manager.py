"""The autoscaler's backend over the in-process ``LocalRollout``, for tests.

``LocalRollout`` answers ``relax_status``/``scale_out``/``scale_in``/``get_scale_request`` with the real
scaling rules (plain values; a refusal raises the scaling core's typed error), exactly as ``ManagerClient``
does over the RolloutManager actor. The one thing it cannot know is where a fake engine's metrics are served,
so the test says that with ``engine_url`` (``None``: no engine is scraped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec
    from relax.testing.local_rollout import LocalRollout


class LocalManager:
    """``AutoscalerBackend`` over a :class:`LocalRollout`; ACTIVE engines' metrics at ``engine_url(id)``."""

    def __init__(self, local: LocalRollout, engine_url: Callable[[str], str] | None = None) -> None:
        self.local = local
        self.engine_url = engine_url

    async def engine_urls(self) -> dict[str, str]:
        if self.engine_url is None:
            return {}
        return {r.engine_id: self.engine_url(r.engine_id) for r in self.local.pool.active()}

    async def relax_status(self) -> dict[str, Any]:
        return await self.local.relax_status()

    async def scale_out(self, spec: ScaleOutSpec) -> dict[str, Any]:
        return await self.local.scale_out(spec)

    async def scale_in(self, spec: ScaleInSpec) -> dict[str, Any]:
        return await self.local.scale_in(spec)

    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return await self.local.get_scale_request(direction, request_id)
