"""Weight sync: every ACTIVE engine brought to the newest published version, and never serving a stale one.

The one component of the weight path on the rollout side (docs/architecture.md, "Weights and staleness"). It
owns the rules; how the bytes travel is a :class:`~relax.rollout.weight_transport.WeightTransport`, chosen per
engine and version by ``choose_transport``; the engine's lifecycle (start, fail, retire) is the fleet's.

* **publish** records a version and brings every ACTIVE engine behind it up to date in the background; the
  trainer never waits. A version published while engines sync is picked up when they finish (each engine
  loops until it holds the newest).
* **sync_to_latest** brings one engine to the newest version (a joining engine does this before it is ACTIVE).
  One sync per engine at a time. A version the trainer dropped before its send began (``VersionSuperseded``)
  is skipped for the next one, with the engine untouched.
* **syncing** engines are paused or loading: the fleet does not health-probe them (a paused SGLang fails its
  health generation) and the dispatcher holds their requests (:meth:`wait_not_syncing`).
* A failed load fails the engine (``on_failure``): it is never resumed on part of a version or left serving
  the old one as if current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from relax.config.pause_mode import PauseMode
from relax.rollout.broadcast import BroadcastSettings, BroadcastTransport
from relax.rollout.disk_transports import ExternalDiskTransport, ObjectStoreTransport
from relax.rollout.launcher import EngineLauncher
from relax.rollout.pool import EnginePool, EngineRecord
from relax.rollout.weight_transport import TransportKind, VersionSuperseded, WeightTransport, choose_transport
from relax.training.publication import PublishedWeights, WeightManifest, WeightRegistry

__all__ = ["WeightSync", "engines_behind", "standard_transports"]

log = logging.getLogger("relax.rollout")

#: How long an engine whose version was superseded waits for the newer one to be registered (the trainer held
#: it before it dropped the old one, so it is at most a registration away).
SUPERSEDED_WAIT_S = 60.0


def engines_behind(active: Iterable[EngineRecord], latest_version: int | None) -> list[str]:
    """The ACTIVE engines that hold an older version than ``latest_version`` (none when nothing is published)."""
    if latest_version is None:
        return []
    return [r.engine_id for r in active if (r.weight_version or 0) < latest_version]


def standard_transports(launcher: EngineLauncher, model_path: str, broadcast: BroadcastSettings,
                        pause_mode: PauseMode) -> dict[TransportKind, WeightTransport]:
    """One transport per path, all pausing the engine the same way."""
    return {TransportKind.BROADCAST: BroadcastTransport(broadcast, pause_mode),
            TransportKind.OBJECT_STORE: ObjectStoreTransport(launcher, pause_mode),
            TransportKind.DISK: ExternalDiskTransport(model_path, pause_mode)}


class WeightSync:
    """Published versions → engines, through the transports; the rules above, in one place."""

    def __init__(
        self,
        pool: EnginePool,
        registry: WeightRegistry,
        transports: Mapping[TransportKind, WeightTransport],
        client: Callable[[str], Any],
        *,
        on_failure: Callable[[str, BaseException], Awaitable[None]],
        on_change: Callable[[], None] = lambda: None,
        superseded_wait_s: float = SUPERSEDED_WAIT_S,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.transports = dict(transports)
        self._client = client
        self._on_failure = on_failure
        self._on_change = on_change
        self._superseded_wait_s = superseded_wait_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._idle: dict[str, asyncio.Event] = {}  # per engine: set while it is not loading weights
        self._published = asyncio.Event()  # replaced at each publication; set wakes who waits for a newer one
        self._loop_task: asyncio.Task[None] | None = None
        self.last_syncs: dict[str, dict[str, Any]] = {}  # per engine: its last load's timings

    # ------------------------------------------------------------------ publication
    def publish(self, version: int, bucket_refs: Sequence[Any], manifest: WeightManifest, *,
                source: Any = None) -> PublishedWeights:
        """Record ``version`` (``source``: the trainer's rank 0, for broadcast) and sync every engine behind it."""
        entry = self.registry.publish(version, list(bucket_refs), manifest, sender=source)
        published, self._published = self._published, asyncio.Event()
        published.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._sync_loop())
        return entry

    async def settle(self) -> None:
        """Wait for a publication in progress (a scale-in must not pull an engine out in mid-load)."""
        if self._loop_task is not None and not self._loop_task.done():
            with contextlib.suppress(Exception):
                await self._loop_task

    async def _sync_loop(self) -> None:
        """Bring every ACTIVE engine to the latest version; newer versions published meanwhile win.

        An engine whose load failed is handed to ``on_failure`` once and not retried here (the fleet takes it
        out of service), so a failure the fleet cannot act on never spins this loop.
        """
        failed: set[str] = set()
        while True:
            latest = self.registry.latest()
            behind = [eid for eid in engines_behind(self.pool.active(), None if latest is None else latest.version)
                      if eid not in failed]
            if latest is None or not behind:
                return
            began = time.monotonic()
            results = await asyncio.gather(*(self.sync_to_latest(eid) for eid in behind), return_exceptions=True)
            for eid, res in zip(behind, results, strict=True):
                if isinstance(res, BaseException):
                    failed.add(eid)
                    await self._on_failure(eid, res)  # never serve stale weights
            paused = [p for eid in behind if (p := self.last_syncs.get(eid, {}).get("paused_s")) is not None]
            log.debug("weights v%d on %d engine(s) in %.2fs (engines paused %s)", latest.version, len(behind),
                     time.monotonic() - began, f"max {max(paused):.2f}s" if paused else "n/a")
            self._on_change()

    # ------------------------------------------------------------------ one engine
    async def sync_to_latest(self, engine_id: str) -> None:
        """Bring one engine to the newest published version (looping while newer ones land); raises on failure."""
        async with self._locks.setdefault(engine_id, asyncio.Lock()):
            while True:
                latest = self.registry.latest()
                record = self.pool.get(engine_id)
                if latest is None or (record.weight_version or 0) >= latest.version:
                    return
                kind = choose_transport(latest.broadcast, record.kind)
                idle = self._idle.setdefault(engine_id, asyncio.Event())
                idle.clear()
                began = time.monotonic()
                try:
                    timings = await self.transports[kind].send(engine_id, self._client(engine_id), latest)
                except VersionSuperseded:
                    log.info("%s: weights v%d superseded before its send began; moving on to the newest", engine_id,
                             latest.version)
                    await self._newer_than(latest.version)
                    continue
                finally:
                    idle.set()
                self.last_syncs[engine_id] = {**(timings or {}), "version": latest.version,
                                              "total_s": time.monotonic() - began}
                self.pool.set_weight_version(engine_id, latest.version)

    async def _newer_than(self, version: int) -> None:
        deadline = time.monotonic() + self._superseded_wait_s
        while (latest := self.registry.latest()) is None or latest.version <= version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no weight version newer than v{version} was published within "
                                   f"{self._superseded_wait_s:g}s, and the trainer no longer holds it")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), remaining)

    def is_syncing(self, engine_id: str) -> bool:
        """Paused or loading now: not to be health-probed, its requests held."""
        idle = self._idle.get(engine_id)
        return idle is not None and not idle.is_set()

    async def wait_not_syncing(self, engine_id: str) -> None:
        """Hold a request for an engine that is paused for a weight load until it continues.

        Sent now, it would only wait in the engine's queue, where the autoscaler reads queued requests as
        missing capacity; more engines would not help, they pause for each publication too. Held here, the
        wait still shows in the request's latency and the rollout's time, but not as a queue.
        """
        if self.is_syncing(engine_id):
            await self._idle[engine_id].wait()

    async def forget(self, engine_id: str, client: Any | None) -> None:
        """The engine leaves: each transport releases what it keeps for it (its weight group)."""
        for transport in self.transports.values():
            await transport.forget(engine_id, client)
        self._locks.pop(engine_id, None)
        idle = self._idle.pop(engine_id, None)
        if idle is not None:
            idle.set()  # nothing waits on a departed engine

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
