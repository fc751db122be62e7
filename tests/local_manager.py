"""The autoscaler's backend over the control plane's in-process LocalBackend, for tests.

LocalBackend answers ``relax_status``/``scale_out``/``scale_in``/``get_scale_request`` with the real
registry and pool rules; the one thing it cannot know is where a fake engine's metrics are served, so the
test says that with ``engine_url`` (``None``: no engine is scraped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax.rollout.control_plane import LocalBackend


class LocalManager:
    """``AutoscalerBackend`` over a :class:`LocalBackend`; ACTIVE engines' metrics at ``engine_url(id)``."""

    def __init__(self, local: LocalBackend, engine_url: Callable[[str], str] | None = None) -> None:
        self.local = local
        self.engine_url = engine_url

    async def engine_urls(self) -> dict[str, str]:
        if self.engine_url is None:
            return {}
        return {r.engine_id: self.engine_url(r.engine_id) for r in self.local.pool.active()}

    async def relax_status(self) -> dict[str, Any]:
        return await self.local.relax_status()

    async def scale_out(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.local.scale_out(body)

    async def scale_in(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.local.scale_in(body)

    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return await self.local.get_scale_request(direction, request_id)
