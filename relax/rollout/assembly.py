"""The rollout, assembled once: the parts of the rollout and how they are wired, with no Ray in sight.

:func:`build_rollout` is the composition root. It takes the settings (``rollout.settings``), a launcher (where
engines run: Ray's in a run, a fake in a unit test), a tokenizer and, optionally, the HTTP client factory and
weight transports, and wires:

* the engine states (``rollout.pool.engines``) whose transitions are recorded as events and told to the dispatcher;
* the ``WeightSync`` and the ``EngineFleet`` as siblings: the fleet brings engines up through their first sync
  and fails the ones whose load fails, the sync reaches engines through the fleet's clients;
* the dispatcher (``rollout.dispatch.dispatcher``), which holds a request while its engine loads weights;
* the scale executor and the control API (``rollout.fleet.executor``, ``rollout.control.backend``);
* the generation loop (``rollout.dispatch.generation_loop``) that fills the buffer through the dispatcher.

``rollout.manager.RolloutManager`` is only the Ray face over what this returns.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relax.rollout.control.backend import RolloutControl
from relax.rollout.control.run_status import RunStatus
from relax.rollout.dispatch.dispatcher import Dispatcher
from relax.rollout.dispatch.generation_loop import GenerationLoop
from relax.rollout.fleet.executor import ScaleExecutor
from relax.rollout.fleet.lifecycle import EngineFleet, EngineHTTP
from relax.rollout.pool.engines import EnginePool, EngineRecord, EngineState
from relax.rollout.pool.events import EventKind, EventLog, transition_recorder
from relax.rollout.pool.launcher import EngineLauncher
from relax.rollout.refit.broadcast import BroadcastTransport
from relax.rollout.refit.disk_transports import ExternalDiskTransport, ObjectStoreTransport
from relax.rollout.refit.rules import Verification, VerifyResult
from relax.rollout.refit.transport import TransportKind, WeightTransport
from relax.rollout.refit.weight_sync import WeightSync
from relax.rollout.routing.router import RetryPolicy, Router
from relax.rollout.settings import FleetSettings, RolloutSettings
from relax.weights.publication import WeightRegistry

ClientFactory = Callable[[str, float, Any], EngineHTTP]


@dataclass
class Rollout:
    """The rollout's parts, wired; the Ray face and the unit tests hold one of these."""

    settings: RolloutSettings
    events: EventLog
    weights: WeightRegistry
    pool: EnginePool
    router: Router
    weight_sync: WeightSync
    fleet: EngineFleet
    dispatcher: Dispatcher
    executor: ScaleExecutor
    loop: GenerationLoop
    control: RolloutControl

    def run_status(self, training: Mapping[str, Any]) -> RunStatus:
        """One snapshot of the run (``rollout.control.run_status``); ``training``: the driver's last step report."""
        sync, fleet = self.weight_sync, self.fleet
        join = fleet.joins.latest_answered()
        if join is not None and join.decision_to_first_answer_s is None:
            join = None
        gone = [e["notice_to_gone_s"] for e in fleet.last_evictions.values() if e.get("notice_to_gone_s") is not None]
        return RunStatus(
            training_step=int(training.get("step", 0)), num_rollout=self.settings.data.num_rollout,
            rollout_tokens_per_s=float(training.get("rollout_tokens_per_s", 0.0)),
            staleness_mean=float(training.get("staleness_mean", 0.0)),
            trainer_wait_fraction=float(training.get("trainer_wait_fraction", 0.0)),
            staleness_blocked_fraction=self.loop.gate.blocked_fraction(),
            buffer_waiting_partitions=self.loop.buffer.num_waiting_partitions(),
            engine_weight_version=fleet.engine_version(), active_engines=len(self.pool.active()),
            latest_published=self.weights.latest_version or 0, tokens_generated=self.dispatcher.tokens_generated,
            migration=self.dispatcher.migration.to_dict(), dropped_prompts=self.loop.dropped.count,
            refused_groups=self.loop.refused_groups, verify_weights=sync.verify_policy.value,
            weight_verifications=dict(sync.verifications),
            weight_syncs={eid: dict(t) for eid, t in sync.last_syncs.items()},
            last_verifications={eid: dict(v) for eid, v in sync.last_verifications.items()},
            evictions={eid: dict(e) for eid, e in fleet.last_evictions.items()}, joins=fleet.joins.to_dict(),
            bring_up_phases=fleet.bring_ups.histogram.to_dict(),
            sglang_router=fleet.sglang_router.status() if fleet.sglang_router else None,
            last_join_active_s=join.decision_to_active_s if join else None,
            last_join_first_answer_s=join.decision_to_first_answer_s if join else None,
            last_eviction_notice_to_gone_s=gone[-1] if gone else None,
        )

    async def aclose(self) -> None:
        """Stop generation, every scale request, every engine and background task."""
        self.fleet.begin_shutdown()  # first: a bring-up the executor's cancel stops is the shutdown's, not a failure
        await self.loop.aclose()
        await self.executor.aclose()
        await self.fleet.shutdown()


def standard_transports(launcher: EngineLauncher, settings: FleetSettings) -> dict[TransportKind, WeightTransport]:
    """One transport per path (``rollout.refit.transport``), all pausing the engine the same way."""
    pause = settings.weight_sync_pause_mode
    return {TransportKind.BROADCAST: BroadcastTransport(settings.broadcast, pause),
            TransportKind.OBJECT_STORE: ObjectStoreTransport(launcher, pause),
            TransportKind.DISK: ExternalDiskTransport(settings.model_path, pause)}


def max_context(model_path: str) -> int | None:
    """The engines' context length (one model everywhere): what a prompt with its response budget, and a
    migrated prefix, must fit."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
        return int(value) if value else None
    except (OSError, ValueError, TypeError):
        return None


def build_fleet(
    pool: EnginePool,
    router: Router,
    events: EventLog,
    weights: WeightRegistry,
    launcher: EngineLauncher,
    settings: FleetSettings,
    *,
    client_factory: ClientFactory | None = None,
    transports: Mapping[TransportKind, WeightTransport] | None = None,
    on_change: Callable[[], None] = lambda: None,
    drain_notices: Callable[[], Mapping[str, int] | None] | None = None,
) -> EngineFleet:
    """The engine fleet and its sibling ``WeightSync`` (``fleet.weight_sync``), wired to each other: the sync
    reaches engines through the fleet's clients and fails the engines whose load fails; the fleet brings engines
    up through their first sync. Weight mismatches are recorded as events."""
    fleet: EngineFleet | None = None

    def client(engine_id: str) -> Any:
        assert fleet is not None
        return fleet.client(engine_id)

    async def failed_load(engine_id: str, exc: BaseException) -> None:
        assert fleet is not None
        await fleet.on_engine_failure(engine_id, exc, confirmed=True)

    def on_verification(outcome: Verification) -> None:
        """Every mismatch is an event (the metric counts every check, by result)."""
        if outcome.result is VerifyResult.MISMATCH:
            events.append(EventKind.WEIGHTS_MISMATCH, outcome.describe(), engine_ids=outcome.engine_id,
                          details=outcome.to_dict())

    weight_sync = WeightSync(pool, weights, transports or standard_transports(launcher, settings), client,
                             on_failure=failed_load, on_change=on_change, verify=settings.verify_weights,
                             on_verification=on_verification)
    fleet = EngineFleet(pool, router, events, weights, launcher, settings, weight_sync,
                        client_factory=client_factory, on_change=on_change, drain_notices=drain_notices)
    return fleet  # the closures above reach it from now on


def build_rollout(
    settings: RolloutSettings,
    launcher: EngineLauncher,
    tokenizer: Any,
    *,
    client_factory: ClientFactory | None = None,
    transports: Mapping[TransportKind, WeightTransport] | None = None,
    drain_notices: Callable[[], Mapping[str, int] | None] | None = None,
    run_status: Callable[[], Mapping[str, Any]] = dict,
    clock: Callable[[], float] = time.time,
) -> Rollout:
    """Wire the rollout's parts from ``settings`` (see the module's docstring for what talks to what)."""
    events = EventLog(clock)
    weights = WeightRegistry()
    changed = asyncio.Event()  # engines, weights or the buffer changed: the staleness gate may open
    record = transition_recorder(events, lambda: weights.latest_version)
    dispatcher: Dispatcher | None = None

    def on_transition(rec: EngineRecord, src: EngineState, dst: EngineState) -> None:
        record(rec, src, dst)
        if dispatcher is not None:
            dispatcher.on_transition(rec, src, dst)

    pool = EnginePool(clock, on_transition=on_transition)
    router = Router()
    fleet_settings = settings.fleet
    fleet = build_fleet(pool, router, events, weights, launcher, fleet_settings, client_factory=client_factory,
                        transports=transports, on_change=changed.set, drain_notices=drain_notices)
    weight_sync = fleet.weight_sync
    assert isinstance(weight_sync, WeightSync)  # build_fleet's: the concrete sibling, with publish and counters
    eos = getattr(tokenizer, "eos_token_id", None)
    dispatch = replace(settings.dispatch, eos_ids=frozenset() if eos is None else frozenset({int(eos)}),
                       max_context=max_context(fleet_settings.model_path))
    dispatcher = Dispatcher(router, pool, fleet, RetryPolicy(max_attempts=dispatch.max_attempts), dispatch,
                            sync=weight_sync)
    executor = ScaleExecutor(pool, fleet, events, settings.scaling, drain_timeout_s=fleet_settings.drain_timeout_s,
                             on_change=changed.set)
    loop = GenerationLoop(settings.data, tokenizer, dispatcher, end_group=router.end_group,
                          engine_version=fleet.engine_version, state_changed=changed, context_len=dispatch.max_context)

    async def verify(engine_id: str) -> Mapping[str, Any]:
        return (await fleet.verify_engine(engine_id)).to_dict()

    verify_fn: Callable[[str], Awaitable[Mapping[str, Any]]] = verify
    control = RolloutControl(pool, executor, events, in_flight=router.in_flight, run_status=run_status,
                             joins=fleet.joins, bring_ups=fleet.bring_ups, verify=verify_fn)
    return Rollout(settings=settings, events=events, weights=weights, pool=pool, router=router,
                   weight_sync=weight_sync, fleet=fleet, dispatcher=dispatcher, executor=executor, loop=loop,
                   control=control)
