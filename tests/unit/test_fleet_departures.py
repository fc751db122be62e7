"""How engines leave the fleet, over its ports (fake launcher and clients, no Ray): a retire drains then aborts,
a SIGTERM and a drain notice are one eviction, a dead engine is failed and its bundle refilled, a slow one is
kept, and a restart that keeps failing gives up and says so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from relax.rollout.assembly import build_fleet
from relax.rollout.fleet import lifecycle as fleet_module
from relax.rollout.fleet.eviction import plan_evictions
from relax.rollout.fleet.lifecycle import EngineFleet
from relax.rollout.pool.engines import EnginePool, EngineState
from relax.rollout.pool.events import EventKind, EventLog
from relax.rollout.pool.launcher import EngineSlot
from relax.rollout.refit.transport import TransportKind
from relax.rollout.routing.router import Router
from relax.rollout.settings import FleetSettings
from relax.weights.publication import WeightRegistry
from tests.unit.fake_engines import Client, Launcher, Transport

PG = "initial-group"  # stands for the placement group of the initial engines


class Fleet:
    def __init__(self) -> None:
        self.launcher, self.clients, self.events = Launcher(), {}, EventLog(time.time)
        self.changed = asyncio.Event()  # set on every engine transition and every change the fleet signals

        def client_factory(url: str, timeout_s: float, keys: Any) -> Client:
            engine_id = url.removeprefix("http://")
            self.clients[engine_id] = Client(engine_id, self.launcher)
            return self.clients[engine_id]

        self.pool = EnginePool(time.time, on_transition=lambda *_: self.changed.set())
        self.router = Router()
        self.fleet: EngineFleet = build_fleet(
            self.pool, self.router, self.events, WeightRegistry(), self.launcher,
            FleetSettings(drain_timeout_s=7.0, shutdown_timeout_s=1.0), client_factory=client_factory,
            transports={kind: Transport() for kind in TransportKind}, on_change=self.changed.set)

    async def __aenter__(self) -> Fleet:
        await self.fleet.start_initial([(PG, 0), (PG, 1)])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.fleet.shutdown()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait for the fleet's state to satisfy ``condition`` (it signals every change)."""
        while not condition():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 2)

    def state(self, engine_id: str) -> EngineState:
        return self.pool.get(engine_id).state

    def messages(self, kind: EventKind) -> list[str]:
        return [e.message for e in self.events.newest(100, kind)]


@pytest.mark.timeout(10)
async def test_a_retire_drains_then_aborts_what_is_left_and_gives_the_engine_back() -> None:
    async with Fleet() as f:
        assert f.router.acquire("g", exclude=["engine_1"]) == "engine_0"  # one request in flight there

        def released() -> None:  # what the dispatcher does when its request is aborted
            f.router.release("engine_0")
            f.fleet.note_release("engine_0")

        f.clients["engine_0"].on_abort = released
        aborted = await f.fleet.retire("engine_0", force=False, drain_timeout_s=0.05, reason="scale-in")
        assert aborted == 1 and f.clients["engine_0"].aborted_all == 1
        assert f.state("engine_0") is EngineState.REMOVED and f.router.routable() == ["engine_1"]
        assert "engine_0" in f.launcher.stopped
        assert f.messages(EventKind.REQUESTS_RETRIED) == ["1 in-flight request(s) aborted and retried on other "
                                                          "engines (scale-in)"]
        assert len(f.launcher.started) == 2  # a scale-in is not replaced


@pytest.mark.timeout(10)
async def test_a_sigterm_and_a_drain_notice_are_one_eviction_and_refill_the_initial_bundle() -> None:
    async with Fleet() as f:
        await f.fleet.notify_eviction("engine_0")
        drained = plan_evictions({"node-1": 0}, {"node-1": ["engine_1"]}, int(time.time() * 1000))
        await f.fleet.evict(drained[0])
        assert f.state("engine_0") is f.state("engine_1") is EngineState.REMOVED
        assert {eid: (r["notice"], r["budget_s"]) for eid, r in f.fleet.last_evictions.items()} == {
            "engine_0": ("SIGTERM", 7.0), "engine_1": ("node draining", 30.0)}
        assert f.messages(EventKind.ENGINE_EVICTED) == [
            "node node-1 draining (no deadline given): 30s to finish or migrate in-flight requests",
            "SIGTERM received: 7s to finish or migrate in-flight requests"]
        # each initial engine is replaced in its own bundle
        assert [(eid, slot) for eid, slot in f.launcher.started[2:]] == [("engine_2", EngineSlot(PG, 0)),
                                                                         ("engine_3", EngineSlot(PG, 1))]
        assert [r.engine_id for r in f.pool.active()] == ["engine_2", "engine_3"]
        await f.fleet.notify_eviction("engine_0")  # a late notice for an engine already gone: nothing
        assert len(f.launcher.started) == 4


@pytest.mark.timeout(10)
async def test_a_slow_engine_is_kept_and_a_dead_one_is_failed_and_replaced() -> None:
    async with Fleet() as f:
        await f.fleet.on_engine_failure("engine_0", TimeoutError("no answer in 300 s"))
        assert f.state("engine_0") is EngineState.ACTIVE  # its process runs: a slow engine, not a dead one
        f.launcher.dead.add("engine_0")
        await f.fleet.on_engine_failure("engine_0", ConnectionResetError("connection reset"))
        assert f.state("engine_0") is EngineState.FAILED
        assert f.pool.get("engine_0").last_error == "ConnectionResetError: connection reset"
        assert f.router.routable() == ["engine_1"]
        await f.until(lambda: "engine_2" in f.pool and f.state("engine_2") is EngineState.ACTIVE)
        assert f.launcher.started[-1] == ("engine_2", EngineSlot(PG, 0)) and "engine_0" in f.launcher.stopped
        # a server killed by a signal is named by the signal, not by the connection error its requests met
        f.launcher.dead.add("engine_1")
        f.launcher.exits["engine_1"] = "was killed by SIGKILL (signal 9) — out of memory?"
        await f.fleet.on_engine_failure("engine_1", ConnectionResetError("connection reset"))
        assert f.pool.get("engine_1").last_error == "server process was killed by SIGKILL (signal 9) — out of memory?"


@pytest.mark.timeout(10)
async def test_a_restart_that_keeps_failing_gives_up_after_its_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "RESTART_BACKOFF_S", 0.0)
    async with Fleet() as f:
        f.launcher.failing = True
        await f.fleet.on_engine_failure("engine_0", RuntimeError("server process exited"), confirmed=True)
        await f.until(lambda: sum(r.state is EngineState.FAILED for r in f.pool.records()) == 4)
        await asyncio.gather(*f.fleet._background)  # the restart pass ends with its last word
        assert f.messages(EventKind.ENGINE_RESTARTED)[0] == "engine_4 replaces failed engine_0 (attempt 3/3)"
        assert f.messages(EventKind.ENGINE_STATE)[0] == ("engine_0 not replaced after 3 attempts; the pool runs "
                                                         "one initial engine short")
        assert [r.engine_id for r in f.pool.active()] == ["engine_1"]
