"""Engine lifecycle inside the RolloutManager: bring up, sync weights, drain, remove, fail, restart.

This is the imperative shell around `rollout.pool` (states) and `rollout.router` (in-flight counts).
Every path that takes an engine out of service goes through `_retire`, which is what makes the
guarantees hold everywhere (scale-in, eviction, rollback, failure): the engine leaves the router
first, its in-flight requests finish or are aborted and retried elsewhere, then its process and
placement group go away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from relax.engines.client import EngineClient, EngineError
from relax.engines.launcher import BuiltinOptions
from relax.engines.sglang import SGLangOptions
from relax.rollout.events import EventKind
from relax.rollout.pool import EngineKind, EngineState

if TYPE_CHECKING:
    from relax.rollout.manager import RolloutManager

log = logging.getLogger("relax.rollout")

HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 20.0
HEALTH_FAILURES_BEFORE_FAILED = 3  # consecutive /health failures of a live process = hung
ACTOR_START_ATTEMPTS = 2


@dataclass
class EngineSlot:
    """Where an engine runs: its placement group, bundle, and whether Relax owns that group."""

    placement_group: Any | None
    bundle_index: int = 0
    owns_group: bool = False  # elastic engines: their group is removed with them


class EngineLifecycle:
    """Mixin of RolloutManager (see that class for the attributes it relies on)."""

    # ------------------------------------------------------------------ bring-up
    async def _bring_up(self: RolloutManager, engine_id: str, slot: EngineSlot | None, url: str | None = None) -> None:
        """STARTING → HEALTH_CHECKING → WEIGHT_SYNCING → ACTIVE; raises (engine FAILED) on any error.

        With a slot, an EngineActor starts the server inside it; with a url (external engine) the running
        server is only checked.
        """
        try:
            if url is None:
                assert slot is not None
                self._slots[engine_id] = slot
                self.pool.transition(engine_id, EngineState.STARTING)
                info = await self._spawn_actor(engine_id, slot)
                url = info["url"]
                self.pool.set_node_id(engine_id, info.get("node_id"))
            self.pool.set_url(engine_id, url)
            if self.pool.get(engine_id).state is EngineState.PENDING:
                self.pool.transition(engine_id, EngineState.STARTING)
            self.pool.transition(engine_id, EngineState.HEALTH_CHECKING)
            client = EngineClient(url, timeout=self.cfg.request_timeout_s)
            self._clients[engine_id] = client
            await client.health_generate(timeout=self.cfg.health_timeout_s)
            if self.pool.get(engine_id).kind is EngineKind.EXTERNAL:
                self.pool.set_weight_version(engine_id, _version_or_zero(await client.get_weight_version()))
            else:
                self.pool.set_weight_version(engine_id, 0)
            self.pool.transition(engine_id, EngineState.WEIGHT_SYNCING)
            await self._sync_engine_to_latest(engine_id)
            self._check_cancelled(engine_id)
            self.pool.transition(engine_id, EngineState.ACTIVE)
        except BaseException as exc:
            await self._cleanup_failed(engine_id, exc)
            raise
        self.router.add(engine_id)
        self._routable.set()
        self._state_changed.set()
        latest = self.registry.latest_version or 0
        held = self.pool.get(engine_id).weight_version
        self.events.append(EventKind.ENGINE_STATE, f"ACTIVE at {url} with weights v{held}", engine_ids=engine_id,
                           details={"weight_version": held, "latest_published": latest})
        log.info("%s ACTIVE at %s (weights v%s)", engine_id, url, self.pool.get(engine_id).weight_version)

    async def _spawn_actor(self: RolloutManager, engine_id: str, slot: EngineSlot) -> dict[str, Any]:
        from relax.engines.actor import spawn_engine_actor

        me = ray.get_runtime_context().current_actor
        backend = resolve_backend(self.cfg.backend)
        options: BuiltinOptions | SGLangOptions
        if backend == "sglang":
            options = SGLangOptions(
                tp_size=self.cfg.gpus_per_engine,
                mem_fraction_static=self.cfg.sglang_mem_fraction_static,
                extra_args=self.cfg.sglang_extra_args,
            )
        else:
            options = BuiltinOptions(max_running_requests=self.cfg.max_running_requests, num_threads=1)
        for attempt in range(1, ACTOR_START_ATTEMPTS + 1):
            actor = spawn_engine_actor(
                engine_id,
                backend,
                self.cfg.model_path,
                placement_group=slot.placement_group,
                bundle_index=slot.bundle_index,
                num_gpus=1,
                num_cpus=1,
                weight_version=0,
                options=options,
                host=resolve_engine_host(self.cfg.engine_host),
                log_dir=self.cfg.engine_log_dir,
                env=self.cfg.engine_env,
                on_eviction=(me, "notify_eviction"),
            )
            self._actors[engine_id] = actor
            try:
                return await actor.start.remote()
            except ray.exceptions.RayActorError as exc:
                # The actor's *process* died (a node under pressure, a library that failed to load): that is
                # worth one more try in the same bundle. A server that fails to start is not (ServerLaunchError).
                if attempt == ACTOR_START_ATTEMPTS:
                    raise
                log.warning("%s: engine actor died while starting (%s); retrying in the same bundle", engine_id,
                            str(exc).splitlines()[0])
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        raise AssertionError("unreachable")

    def _check_cancelled(self: RolloutManager, engine_id: str) -> None:
        """Raise when the scale-out that created this engine was cancelled (cancel is sticky)."""
        if engine_id in self._cancelled_engines:
            raise asyncio.CancelledError(f"{engine_id}: its scale-out request was cancelled")

    async def _cleanup_failed(self: RolloutManager, engine_id: str, exc: BaseException) -> None:
        record = self.pool.get(engine_id)
        cancelled = engine_id in self._cancelled_engines
        if not record.state.terminal:
            target = (
                EngineState.REMOVED
                if cancelled and record.state.can_transition_to(EngineState.REMOVED)
                else EngineState.FAILED
            )
            reason = _describe_failure(exc, record.state)
            self.pool.transition(engine_id, target, error=None if cancelled else reason)
        else:
            reason = _describe_failure(exc, record.state)
        if not cancelled:
            self.events.append(EventKind.ENGINE_FAILED, reason, engine_ids=engine_id)
            log.warning("%s failed to come up: %s", engine_id, reason.splitlines()[0])
        await self._release_resources(engine_id, grace_s=5.0)

    # ------------------------------------------------------------------ weights
    async def _sync_engine_to_latest(self: RolloutManager, engine_id: str) -> None:
        """Bring one engine to the newest published version (looping if a newer one lands meanwhile)."""
        lock = self._sync_locks.setdefault(engine_id, asyncio.Lock())
        async with lock:
            while True:
                latest = self.registry.latest()
                record = self.pool.get(engine_id)
                if latest is None or (record.weight_version or 0) >= latest.version:
                    return
                if record.kind is EngineKind.EXTERNAL:
                    await self._sync_external(engine_id, latest)
                else:
                    await self._actors[engine_id].sync_weights.remote(latest.version, list(latest.bucket_refs))
                self.pool.set_weight_version(engine_id, latest.version)

    async def _sync_external(self: RolloutManager, engine_id: str, latest: Any) -> None:
        """External engines load from a directory this actor writes: they must share its filesystem."""
        from relax.training.weights import cleanup_old, default_weights_root, materialize

        buckets = [await ref for ref in latest.bucket_refs]
        root = default_weights_root(f"external-{engine_id}")
        path = await asyncio.to_thread(materialize, buckets, self.cfg.model_path, root / f"v{latest.version}")
        await self._clients[engine_id].update_weights_from_disk(str(path), str(latest.version))
        await asyncio.to_thread(cleanup_old, root, 1)

    # ------------------------------------------------------------------ taking engines out
    async def _retire(
        self: RolloutManager,
        engine_id: str,
        *,
        force: bool,
        drain_timeout_s: float,
        shutdown_timeout_s: float,
        reason: str,
        on_drained: Callable[[int], None] | None = None,
    ) -> int:
        """Drain (real: wait for in-flight requests), then remove. Returns how many requests were aborted
        and retried elsewhere. Safe to call on an engine in any live state."""
        record = self.pool.get(engine_id)
        if record.state.terminal:
            return 0
        if record.state is EngineState.ACTIVE:
            self.router.remove(engine_id)
            self.pool.transition(engine_id, EngineState.DRAINING)
            self._state_changed.set()
            log.info("%s DRAINING (%s), %d request(s) in flight", engine_id, reason, self.router.in_flight(engine_id))
        aborted = 0
        if not force:
            await self._wait_drained(engine_id, drain_timeout_s)
        left = self.router.in_flight(engine_id)
        if left:
            aborted = left
            client = self._clients.get(engine_id)
            if client is not None:
                with contextlib.suppress(EngineError):
                    await client.abort_request(abort_all=True)
            self.events.append(
                EventKind.REQUESTS_RETRIED,
                f"{left} in-flight request(s) aborted and retried on other engines ({reason})",
                engine_ids=engine_id,
            )
            await self._wait_drained(engine_id, max(5.0, self.cfg.request_timeout_s))
        if on_drained is not None:  # drained (or aborted): the shutdown phase starts now
            on_drained(aborted)
        await self._release_resources(engine_id, grace_s=shutdown_timeout_s)
        record = self.pool.get(engine_id)
        if not record.state.terminal:
            self.pool.transition(engine_id, EngineState.REMOVED)
        self._state_changed.set()
        log.info("%s REMOVED (%s; %d request(s) retried elsewhere)", engine_id, reason, aborted)
        return aborted

    async def _wait_drained(self: RolloutManager, engine_id: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.router.drained(engine_id):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            event = self._drain_events.setdefault(engine_id, asyncio.Event())
            event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 1.0))
        return True

    def _note_release(self: RolloutManager, engine_id: str) -> None:
        """Called after every router release: wakes a drain waiting on this engine."""
        self.pool.set_in_flight(engine_id, self.router.in_flight(engine_id))
        event = self._drain_events.get(engine_id)
        if event is not None and self.router.drained(engine_id):
            event.set()

    async def _release_resources(self: RolloutManager, engine_id: str, *, grace_s: float) -> None:
        """Stop the server (SIGTERM, then kill), the actor, the client, and an owned placement group."""
        actor = self._actors.pop(engine_id, None)
        if actor is not None:
            try:
                await asyncio.wait_for(actor.shutdown.remote(grace_s), timeout=grace_s + 10)
            except Exception as exc:  # dead or stuck actor: killing it below is the fallback
                log.info("%s: shutdown: %s", engine_id, str(exc).splitlines()[0] if str(exc) else exc)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        client = self._clients.pop(engine_id, None)
        if client is not None:
            await client.aclose()
        slot = self._slots.get(engine_id)
        if slot is not None and slot.owns_group and slot.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(slot.placement_group)
            slot.placement_group = None

    # ------------------------------------------------------------------ failure and eviction
    async def _process_alive(self: RolloutManager, engine_id: str) -> bool | None:
        """Whether the engine's server process runs (None for external engines: Relax cannot see it)."""
        actor = self._actors.get(engine_id)
        if actor is None:
            return None
        try:
            return bool(await asyncio.wait_for(actor.is_alive.remote(), timeout=HEALTH_TIMEOUT_S))
        except Exception:  # the actor itself is gone or stuck
            return False

    async def _on_engine_failure(self: RolloutManager, engine_id: str, exc: BaseException, *,
                                 confirmed: bool = False) -> None:
        """Out of routing at once (its requests retry elsewhere); initial engines restart in their bundle.

        A request that could not reach an engine is not proof that the engine died: under a burst a healthy
        server can be slow to answer. Unless `confirmed`, the engine is failed only when its process is gone
        (or, for external engines, which Relax cannot look into, at once).
        """
        record = self.pool.get(engine_id)
        if record.state is not EngineState.ACTIVE:  # a draining engine is already on its way out
            return
        if not confirmed and await self._process_alive(engine_id):
            log.info("%s did not answer a request (%s) but its server runs: kept, the request is retried "
                     "elsewhere", engine_id, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        if self.pool.get(engine_id).state is not EngineState.ACTIVE:  # changed while we looked
            return
        self.router.remove(engine_id)
        self.pool.transition(engine_id, EngineState.FAILED, error=str(exc)[:500])
        self._state_changed.set()
        self.events.append(EventKind.ENGINE_FAILED, str(exc)[:500], engine_ids=engine_id)
        log.warning(
            "%s failed (%s); out of routing, its requests are retried elsewhere",
            engine_id,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        if not self.router.routable():
            self._routable.clear()
        self._spawn_background(self._after_failure(engine_id))

    async def _after_failure(self: RolloutManager, engine_id: str) -> None:
        record = self.pool.get(engine_id)
        slot = self._slots.get(engine_id)
        await self._release_resources(engine_id, grace_s=2.0)
        if record.kind is EngineKind.INITIAL and slot is not None and not self._shutting_down:
            replacement = self.pool.add(EngineKind.INITIAL, bundle=record.bundle)
            self.events.append(
                EventKind.ENGINE_RESTARTED,
                f"{replacement.engine_id} replaces {engine_id} in its bundle",
                engine_ids=(engine_id, replacement.engine_id),
            )
            log.warning("%s replaces failed initial engine %s in its own bundle", replacement.engine_id, engine_id)
            try:
                await self._bring_up(replacement.engine_id, EngineSlot(slot.placement_group, slot.bundle_index))
            except Exception as exc:
                log.error("restarting initial engine %s failed: %s", engine_id, exc)

    async def notify_eviction(self: RolloutManager, engine_id: str) -> None:
        """SIGTERM reached an EngineActor (node reclaimed): drain within the grace period, then remove."""
        if engine_id not in self.pool or self.pool.get(engine_id).state.terminal:
            return
        record = self.pool.get(engine_id)
        self.events.append(EventKind.ENGINE_EVICTED, "SIGTERM received: draining", engine_ids=engine_id)
        log.warning("%s evicted (SIGTERM): draining for up to %.0fs", engine_id, self.cfg.scale_in_drain_timeout_s)
        if record.state is EngineState.DRAINING:  # already leaving (scale-in): that path finishes the job
            return
        slot = self._slots.get(engine_id)
        aborted = await self._retire(
            engine_id,
            force=False,
            drain_timeout_s=self.cfg.scale_in_drain_timeout_s,
            shutdown_timeout_s=self.cfg.scale_in_shutdown_timeout_s,
            reason="evicted",
        )
        self.events.append(
            EventKind.ENGINE_STATE, f"evicted engine removed ({aborted} request(s) retried)", engine_ids=engine_id
        )
        if record.kind is EngineKind.INITIAL and slot is not None and not self._shutting_down:
            replacement = self.pool.add(EngineKind.INITIAL, bundle=record.bundle)
            self.events.append(
                EventKind.ENGINE_RESTARTED,
                f"{replacement.engine_id} replaces evicted {engine_id}",
                engine_ids=(engine_id, replacement.engine_id),
            )
            with contextlib.suppress(Exception):
                await self._bring_up(replacement.engine_id, EngineSlot(slot.placement_group, slot.bundle_index))

    async def _health_loop(self: RolloutManager) -> None:
        """Probe ACTIVE engines; a dead or repeatedly unhealthy one is failed and its requests retried."""
        failures: dict[str, int] = {}

        async def probe(engine_id: str) -> None:
            client = self._clients.get(engine_id)
            if client is None:
                return
            if await self._process_alive(engine_id) is False:
                await self._on_engine_failure(engine_id, RuntimeError("server process exited"), confirmed=True)
                return
            healthy = await client.is_healthy(generate=False, timeout=HEALTH_TIMEOUT_S)
            failures[engine_id] = 0 if healthy else failures.get(engine_id, 0) + 1
            if failures[engine_id] >= HEALTH_FAILURES_BEFORE_FAILED:  # alive but hung
                await self._on_engine_failure(
                    engine_id, RuntimeError(f"/health failed {failures[engine_id]} times in a row"), confirmed=True)

        while not self._shutting_down:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await asyncio.gather(*(probe(r.engine_id) for r in self.pool.active()), return_exceptions=True)

    def _spawn_background(self: RolloutManager, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def resolve_backend(backend: str) -> str:
    """`auto` = SGLang when it is installed here (looked up, never imported), else the built-in engine."""
    if backend != "auto":
        return backend
    import importlib.util

    return "sglang" if importlib.util.find_spec("sglang") is not None else "builtin"


def resolve_engine_host(host: str) -> str:
    """`auto` = loopback while every Ray node shares one address (one machine), else the node's IP."""
    if host != "auto":
        return host
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return "127.0.0.1" if len(addresses) <= 1 else "node"


def _describe_failure(exc: BaseException, state: EngineState) -> str:
    """One operator-readable line; a bare timeout/cancellation says in which phase it struck."""
    if isinstance(exc, asyncio.CancelledError | asyncio.TimeoutError | TimeoutError) and not str(exc):
        return f"timed out while {state.value} (scale-out timeout reached)"
    return (str(exc) or type(exc).__name__)[:500]


def _version_or_zero(value: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
