"""An engine's bring-up phase by phase (``rollout.fleet.bringup``), and the words a stopped bring-up is reported with.

The log's rules on an injected clock, in milliseconds; then the fleet over fake engines (no Ray): the phases it
records for a real start, and the three causes the soak found reported as a timeout — the run's shutdown, the
scale-out's deadline, a cancellation — each named for what it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from relax.rollout.assembly import build_fleet
from relax.rollout.control.metrics import render_metrics
from relax.rollout.fleet.bringup import BUCKETS_S, BringUpLog, Phase, stop_reason
from relax.rollout.fleet.lifecycle import EngineFleet
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventKind, EventLog
from relax.rollout.pool.launcher import EngineSlot
from relax.rollout.refit.transport import TransportKind
from relax.rollout.routing.router import Router
from relax.rollout.settings import FleetSettings
from relax.weights.publication import WeightRegistry
from tests.unit.fake_engines import Client, Launcher, Transport


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_phases_add_up_to_the_decision_to_active_time() -> None:
    clock = Clock()
    log = BringUpLog(clock)
    log.begin("engine_5", decided_at=clock.now)
    for phase, seconds in ((Phase.CAPACITY, 30.0), (Phase.START, 25.0), (Phase.FIRST_ANSWER, 0.5),
                           (Phase.WEIGHT_SYNC, 1.5)):
        log.enter("engine_5", phase)
        clock.advance(seconds)
    view = log.view("engine_5")
    assert view is not None and view["current"] == "weight_sync" and view["current_for_s"] == 1.5
    record = log.end("engine_5", "ACTIVE", splits={Phase.WEIGHT_SYNC: {Phase.WEIGHT_SYNC: 0.0, Phase.VERIFY: 0.4}})
    assert record is not None
    assert record.phases == {Phase.CAPACITY: 30.0, Phase.START: 25.0, Phase.FIRST_ANSWER: 0.5,
                             Phase.WEIGHT_SYNC: pytest.approx(1.1), Phase.VERIFY: 0.4}
    assert sum(record.phases.values()) == pytest.approx(record.total_s(clock.now)) == pytest.approx(57.0)
    assert record.summary().endswith("= 57.00s") and record.outcome == "ACTIVE"
    assert log.end("engine_5", "ACTIVE") is None  # once


def test_the_launchers_span_is_split_by_the_actors_own_figures() -> None:
    clock = Clock()
    log = BringUpLog(clock)
    log.begin("engine_0", clock.now)
    log.enter("engine_0", Phase.START)
    clock.advance(40.0)
    log.enter("engine_0", Phase.FIRST_ANSWER)
    log.split("engine_0", Phase.START, {Phase.ACTOR: 0.0, Phase.PREPARE: 3.0, Phase.SERVER_START: 30.0})
    assert log.get("engine_0").phases == {Phase.ACTOR: 7.0, Phase.PREPARE: 3.0, Phase.SERVER_START: 30.0}
    # figures that add up to more than the span (another clock) are scaled into it, never negative
    log.begin("engine_1", clock.now)
    log.enter("engine_1", Phase.START)
    clock.advance(10.0)
    log.enter("engine_1", Phase.FIRST_ANSWER)
    log.split("engine_1", Phase.START, {Phase.ACTOR: 0.0, Phase.PREPARE: 5.0, Phase.SERVER_START: 15.0})
    phases = log.get("engine_1").phases
    assert phases[Phase.ACTOR] == pytest.approx(0.0) and sum(phases.values()) == pytest.approx(10.0)
    # unknown figures (a launcher that gives none) leave the span whole
    log.split("engine_1", Phase.FIRST_ANSWER, {Phase.FIRST_ANSWER: None})
    assert Phase.FIRST_ANSWER not in log.get("engine_1").phases  # not finished yet: nothing to split


def test_the_histogram_counts_every_finished_phase_cumulatively() -> None:
    clock = Clock()
    log = BringUpLog(clock)
    for engine_id, seconds in (("engine_0", 0.2), ("engine_1", 7.0), ("engine_2", 900.0)):
        log.begin(engine_id, clock.now)
        log.enter(engine_id, Phase.SERVER_START)
        clock.advance(seconds)
        log.end(engine_id, "ACTIVE")
    server = log.histogram.to_dict()["server_start"]
    assert server["count"] == 3 and server["sum"] == pytest.approx(907.2)
    cumulative = dict((str(le), n) for le, n in server["buckets"])
    assert cumulative["0.25"] == 1 and cumulative["10.0"] == 2 and cumulative["600.0"] == 2
    assert cumulative["+Inf"] == 3 and len(server["buckets"]) == len(BUCKETS_S) + 1
    text = render_metrics({"bring_up_phases": log.histogram.to_dict()}).decode()
    assert 'relax_engine_bring_up_phase_seconds_bucket{le="10.0",phase="server_start"} 2.0' in text
    assert 'relax_engine_bring_up_phase_seconds_count{phase="server_start"} 3.0' in text


def test_the_log_keeps_the_newest_engines_only() -> None:
    clock = Clock()
    log = BringUpLog(clock, keep=2)
    for n in range(3):
        log.begin(f"engine_{n}", clock.now)
    assert log.get("engine_0") is None and log.get("engine_2") is not None


@pytest.mark.parametrize(("exc", "shutting_down", "deadline", "past", "says", "failed"), [
    (asyncio.CancelledError(), True, 300.0, True, "stopped while STARTING: the run is shutting down", False),
    (asyncio.CancelledError(), False, 300.0, True, "not ACTIVE within the scale-out timeout (300 s", True),
    (TimeoutError(), False, 300.0, True, "not ACTIVE within the scale-out timeout (300 s", True),
    (asyncio.CancelledError(), False, 300.0, False, "cancelled while STARTING (no cause given)", True),
    (asyncio.CancelledError(), False, None, False, "cancelled while STARTING (no cause given)", True),
    (RuntimeError("the server exited with code 1"), False, 300.0, True,
     "RuntimeError: the server exited with code 1", True),
    (TimeoutError("placement group not ready after 300s"), False, 300.0, True,
     "TimeoutError: placement group not ready after 300s", True),
])
def test_a_stopped_bring_up_is_named_by_its_cause(exc: BaseException, shutting_down: bool, deadline: float | None,
                                                  past: bool, says: str, failed: bool) -> None:
    reason, was_failure = stop_reason(exc, "STARTING", shutting_down=shutting_down, deadline_s=deadline,
                                      past_deadline=past)
    assert reason.startswith(says) and was_failure is failed
    assert "timed out" not in reason or past


# --------------------------------------------------------------------------------------------------
# The fleet


class TimedLauncher(Launcher):
    """Starts report the actor's own figures; with ``gate`` set, a start waits for it (a slow model load)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()
        self.slots: list[str] = []

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None) -> dict[str, Any]:
        if self.gate is not None:
            self.waiting.set()
            await self.gate.wait()
        info = await super().start(engine_id, slot, initial_weights)
        return {**info, "startup_s": 0.0, "healthy_after_s": 0.0}

    def reserve(self, engine_id: str, gpus: int) -> EngineSlot:
        self.slots.append(engine_id)
        return EngineSlot(f"pg-{engine_id}", 0)

    async def wait_placed(self, slot: EngineSlot) -> None:
        return None


def make_fleet(launcher: TimedLauncher) -> tuple[EngineFleet, EnginePool, EventLog]:
    pool, events = EnginePool(time.time), EventLog(time.time)

    def client_factory(url: str, timeout_s: float, keys: Any) -> Client:
        return Client(url.removeprefix("http://"), launcher)

    fleet = build_fleet(pool, Router(), events, WeightRegistry(), launcher, FleetSettings(shutdown_timeout_s=1.0),
                        client_factory=client_factory, transports={kind: Transport() for kind in TransportKind})
    return fleet, pool, events


@pytest.mark.timeout(10)
async def test_the_fleet_records_each_engines_phases_and_says_them_once_active() -> None:
    fleet, pool, events = make_fleet(TimedLauncher())
    await fleet.start_initial([("pg", 0)])
    view = fleet.bring_ups.view("engine_0")
    assert view is not None and view["outcome"] == "ACTIVE" and view["current"] is None
    assert list(view["phases"]) == ["actor", "prepare", "server_start", "first_answer", "weight_sync"]
    brought = [e for e in events.newest(10, EventKind.ENGINE_STATE) if "brought up" in e.message]
    assert len(brought) == 1 and brought[0].details["outcome"] == "ACTIVE"
    elastic = pool.add(EngineKind.ELASTIC).engine_id
    await fleet.bring_up_elastic(elastic, timeout_s=5.0, cancelled=lambda: False)
    assert list(fleet.bring_ups.view(elastic)["phases"])[0] == "capacity"
    assert fleet.bring_ups.histogram.to_dict()["server_start"]["count"] == 2
    await fleet.shutdown()


@pytest.mark.timeout(10)
async def test_a_bring_up_past_the_scale_out_deadline_says_so_with_its_value() -> None:
    launcher = TimedLauncher()
    fleet, pool, _ = make_fleet(launcher)
    launcher.gate = asyncio.Event()  # the model load never ends
    engine_id = pool.add(EngineKind.ELASTIC).engine_id
    await fleet.bring_up_elastic(engine_id, timeout_s=1.0, cancelled=lambda: False)  # wait_for's floor is 1 s
    record = pool.get(engine_id)
    assert record.state is EngineState.FAILED
    assert record.last_error.startswith("not ACTIVE within the scale-out timeout (1 s")
    assert "it was STARTING" in record.last_error
    assert fleet.bring_ups.view(engine_id)["outcome"] == record.last_error
    await fleet.shutdown()


@pytest.mark.timeout(10)
async def test_a_replacement_still_starting_at_shutdown_is_stopped_not_failed(caplog) -> None:
    """The soak's last lines: two replacements STARTING when the run ended were logged as failed by a
    "scale-out timeout" that neither were nor had reached."""
    launcher = TimedLauncher()
    fleet, pool, _ = make_fleet(launcher)
    await fleet.start_initial([("pg", 0)])
    launcher.gate = asyncio.Event()
    launcher.dead.add("engine_0")
    await fleet.on_engine_failure("engine_0", RuntimeError("connection reset"))
    await asyncio.wait_for(launcher.waiting.wait(), 5.0)  # the replacement is loading its model
    replacement = next(r for r in pool.records() if r.engine_id != "engine_0")
    assert replacement.state is EngineState.STARTING
    with caplog.at_level(logging.INFO, logger="relax.rollout"):
        await fleet.shutdown()
    record = pool.get(replacement.engine_id)
    assert record.state is EngineState.REMOVED and record.last_error is None
    assert fleet.bring_ups.view(replacement.engine_id)["outcome"] == (
        "REMOVED: stopped while STARTING: the run is shutting down")
    assert not [r for r in caplog.records if "failed to come up" in r.getMessage()]


@pytest.mark.timeout(10)
async def test_a_scale_out_stopped_by_the_runs_end_is_removed_not_failed() -> None:
    """The run's end cancels the executor's scale-outs before the fleet stops: the fleet hears of the shutdown
    first (``begin_shutdown``), so those engines are not reported as failures."""
    launcher = TimedLauncher()
    fleet, pool, _ = make_fleet(launcher)
    launcher.gate = asyncio.Event()
    engine_id = pool.add(EngineKind.ELASTIC).engine_id
    task = asyncio.create_task(fleet.bring_up_elastic(engine_id, timeout_s=60.0, cancelled=lambda: False))
    await asyncio.wait_for(launcher.waiting.wait(), 5.0)
    fleet.begin_shutdown()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    record = pool.get(engine_id)
    assert record.state is EngineState.REMOVED and record.last_error is None
    assert fleet.bring_ups.view(engine_id)["outcome"] == "REMOVED: stopped while STARTING: the run is shutting down"
    await fleet.shutdown()
