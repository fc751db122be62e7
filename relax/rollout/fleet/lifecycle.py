"""The engine fleet: the engine lifecycle — bring engines up, keep them healthy, take them out without losing work.

This is the imperative shell around ``rollout.pool.engines`` (engine states) and ``rollout.routing.router``
(who serves what, in-flight counts). Where an engine runs and how its process starts is the launcher's business
(``rollout.pool.launcher``), and talking to a running server goes through an HTTP client made by
``client_factory``; both are injected, so the fleet runs without Ray. Which weights an engine holds is the
``WeightSync``'s (``rollout.refit.weight_sync``), the fleet's sibling seen through :class:`FleetWeights` (both are
wired by ``rollout.assembly``): bring-up waits for an engine's first sync, a failed load comes back here as a
failed engine, and a departing engine's transport state is released.

Three guarantees are kept here, in one place each:

* **No stale weights served.** An engine joins the router only once it holds the newest published
  version (:meth:`bring_up`), and a publication that fails on an engine fails that engine.
* **Nothing lost on the way out.** Every path that takes an engine out of service (scale-in, eviction,
  rollback, failure) goes through :meth:`retire`: the engine leaves the router first, its in-flight requests
  finish or are aborted (the dispatcher retries them elsewhere), then its process and placement go away.
  With ``--sglang-router-url`` an external SGLang router mirrors the routable set (``rollout.routing.router_mirror``):
  an engine joins it when it joins Relax's router and leaves it at the same moment it leaves Relax's, and a
  drain waits (bounded) until that router no longer lists it.
* **A slow engine is not a dead one.** A request that could not reach an engine fails it only when its
  process is gone; a live process is failed only after repeated health-probe failures.

Engine transitions are recorded by the pool's ``on_transition`` hook (see ``rollout.pool.events``), not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from relax.engines.client import EngineClient, EngineError
from relax.engines.keys import EngineKeys, engine_keys
from relax.logs import failure_cause
from relax.rollout.fleet.bringup import BringUpLog, Phase, stop_reason
from relax.rollout.fleet.eviction import Eviction, plan_evictions, plan_notice
from relax.rollout.fleet.joins import JoinLog
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventKind, EventLog
from relax.rollout.pool.launcher import EngineLauncher, EngineSlot
from relax.rollout.refit.rules import Verification, WeightMismatch
from relax.rollout.routing.router import Router
from relax.rollout.routing.router_mirror import SGLangRouterMirror
from relax.rollout.settings import FleetSettings
from relax.weights.publication import WeightRegistry

log = logging.getLogger("relax.rollout")

HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 20.0
HEALTH_FAILURES_BEFORE_FAILED = 3  # consecutive /health failures of a live process = hung
RESTART_ATTEMPTS = 3  # a lost initial engine is restarted in its bundle this many times, backing off
RESTART_BACKOFF_S = 2.0
DRAIN_POLL_S = 1.0  # how often Ray's draining nodes are read (Ray Serve: 0.1 s; a notice gives >= 15 s)
SGLANG_ROUTER_WAIT_S = 5.0  # how long a drain waits for the external SGLang router to stop sending to the engine


class EngineHTTP(Protocol):
    """The part of :class:`~relax.engines.client.EngineClient` the fleet uses."""

    async def generate(self, **kwargs: Any) -> Any: ...

    async def health_generate(self, *, timeout: float | None = None) -> Any: ...

    async def is_healthy(self, *, generate: bool = False, timeout: float | None = None) -> bool: ...

    async def get_weight_version(self) -> str: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: str, *,
                                       timeout: float | None = None) -> Any: ...

    async def pause_generation(self, mode: str = "abort") -> Any: ...

    async def continue_generation(self) -> Any: ...

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> Any: ...

    async def aclose(self) -> None: ...

    # broadcast weight updates (rollout.broadcast)
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, **kwargs: Any) -> Any: ...

    async def begin_weight_update(self) -> Any: ...

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              **kwargs: Any) -> Any: ...

    async def end_weight_update(self) -> Any: ...

    async def destroy_weights_update_group(self, group_name: str = ..., **kwargs: Any) -> Any: ...


class FleetWeights(Protocol):
    """What the fleet needs of its sibling, the ``WeightSync`` (``rollout.refit.weight_sync``; wired by
    ``rollout.assembly``): an engine's first sync and checks, the wait for a publication, and releasing what a
    leaving engine held."""

    async def sync_to_latest(self, engine_id: str) -> None: ...

    def require_verified(self, engine_id: str) -> None: ...

    @property
    def last_syncs(self) -> Mapping[str, Mapping[str, Any]]: ...

    async def verify(self, engine_id: str) -> Verification: ...

    async def settle(self) -> None: ...

    async def forget(self, engine_id: str, client: Any | None) -> None: ...

    def is_syncing(self, engine_id: str) -> bool: ...

    def shutdown(self) -> None: ...


class EngineFleet:
    """Owns every engine's process, client and slot; the pool owns their states."""

    def __init__(
        self,
        pool: EnginePool,
        router: Router,
        events: EventLog,
        weights: WeightRegistry,
        launcher: EngineLauncher,
        settings: FleetSettings,
        weight_sync: FleetWeights,
        *,
        client_factory: Callable[[str, float, EngineKeys], EngineHTTP] | None = None,
        on_change: Callable[[], None] = lambda: None,
        drain_notices: Callable[[], Mapping[str, int] | None] | None = None,
    ) -> None:
        self.pool = pool
        self.router = router
        self.events = events
        self.weights = weights
        self.launcher = launcher
        self.settings = settings
        self._client_factory = client_factory or _http_client
        self._on_change = on_change
        self.routable = asyncio.Event()
        self._slots: dict[str, EngineSlot] = {}
        self._clients: dict[str, EngineHTTP] = {}
        # Weights, the sibling (rollout.assembly wires both): the fleet brings an engine up through its first sync
        # and releases what its transport keeps for it; a failed load comes back as a failed engine.
        self.weight_sync = weight_sync
        self._drain_events: dict[str, asyncio.Event] = {}
        self._cancelled: set[str] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_notices = drain_notices
        self.last_evictions: dict[str, dict[str, Any]] = {}  # per evicted engine: notice → gone, requests moved
        self.joins = JoinLog(time.time)  # per engine: decision → ACTIVE on the newest weights → first answer
        self.bring_ups = BringUpLog(time.time)  # per engine: where the seconds from decision to ACTIVE went
        self._deadlines: dict[str, tuple[float, float]] = {}  # per elastic engine: (monotonic deadline, timeout s)
        self._shutting_down = False
        # The external SGLang router that sees the routable set (rollout.router_mirror): it gains an engine when
        # Relax's router does and loses it when Relax's router does, so it never sends to an engine being given up.
        self.sglang_router = (SGLangRouterMirror(settings.sglang_router_url, api_key=settings.sglang_router_api_key)
                              if settings.sglang_router_url else None)

    # ------------------------------------------------------------------ views
    def client(self, engine_id: str) -> EngineHTTP:
        return self._clients[engine_id]

    def engine_version(self) -> int:
        """The weight version every ACTIVE engine holds at least (-1 with none): what the staleness gate sees."""
        version = self.pool.min_active_weight_version()
        return -1 if version is None else version

    async def engine_info(self, engine_id: str) -> Mapping[str, Any]:
        return await self.launcher.info(engine_id)

    # ------------------------------------------------------------------ bring-up
    async def start_initial(self, bundles: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        """One engine per (placement group, bundle index), concurrently; all must come up."""
        records = [self.pool.add(EngineKind.INITIAL, bundle=f"initial-{i}") for i in range(len(bundles))]
        results = await asyncio.gather(
            *(self.bring_up(r.engine_id, EngineSlot(pg, index)) for r, (pg, index) in zip(records, bundles,
                                                                                           strict=True)),
            return_exceptions=True,
        )
        failures = [(r.engine_id, res) for r, res in zip(records, results, strict=True)
                    if isinstance(res, BaseException)]
        if failures:
            raise RuntimeError(
                "initial engines failed to start: " + "; ".join(f"{eid}: {err}" for eid, err in failures)
            )
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())
        if self._drain_task is None and self._drain_notices is not None:
            self._drain_task = asyncio.create_task(self._drain_loop())
        return [self.pool.get(r.engine_id).to_dict() for r in records]

    async def bring_up(self, engine_id: str, slot: EngineSlot | None, url: str | None = None) -> None:
        """STARTING → HEALTH_CHECKING → WEIGHT_SYNCING → ACTIVE; raises (engine FAILED) on any error.

        With a slot the launcher starts the server inside it; with a url (external engine) the running
        server is only checked.
        """
        started_version = 0
        launched: Mapping[str, Any] = {}
        self.bring_ups.begin(engine_id, self.pool.get(engine_id).created_at)
        self.bring_ups.enter(engine_id, Phase.START)
        try:
            if url is None:
                assert slot is not None
                self._slots[engine_id] = slot
                self.pool.transition(engine_id, EngineState.STARTING)
                # Start from the newest version, not the base checkpoint. A broadcast version has no object-store
                # copy: the engine starts from the checkpoint and receives the newest before it is ACTIVE.
                latest = self.weights.latest()
                initial = ((latest.version, list(latest.bucket_refs))
                           if latest is not None and not latest.broadcast else None)
                # A broadcast version reaches a new engine only by its join's refit, which sends every tensor: the
                # checkpoint it would load first is read for nothing (GBs from network storage on a GPU node).
                dummy = self.settings.dummy_joins and latest is not None and latest.broadcast
                if dummy:
                    self.weight_sync.require_verified(engine_id)  # random weights must never serve
                    info = launched = await self.launcher.start(engine_id, slot, initial, dummy_weights=True)
                else:
                    info = launched = await self.launcher.start(engine_id, slot, initial)
                url = str(info["url"])
                started_version = None if dummy else int(info.get("weight_version") or 0)
                self.pool.set_node_id(engine_id, info.get("node_id"))
            self.pool.set_url(engine_id, url)
            if self.pool.get(engine_id).state is EngineState.PENDING:
                self.pool.transition(engine_id, EngineState.STARTING)
            self.pool.transition(engine_id, EngineState.HEALTH_CHECKING)
            self.bring_ups.enter(engine_id, Phase.FIRST_ANSWER)
            self.bring_ups.split(engine_id, Phase.START, _start_parts(launched))
            client = self._client_factory(url, self.settings.request_timeout_s, self.engine_keys(engine_id))
            self._clients[engine_id] = client
            await client.health_generate(timeout=self.settings.health_timeout_s)
            if self.pool.get(engine_id).kind is EngineKind.EXTERNAL:
                self.pool.set_weight_version(engine_id, _version_or_zero(await client.get_weight_version()))
            else:
                self.pool.set_weight_version(engine_id, started_version)
            self.pool.transition(engine_id, EngineState.WEIGHT_SYNCING)
            self.bring_ups.enter(engine_id, Phase.WEIGHT_SYNC)
            await self.weight_sync.sync_to_latest(engine_id)
            self._check_cancelled(engine_id)
            self.pool.transition(engine_id, EngineState.ACTIVE)
        except BaseException as exc:
            await self._cleanup_failed(engine_id, exc)
            raise
        self._deadlines.pop(engine_id, None)
        verify_s = (self.weight_sync.last_syncs.get(engine_id) or {}).get("verify_s")
        bring_up = self.bring_ups.end(engine_id, "ACTIVE", splits={
            Phase.WEIGHT_SYNC: {Phase.WEIGHT_SYNC: 0.0, Phase.VERIFY: verify_s}})
        if bring_up is not None:
            self.events.append(EventKind.ENGINE_STATE, f"{engine_id} brought up: {bring_up.summary()}",
                               engine_ids=engine_id, details=bring_up.to_dict(bring_up.ended_at or 0.0))
            log.info("%s brought up: %s", engine_id, bring_up.summary())
        self.router.add(engine_id)
        if self.sglang_router is not None:  # the router generates only: it gets the generation key, never the admin one
            self.sglang_router.add(engine_id, url, self.engine_keys(engine_id).generation)
        self.routable.set()
        self._on_change()
        record = self.pool.get(engine_id)
        self.joins.active(engine_id, kind=record.kind.value, weight_version=record.weight_version,
                          decided_at=record.created_at, active_at=record.state_since)
        log.info("%s ACTIVE at %s (weights v%s)", engine_id, url, record.weight_version)

    # ------------------------------------------------------------------ verified weights
    async def verify_engine(self, engine_id: str) -> Verification:
        """Check an ACTIVE engine's served weights now (``WeightSync.verify``); one that still serves other weights
        after a full reload is failed (and replaced, as any failed engine)."""
        record = self.pool.get(engine_id)
        if record.state is not EngineState.ACTIVE:
            raise ValueError(f"{engine_id} is {record.state.value}: only an ACTIVE engine's weights are checked on "
                             "demand (a joining engine is checked as it loads)")
        try:
            return await self.weight_sync.verify(engine_id)
        except WeightMismatch as exc:
            await self.on_engine_failure(engine_id, exc, confirmed=True)
            return exc.verifications[-1]
        except Exception as exc:  # paused, maybe part-reloaded: never left serving in an unknown state
            await self.on_engine_failure(engine_id, exc, confirmed=True)
            raise RuntimeError(f"{engine_id}: the check could not finish ({failure_cause(exc)}); the engine was "
                               "failed") from exc

    def engine_keys(self, engine_id: str) -> EngineKeys:
        """An engine's keys: its own pair for engines the run started, the operator's one key for attached ones."""
        if self.pool.get(engine_id).kind is EngineKind.EXTERNAL:
            return EngineKeys.single(self.settings.external_engine_api_key)
        return engine_keys(self.settings.engine_api_key, engine_id, generation=self.settings.engine_generation_key)

    def _leave_routing(self, engine_id: str) -> None:
        """Out of Relax's router and the external SGLang router's (in the background) at the same moment."""
        self.router.remove(engine_id)
        if self.sglang_router is not None:
            self.sglang_router.remove(engine_id)

    def note_answer(self, engine_id: str, version: int) -> None:
        """A request answered on ``engine_id`` with weights ``version``: the first one closes its join."""
        join = self.joins.answered(engine_id, version)
        if join is not None:
            self.events.append(EventKind.ENGINE_STATE, join.message(), engine_ids=engine_id, details=join.to_dict())
            log.info("%s %s", engine_id, join.message())

    async def bring_up_elastic(self, engine_id: str, *, timeout_s: float, cancelled: Callable[[], bool]) -> None:
        """A new placement (the provisioner's demand while pending), then bring-up; never raises.

        The outcome is the engine's state in the pool; the scale executor decides what it means.
        """
        deadline = time.monotonic() + timeout_s
        self._deadlines[engine_id] = (deadline, timeout_s)
        self.bring_ups.begin(engine_id, self.pool.get(engine_id).created_at)
        self.bring_ups.enter(engine_id, Phase.CAPACITY)
        placed: asyncio.Future[None] | None = None
        try:
            slot = self.launcher.reserve(engine_id, self.settings.gpus_per_engine)
            self._slots[engine_id] = slot
            placed = asyncio.ensure_future(self.launcher.wait_placed(slot))
            while not placed.done():  # wait for capacity, honouring cancel and the request's deadline
                if cancelled() or engine_id in self._cancelled:
                    raise asyncio.CancelledError("cancelled while its placement group was pending")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"placement group not ready after {timeout_s:.0f}s: the cluster has no free "
                                       f"{{GPU: {self.settings.gpus_per_engine}, CPU: 1}}; is the provisioner "
                                       "adding nodes?")
                await asyncio.wait([placed], timeout=min(remaining, 1.0))
            placed.result()
            log.info("%s: placement group ready", engine_id)
        except BaseException as exc:
            if placed is not None:
                placed.cancel()
            await self._cleanup_failed(engine_id, exc)
            return
        with contextlib.suppress(BaseException):  # the failure is recorded on the engine
            await asyncio.wait_for(self.bring_up(engine_id, slot), timeout=max(1.0, deadline - time.monotonic()))

    async def attach_external(self, engine_id: str, url: str, *, timeout_s: float) -> None:
        """Check a running server and join it; never raises (the outcome is the engine's state)."""
        self._deadlines[engine_id] = (time.monotonic() + max(1.0, timeout_s), max(1.0, timeout_s))
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self.bring_up(engine_id, None, url=url), timeout=max(1.0, timeout_s))

    def cancel(self, engine_ids: Iterable[str]) -> None:
        """Sticky cancel: these engines never become ACTIVE (a bring-up in progress stops at its next phase)."""
        self._cancelled.update(engine_ids)
        self._on_change()

    def _check_cancelled(self, engine_id: str) -> None:
        if engine_id in self._cancelled:
            raise asyncio.CancelledError(f"{engine_id}: its scale-out request was cancelled")

    async def _cleanup_failed(self, engine_id: str, exc: BaseException) -> None:
        record = self.pool.get(engine_id)
        cancelled = engine_id in self._cancelled
        deadline = self._deadlines.pop(engine_id, None)
        reason, failed = stop_reason(exc, record.state.value, shutting_down=self._shutting_down,
                                     deadline_s=deadline[1] if deadline else None,
                                     past_deadline=deadline is not None and time.monotonic() >= deadline[0] - 0.05)
        removed = cancelled or not failed
        if not record.state.terminal:
            target = (EngineState.REMOVED if removed and record.state.can_transition_to(EngineState.REMOVED)
                      else EngineState.FAILED)
            self.pool.transition(engine_id, target, error=None if removed else reason)
        self.bring_ups.end(engine_id, reason if failed else f"REMOVED: {reason}")
        if not removed:
            log.warning("%s failed to come up: %s", engine_id, reason)
        else:
            log.info("%s not brought up: %s", engine_id, reason)
        await self._release(engine_id, grace_s=5.0)

    # ------------------------------------------------------------------ weights
    async def settle_weights(self) -> None:
        """Wait for a publication in progress (the scale executor's port: no scale-in in mid-load)."""
        await self.weight_sync.settle()

    # ------------------------------------------------------------------ taking engines out
    async def retire(
        self,
        engine_id: str,
        *,
        force: bool,
        drain_timeout_s: float,
        reason: str,
        on_drained: Callable[[int], None] | None = None,
    ) -> int:
        """Drain (wait for in-flight requests), then remove. Returns how many requests were aborted and
        retried elsewhere. Safe to call on an engine in any state."""
        record = self.pool.get(engine_id)
        if record.state.terminal:
            return 0
        if record.state is EngineState.ACTIVE:
            self._leave_routing(engine_id)
            self.pool.transition(engine_id, EngineState.DRAINING)
            self._on_change()
            log.info("%s DRAINING (%s), %d request(s) in flight", engine_id, reason, self.router.in_flight(engine_id))
        aborted = 0
        if not force:
            if self.sglang_router is not None:  # the router stops sending first; the wait is part of the budget
                began = time.monotonic()
                await self.sglang_router.synced(min(SGLANG_ROUTER_WAIT_S, drain_timeout_s))
                drain_timeout_s = max(0.0, drain_timeout_s - (time.monotonic() - began))
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
            await self._wait_drained(engine_id, max(5.0, self.settings.request_timeout_s))
        if on_drained is not None:  # drained (or aborted): the shutdown phase starts now
            on_drained(aborted)
        await self._release(engine_id, grace_s=self.settings.shutdown_timeout_s)
        if not self.pool.get(engine_id).state.terminal:
            self.pool.transition(engine_id, EngineState.REMOVED)
        self._on_change()
        log.info("%s REMOVED (%s; %d request(s) retried elsewhere)", engine_id, reason, aborted)
        return aborted

    async def _wait_drained(self, engine_id: str, timeout_s: float) -> bool:
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

    def note_release(self, engine_id: str) -> None:
        """Called after every router release: keeps the record's count and wakes a drain waiting on it."""
        self.pool.set_in_flight(engine_id, self.router.in_flight(engine_id))
        event = self._drain_events.get(engine_id)
        if event is not None and self.router.drained(engine_id):
            event.set()

    async def _release(self, engine_id: str, *, grace_s: float) -> None:
        """Leave the weight group, stop the server, close the client, give back an owned placement group."""
        await self.weight_sync.forget(engine_id, self._clients.get(engine_id))
        await self.launcher.stop(engine_id, grace_s)
        client = self._clients.pop(engine_id, None)
        if client is not None:
            await client.aclose()
        slot = self._slots.get(engine_id)
        if slot is not None:
            self.launcher.release(slot)

    # ------------------------------------------------------------------ failure and eviction
    async def on_engine_failure(self, engine_id: str, exc: BaseException, *, confirmed: bool = False) -> None:
        """Out of routing at once (its requests retry elsewhere); initial engines restart in their bundle.

        A request that could not reach an engine is not proof that the engine died: under a burst a healthy
        server can be slow to answer. Unless ``confirmed``, the engine is failed only when its process is
        gone (or, for external engines, which Relax cannot look into, at once).
        """
        if self.pool.get(engine_id).state is not EngineState.ACTIVE:  # a draining engine is already leaving
            return
        if not confirmed and await self.launcher.is_alive(engine_id, HEALTH_TIMEOUT_S):
            log.info("%s did not answer a request (%s) but its server runs: kept, the request is retried "
                     "elsewhere", engine_id, failure_cause(exc))
            return
        # the cause, not Ray's coloured task name, for the record, its event and the log: a server that exited
        # is named by how it exited (the signal), not by the connection error its requests met
        cause = await self._exit_of(engine_id) or failure_cause(exc)
        if self.pool.get(engine_id).state is not EngineState.ACTIVE:  # changed while we looked
            return
        self._leave_routing(engine_id)
        self.pool.transition(engine_id, EngineState.FAILED, error=cause)
        self._on_change()
        log.warning("%s failed (%s); out of routing, its requests are retried elsewhere", engine_id, cause)
        if not self.router.routable():
            self.routable.clear()
        self._spawn(self._after_failure(engine_id))

    async def _exit_of(self, engine_id: str) -> str | None:
        """``server process was killed by SIGKILL (signal 9) …`` when the engine's server has exited, else None."""
        try:
            info = await asyncio.wait_for(self.launcher.info(engine_id), timeout=HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the actor may be gone with its server: the request's error says enough
            return None
        exit_text = info.get("exit") if isinstance(info, Mapping) else None
        return f"server process {exit_text}" if exit_text else None

    async def _after_failure(self, engine_id: str) -> None:
        slot = self._slots.get(engine_id)
        await self._release(engine_id, grace_s=2.0)
        await self._replace_initial(engine_id, slot, "failed")

    async def _replace_initial(self, engine_id: str, slot: EngineSlot | None, why: str) -> None:
        """An initial engine that left is replaced in its own bundle (the pool never shrinks below them)."""
        record = self.pool.get(engine_id)
        if record.kind is not EngineKind.INITIAL or slot is None or self._shutting_down:
            return
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            replacement = self.pool.add(EngineKind.INITIAL, bundle=record.bundle)
            self.events.append(EventKind.ENGINE_RESTARTED,
                               f"{replacement.engine_id} replaces {why} {engine_id} (attempt {attempt}/"
                               f"{RESTART_ATTEMPTS})", engine_ids=(engine_id, replacement.engine_id))
            log.warning("%s replaces %s initial engine %s in its own bundle (attempt %d/%d)", replacement.engine_id,
                        why, engine_id, attempt, RESTART_ATTEMPTS)
            try:
                await self.bring_up(replacement.engine_id, EngineSlot(slot.placement_group, slot.bundle_index))
                return
            except Exception as exc:
                log.error("restarting initial engine %s failed (attempt %d/%d): %s", engine_id, attempt,
                          RESTART_ATTEMPTS, failure_cause(exc))
            if self._shutting_down:
                return
            await asyncio.sleep(RESTART_BACKOFF_S * 2 ** (attempt - 1))
        self.events.append(EventKind.ENGINE_STATE, f"{engine_id} not replaced after {RESTART_ATTEMPTS} attempts; "
                           "the pool runs one initial engine short", engine_ids=engine_id)

    async def notify_eviction(self, engine_id: str) -> None:
        """SIGTERM reached an EngineActor (node reclaimed): an eviction like a drain notice's (:meth:`evict`),
        with the drain timeout as its budget."""
        if engine_id in self.pool:
            await self.evict(plan_notice(engine_id, self.pool.get(engine_id).node_id, self.settings.drain_timeout_s))

    async def evict(self, eviction: Eviction) -> None:
        """The platform takes the engine's node back (``rollout.fleet.eviction``: a drain notice or a SIGTERM): out of
        routing now, in-flight work finished or migrated within the budget, then the server stopped and the group
        removed, all before the node's deadline; an initial engine is then replaced in its own bundle."""
        engine_id = eviction.engine_id
        if engine_id not in self.pool:
            return
        state = self.pool.get(engine_id).state
        if state.terminal or state is EngineState.DRAINING:  # already leaving (scale-in): that path finishes it
            return
        noticed = time.monotonic()
        said = eviction.describe(int(time.time() * 1000))
        self.events.append(EventKind.ENGINE_EVICTED, said, engine_ids=engine_id)
        log.warning("%s evicted: %s", engine_id, said)
        slot = self._slots.get(engine_id)
        aborted = await self.retire(engine_id, force=eviction.budget_s <= 0, drain_timeout_s=eviction.budget_s,
                                    reason="evicted")
        gone_s = time.monotonic() - noticed
        record = {"node_id": eviction.node_id, "notice": eviction.notice.value, "budget_s": eviction.budget_s,
                  "notice_to_gone_s": gone_s,
                  "moved_requests": aborted,
                  "gone_before_deadline": not eviction.deadline_ms or time.time() * 1000 < eviction.deadline_ms}
        self.events.append(EventKind.ENGINE_STATE, f"evicted engine removed {gone_s:.1f}s after the notice "
                           f"({aborted} request(s) moved to other engines)", engine_ids=engine_id, details=record)
        self.last_evictions[engine_id] = record
        await self._replace_initial(engine_id, slot, "evicted")

    async def _drain_loop(self) -> None:
        """Read Ray's draining nodes about once a second and evict the engines they host."""
        evicting: set[str] = set()
        while not self._shutting_down:
            await asyncio.sleep(DRAIN_POLL_S)
            try:
                draining = await asyncio.to_thread(self._drain_notices)
            except Exception as exc:  # noqa: BLE001 - a broken read must never stop the loop
                log.debug("drain notices: %s", exc)
                continue
            if not draining:
                continue
            by_node: dict[str, list[str]] = {}
            for record in self.pool.active():
                if record.node_id:
                    by_node.setdefault(record.node_id, []).append(record.engine_id)
            for eviction in plan_evictions(draining, by_node, int(time.time() * 1000), evicting,
                                           self.settings.eviction):
                evicting.add(eviction.engine_id)
                self._spawn(self.evict(eviction))

    async def _health_loop(self) -> None:
        """Probe ACTIVE engines; a dead or repeatedly unhealthy one is failed and its requests retried."""
        failures: dict[str, int] = {}

        async def probe(engine_id: str) -> None:
            client = self._clients.get(engine_id)
            if client is None or self.weight_sync.is_syncing(engine_id):  # paused to load weights: not a failure
                failures.pop(engine_id, None)
                return
            if await self.launcher.is_alive(engine_id, HEALTH_TIMEOUT_S) is False:
                await self.on_engine_failure(engine_id, RuntimeError("server process exited"), confirmed=True)
                return
            healthy = await client.is_healthy(generate=False, timeout=HEALTH_TIMEOUT_S)
            failures[engine_id] = 0 if healthy else failures.get(engine_id, 0) + 1
            if failures[engine_id] >= HEALTH_FAILURES_BEFORE_FAILED:  # alive but hung
                await self.on_engine_failure(
                    engine_id, RuntimeError(f"/health failed {failures[engine_id]} times in a row"), confirmed=True)

        while not self._shutting_down:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await asyncio.gather(*(probe(r.engine_id) for r in self.pool.active()), return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def begin_shutdown(self) -> None:
        """The run is ending: from now on a bring-up that stops was stopped by it (REMOVED, not FAILED)."""
        self._shutting_down = True

    async def shutdown(self) -> None:
        """Stop every engine (process, client, owned placement group) and every background task."""
        self._shutting_down = True
        self.weight_sync.shutdown()
        if self.sglang_router is not None:  # the engines stop next: take them off the router first (bounded)
            await self.sglang_router.aclose(deregister=True, timeout_s=SGLANG_ROUTER_WAIT_S)
        stopping = [task for task in [self._health_task, self._drain_task, *self._background] if task is not None]
        for task in stopping:
            task.cancel()
        if stopping:  # a bring-up stopped here records why (the run's shutdown) and releases what it started
            await asyncio.wait(stopping, timeout=self.settings.shutdown_timeout_s + 5.0)
        # each engine's own shutdown, together: SGLang's takes up to ~5 s (its SIGTERM watchdog looks every 5 s)
        await asyncio.gather(*(self._release(eid, grace_s=self.settings.shutdown_timeout_s)
                               for eid in self.launcher.engine_ids()), return_exceptions=True)
        for engine_id in list(self._slots):  # owned groups of engines whose process never started
            self.launcher.release(self._slots[engine_id])
        for client in list(self._clients.values()):
            await client.aclose()
        self._clients.clear()


def _http_client(url: str, timeout: float, keys: EngineKeys = EngineKeys()) -> EngineClient:
    return EngineClient(url, timeout=timeout, token=keys.generation, admin_token=keys.admin)


def _start_parts(info: Mapping[str, Any]) -> dict[Phase, float | None]:
    """The launcher's ``start`` span split by the actor's own figures: server start = spawn → healthy, prepare =
    the rest of the actor's ``start()``, actor = what is left (Ray starting the actor's process)."""
    startup, healthy = info.get("startup_s"), info.get("healthy_after_s")
    if not isinstance(startup, int | float) or not isinstance(healthy, int | float):
        return {Phase.START: None}
    return {Phase.ACTOR: 0.0, Phase.PREPARE: max(0.0, startup - healthy), Phase.SERVER_START: healthy}


def _version_or_zero(value: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


__all__ = ["EngineFleet", "EngineHTTP", "FleetWeights"]
