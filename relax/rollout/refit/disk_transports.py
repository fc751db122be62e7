"""The two weight paths that load a version from files: through the engine's actor, or written for an external engine.

Both end in ``/update_weights_from_disk`` inside the engine client's pause bracket
(``relax.engines.weight_load.load_from_disk``); they differ in who writes the files and where. Their check
(``rollout.refit.rules``) runs after the load has continued the engine, while the dispatcher still holds its new
requests: unlike the broadcast path, requests that were in flight may resume before it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from relax.engines.weight_load import load_from_disk
from relax.rollout.pool.launcher import EngineLauncher
from relax.rollout.refit.rules import load_verified
from relax.rollout.refit.transport import Check
from relax.weights.pause_mode import PauseMode

__all__ = ["ExternalDiskTransport", "ObjectStoreTransport"]


class ObjectStoreTransport:
    """The engine's actor pulls the buckets from Ray's object store, writes them on its node and loads them."""

    def __init__(self, launcher: EngineLauncher, pause_mode: PauseMode) -> None:
        self.launcher = launcher
        self.pause_mode = pause_mode

    async def send(self, engine_id: str, client: Any, latest: Any, check: Check | None = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        async def load() -> dict[str, Any]:
            return dict(await self.launcher.sync_weights(engine_id, latest.version, list(latest.bucket_refs),
                                                         self.pause_mode) or {})

        timings, checks = await load_verified(load, check, loaded=verify_only)
        return {**(timings or {}), "verify_s": sum(c.seconds for c in checks), "verifications": checks}

    async def forget(self, engine_id: str, client: Any | None) -> None:
        return None


class ExternalDiskTransport:
    """An external engine loads from a directory this process writes: it must share this process's filesystem."""

    def __init__(self, model_path: str, pause_mode: PauseMode) -> None:
        self.model_path = model_path
        self.pause_mode = pause_mode

    async def send(self, engine_id: str, client: Any, latest: Any, check: Check | None = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        from relax.cluster.scratch import weights_root
        from relax.weights.buckets import cleanup_old, materialize

        began = time.monotonic()
        buckets = [await ref for ref in latest.bucket_refs]
        root = weights_root(f"external-{engine_id}")
        path = await asyncio.to_thread(materialize, buckets, self.model_path, root / f"v{latest.version}")
        written = time.monotonic()

        async def load() -> float:
            window = await load_from_disk(client, path, latest.version, self.pause_mode,
                                          nbytes=latest.manifest.total_bytes)
            return window.seconds

        paused_s, checks = await load_verified(load, check, loaded=verify_only)
        await asyncio.to_thread(cleanup_old, root, 1)
        return {"path": "disk", "write_s": written - began, "load_s": time.monotonic() - written,
                "paused_s": paused_s or 0.0, "verify_s": sum(c.seconds for c in checks), "verifications": checks}

    async def forget(self, engine_id: str, client: Any | None) -> None:
        return None
