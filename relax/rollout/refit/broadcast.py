"""Broadcast weight updates, driven from the rollout manager: one group per engine, one collective per bucket.

The sequence for one engine and one version (SGLang 0.5.23's distributed protocol, docs/architecture.md,
"Weights and staleness"):

1. once per engine: the trainer's rank 0 hosts a rendezvous (``WeightSource.open``); the engine joins with
   ``/init_weights_update_group`` (rank 1 of 1 + its TP ranks) while rank 0 joins the same group;
2. per version: ``/pause_generation`` (the configured mode), ``/begin_weight_update``, then per bucket
   ``/update_weights_from_distributed`` (``flattened_bucket``) *and* rank 0's broadcast of that bucket, at the
   same time; the last bucket carries ``weight_version``; ``/end_weight_update``, ``/continue_generation``;
3. when the engine leaves: ``/destroy_weights_update_group`` and rank 0 closes its side.

:class:`BroadcastTransport` is this path behind the ``WeightTransport`` port (``rollout.refit.transport``).

Every step has a deadline. An engine that dies or stops answering mid-broadcast fails its own update (and
is then failed by the fleet, never resumed on half-loaded weights); the trainer's side of that group is
abandoned and times out on its own thread, so neither training nor any other engine waits for it.

The trainer's rank 0 is reached through a :class:`WeightSource`: :class:`RayWeightSource` wraps its actor
handle (the calls go to the actor's "weights" concurrency group), :class:`ThreadWeightSource` an in-process
``WeightSender`` (tests, ``relax.testing``). No Ray import here: Ray's object refs are awaitables.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from relax.rollout.refit.rules import load_verified
from relax.rollout.refit.transport import Check, VersionSuperseded
from relax.rollout.settings import BroadcastSettings
from relax.weights.flat_bucket import BucketSpec, specs_from_manifest
from relax.weights.pause_mode import PauseMode
from relax.weights.publication import WEIGHTS_CONCURRENCY_GROUP, WeightManifest

if TYPE_CHECKING:  # the sender holds tensors (torch); the manager, which imports this module, never needs it
    from relax.training.sender import WeightSender

log = logging.getLogger("relax.rollout")

FLATTENED = "flattened_bucket"


class WeightSource(Protocol):
    """The trainer's rank 0 as the broadcast's sender (``relax.training.sender.WeightSender``'s calls)."""

    async def open(self, name: str, world_size: int, backend: str, timeout_s: float) -> dict[str, Any]: ...

    async def wait_open(self, name: str, timeout_s: float) -> None: ...

    async def acquire(self, version: int, lease_s: float) -> bool: ...

    async def release(self, version: int) -> None: ...

    async def broadcast(self, name: str, version: int, index: int) -> int: ...

    async def checksums(self, version: int, timeout_s: float, algorithm: str) -> dict[str, str]: ...

    async def close(self, name: str) -> None: ...


class RayWeightSource:
    """A trainer actor's ``weights_*`` methods, on its "weights" concurrency group."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def _call(self, method: str, *args: Any) -> Any:
        return getattr(self.actor, method).options(concurrency_group=WEIGHTS_CONCURRENCY_GROUP).remote(*args)

    async def open(self, name: str, world_size: int, backend: str, timeout_s: float) -> dict[str, Any]:
        return await self._call("weights_open", name, world_size, backend, timeout_s)

    async def wait_open(self, name: str, timeout_s: float) -> None:
        await self._call("weights_wait_open", name, timeout_s)

    async def acquire(self, version: int, lease_s: float) -> bool:
        return await self._call("weights_acquire", version, lease_s)

    async def release(self, version: int) -> None:
        await self._call("weights_release", version)

    async def broadcast(self, name: str, version: int, index: int) -> int:
        return await self._call("weights_broadcast", name, version, index)

    async def checksums(self, version: int, timeout_s: float, algorithm: str) -> dict[str, str]:
        return await self._call("weights_checksums", version, timeout_s, algorithm)

    async def close(self, name: str) -> None:
        await self._call("weights_close", name)


class ThreadWeightSource:
    """An in-process sender, its blocking calls on threads (the same code path as the trainer actor's)."""

    def __init__(self, sender: WeightSender) -> None:
        self.sender = sender

    async def open(self, name: str, world_size: int, backend: str, timeout_s: float) -> dict[str, Any]:
        return await asyncio.to_thread(self.sender.open, name, world_size, backend, timeout_s)

    async def wait_open(self, name: str, timeout_s: float) -> None:
        await asyncio.to_thread(self.sender.wait_open, name, timeout_s)

    async def acquire(self, version: int, lease_s: float) -> bool:
        return await asyncio.to_thread(self.sender.acquire, version, lease_s)

    async def release(self, version: int) -> None:
        await asyncio.to_thread(self.sender.release, version)

    async def broadcast(self, name: str, version: int, index: int) -> int:
        return await asyncio.to_thread(self.sender.broadcast, name, version, index)

    async def checksums(self, version: int, timeout_s: float, algorithm: str) -> dict[str, str]:
        return await asyncio.to_thread(self.sender.checksums, version, timeout_s, algorithm)

    async def close(self, name: str) -> None:
        await asyncio.to_thread(self.sender.close, name)


@dataclass
class EngineGroup:
    """One engine's open weight group."""

    name: str
    source: WeightSource
    world_size: int
    backend: str


def group_name(engine_id: str) -> str:
    """Unique per join: a restarted engine never meets a half-closed group of its predecessor."""
    return f"relax-{engine_id}-{uuid.uuid4().hex[:8]}"


async def open_group(engine_id: str, client: Any, source: WeightSource, settings: BroadcastSettings) -> EngineGroup:
    """Set up the engine's weight group with rank 0; closes what was opened when any side fails."""
    name = group_name(engine_id)
    world_size = 1 + settings.ranks_per_engine
    began = time.monotonic()
    info = await asyncio.wait_for(source.open(name, world_size, settings.backend, settings.timeout_s),
                                  settings.timeout_s)
    try:
        await _together((
            client.init_weights_update_group(info["master_address"], info["master_port"], 1, world_size,
                                             group_name=name, backend=settings.backend, timeout=settings.timeout_s),
            source.wait_open(name, settings.timeout_s),
        ), settings.timeout_s + 5.0, f"{engine_id} did not join weight group {name} within {settings.timeout_s:g}s")
    except BaseException:
        await _quietly(source.close(name))
        raise
    log.info("%s: weight group %s open (%s, world size %d) in %.2fs", engine_id, name, settings.backend,
             world_size, time.monotonic() - began)
    return EngineGroup(name, source, world_size, settings.backend)


async def close_group(group: EngineGroup, client: Any | None, timeout_s: float = 5.0) -> None:
    """Both sides leave (best effort: the engine may be gone already)."""
    if client is not None:
        await _quietly(asyncio.wait_for(client.destroy_weights_update_group(group.name, timeout=timeout_s),
                                        timeout_s))
    await _quietly(asyncio.wait_for(group.source.close(group.name), timeout_s))


async def send_version(engine_id: str, client: Any, group: EngineGroup, version: int, manifest: WeightManifest,
                       pause_mode: PauseMode, timeout_s: float, check: Check | None = None, *,
                       verify_only: bool = False) -> dict[str, Any]:
    """Pause, receive every bucket of ``version`` by broadcast, check (``check``), continue; returns the timings.

    The check runs before the engine continues; a mismatch reloads every bucket once (``rollout.refit.rules``). On any
    failure the engine is left paused and the error raised: the caller fails the engine rather than let it
    serve a mix of two versions. ``verify_only``: the engine holds ``version`` already; it is paused and checked,
    and loaded only to repair a mismatch.
    """
    specs = specs_from_manifest(manifest.names, manifest.dtypes, manifest.shapes, manifest.bucket_sizes)
    # pinned on the sender for the whole send, a repair's second load included (each step has timeout_s)
    lease_s = timeout_s * (2 * len(specs) + 8)
    if not await asyncio.wait_for(group.source.acquire(version, lease_s), timeout_s):
        raise VersionSuperseded(f"weight version {version} is no longer held by the trainer's rank 0")
    transfers: list[float] = []

    async def load() -> int:
        await asyncio.wait_for(client.begin_weight_update(), timeout_s)
        began = time.monotonic()
        sent = 0
        for index, spec in enumerate(specs):
            sent += await _one_bucket(client, group, version, index, spec, last=index == len(specs) - 1,
                                      flush=PauseMode(pause_mode).flushes_cache, timeout_s=timeout_s)
        transfers.append(time.monotonic() - began)
        await asyncio.wait_for(client.end_weight_update(), timeout_s)
        return sent

    try:
        try:
            async with client.paused(pause_mode, timeout=timeout_s) as window:
                sent, checks = await load_verified(load, check, loaded=verify_only)
        except VersionSuperseded:
            # its check was overtaken by a newer publication: the version loaded whole (the trainer's own weights),
            # so the engine goes on; the sync moves on to the newest version and checks that one
            await asyncio.wait_for(client.continue_generation(), timeout_s)
            raise
    finally:
        await _quietly(asyncio.wait_for(group.source.release(version), timeout_s))  # else its lease lapses
    transfer_s = transfers[0] if transfers else 0.0
    log.debug("%s: weights v%d by broadcast, %d buckets, %.1f MiB in %.2fs (paused %.2fs)", engine_id, version,
              len(specs), (sent or 0) / 2**20, transfer_s, window.seconds)
    # receive and load are one step per bucket here (the engine copies each bucket as it arrives): load_s = transfer_s
    return {"path": "broadcast", "transfer_s": transfer_s, "load_s": transfer_s, "paused_s": window.seconds,
            "verify_s": sum(c.seconds for c in checks), "bytes": sent or 0, "buckets": len(specs),
            "verifications": checks}


async def _one_bucket(client: Any, group: EngineGroup, version: int, index: int, spec: BucketSpec, *, last: bool,
                      flush: bool, timeout_s: float) -> int:
    sent, _ = await _together((
        group.source.broadcast(group.name, version, index),
        client.update_weights_from_distributed(
            **spec.to_body(), group_name=group.name, weight_version=version if last else None, load_format=FLATTENED,
            flush_cache=last and flush, timeout=timeout_s),
    ), timeout_s, f"bucket {index} of v{version} not through group {group.name} within {timeout_s:g}s")
    return int(sent)


async def _together(awaitables: tuple[Any, ...], timeout_s: float, late: str) -> list[Any]:
    """Both sides of a collective, side by side: the first failure raises (a dead engine, a superseded version),
    the deadline raises ``TimeoutError(late)``. Either way the other side is cancelled and awaited, so no
    outcome goes unretrieved (asyncio would log "exception was never retrieved" with a traceback)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done:
                task.result()
        if len(done) < len(tasks):
            raise TimeoutError(late)
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:  # noqa: BLE001 - leaving a group that is already broken
        log.debug("closing a weight group: %s", exc)


class BroadcastTransport:
    """The broadcast path as a ``WeightTransport``: one weight group per engine, opened on its first version.

    A version that comes from another sender than the engine's group (a restarted trainer) closes the old group
    and opens a new one. A failed send closes the trainer's side (the engine is failed by the caller); a
    superseded one leaves engine and group as they were.
    """

    def __init__(self, settings: BroadcastSettings, pause_mode: PauseMode) -> None:
        self.settings = settings
        self.pause_mode = pause_mode
        self._groups: dict[str, EngineGroup] = {}

    async def send(self, engine_id: str, client: Any, latest: Any, check: Check | None = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        group = self._groups.get(engine_id)
        if group is not None and group.source is not latest.sender:
            await close_group(self._groups.pop(engine_id), client)
            group = None
        if group is None:
            group = await open_group(engine_id, client, latest.sender, self.settings)
            self._groups[engine_id] = group
        try:
            return await send_version(engine_id, client, group, latest.version, latest.manifest, self.pause_mode,
                                      self.settings.timeout_s, check, verify_only=verify_only)
        except VersionSuperseded:
            raise  # the version was dropped (before its send, or during its check): the engine keeps its group
        except BaseException:
            self._groups.pop(engine_id, None)
            await close_group(group, None)  # the trainer's side; the engine is failed by the caller
            raise

    async def forget(self, engine_id: str, client: Any | None) -> None:
        group = self._groups.pop(engine_id, None)
        if group is not None:
            await close_group(group, client)
