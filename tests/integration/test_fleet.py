"""The engine fleet and the scale executor without a cluster: real built-in engines, real HTTP, no Ray.

The launcher port is the only seam: :class:`ProcessLauncher` starts each engine as a local server process
(the same ``ServerProcess`` the EngineActor runs) instead of an actor in a placement group. Everything else
is the production code a run uses: bring-up, the router, drains, failure detection, the initial-engine
restart, the executor's request records and the event log fed by the pool's transitions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
from safetensors.torch import load_file

from relax.engines.client import EngineClient
from relax.rollout.assembly import build_fleet
from relax.rollout.fleet.executor import ScaleExecutor
from relax.rollout.fleet.lifecycle import EngineFleet
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventLog, transition_recorder
from relax.rollout.pool.launcher import EngineSlot
from relax.rollout.refit.broadcast import ThreadWeightSource
from relax.rollout.routing.router import Router
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec
from relax.rollout.settings import FleetSettings, ScalingSettings
from relax.training.sender import WeightSender
from relax.weights.publication import WeightRegistry
from tests.weight_sender import held_versions

pytestmark = pytest.mark.timeout(300)


class ProcessLauncher:
    """The launcher port over local engine processes (a test double for the Ray launcher)."""

    def __init__(self, start_engine: Any, model_dir: str) -> None:
        self._start_engine = start_engine
        self._model_dir = model_dir
        self.procs: dict[str, Any] = {}
        self.released: list[EngineSlot] = []

    def reserve(self, engine_id: str, gpus: int) -> EngineSlot:
        return EngineSlot(placement_group=f"pg-{engine_id}", bundle_index=0, owns_group=True)

    async def wait_placed(self, slot: EngineSlot) -> None:
        return None

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None) -> dict[str, Any]:
        proc = await asyncio.to_thread(self._start_engine, self._model_dir)
        self.procs[engine_id] = proc
        return {"url": proc.url, "node_id": "local"}

    async def sync_weights(self, engine_id: str, version: int, bucket_refs: list[Any], pause_mode: Any) -> None:
        raise AssertionError("no weights are published in this test")

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool | None:
        proc = self.procs.get(engine_id)
        return None if proc is None else proc.alive

    async def info(self, engine_id: str) -> dict[str, Any]:
        proc = self.procs.get(engine_id)
        return {} if proc is None else {"pid": proc.pid, "url": proc.url}

    async def stop(self, engine_id: str, grace_s: float) -> None:
        proc = self.procs.pop(engine_id, None)
        if proc is not None:
            await asyncio.to_thread(proc.stop, grace_s)

    def release(self, slot: EngineSlot) -> None:
        if slot.owns_group:
            self.released.append(slot)

    def engine_ids(self) -> list[str]:
        return list(self.procs)


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        await asyncio.sleep(0.05)


async def dispatch(fleet: EngineFleet, group: str, tokens: int) -> dict[str, Any]:
    """What the manager's dispatcher does for one request: acquire, generate, release (drains see it)."""
    engine_id = fleet.router.acquire(group)
    try:
        return await fleet.client(engine_id).generate(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0},
            timeout=120)
    finally:
        fleet.router.release(engine_id)
        fleet.note_release(engine_id)


async def test_fleet_and_executor_run_without_a_cluster(start_engine, tiny_preset) -> None:
    events = EventLog()
    weights = WeightRegistry()
    pool = EnginePool(time.time, on_transition=transition_recorder(events, lambda: weights.latest_version))
    router = Router()
    launcher = ProcessLauncher(start_engine, str(tiny_preset.model_dir))
    fleet = build_fleet(pool, router, events, weights, launcher,
                        FleetSettings(model_path=str(tiny_preset.model_dir), request_timeout_s=60,
                                      health_timeout_s=60, drain_timeout_s=60, shutdown_timeout_s=5),
                        client_factory=lambda url, timeout, token: EngineClient(url, timeout=timeout, token=token))
    executor = ScaleExecutor(pool, fleet, events, ScalingSettings(initial_engines=1, max_engines=3))
    try:
        await fleet.start_initial([("stable-group", 0)])
        assert [r.engine_id for r in pool.active()] == ["engine_0"] and router.routable() == ["engine_0"]

        # scale-out to an absolute target: a new engine joins the router once ACTIVE, with the latest weights
        accepted = executor.scale_out(ScaleOutSpec(num_replicas=2))
        assert accepted == {"request_id": "so-1", "status": "PENDING"}
        await executor.wait_idle(120)
        record = executor.get_request("scale_out", "so-1")
        assert record["status"] == "ACTIVE" and record["engine_ids"] == ["engine_1"]
        assert sorted(router.routable()) == ["engine_0", "engine_1"]
        joined = [e for e in events.newest(kind="engine_state", engine_id="engine_1") if e.message.startswith("ACTIVE")]
        assert len(joined) == 1 and joined[0].details == {"weight_version": 0, "latest_published": 0}
        assert executor.scale_out(ScaleOutSpec(num_replicas=2))["status"] == "NOOP"

        # scale-in drains for real: the victim's in-flight generations finish in full before it goes. The victim
        # is frozen (in-place pause) while the scale-in starts, so its requests are in flight by construction.
        in_flight = [asyncio.ensure_future(dispatch(fleet, f"g{i}", 120)) for i in range(6)]
        await wait_for(lambda: router.in_flight("engine_1") > 0, 30, "requests on engine_1")
        victim = fleet.client("engine_1")
        await victim.pause_generation(mode="in_place")
        on_victim = router.in_flight("engine_1")
        assert executor.scale_in(ScaleInSpec(num_replicas=1))["request_id"] == "si-1"
        await wait_for(lambda: pool.get("engine_1").state is EngineState.DRAINING, 30, "engine_1 DRAINING")
        assert router.routable() == ["engine_0"] and router.in_flight("engine_1") == on_victim > 0
        await victim.continue_generation()
        outs = await asyncio.gather(*in_flight)
        await executor.wait_idle(120)
        assert all(o["meta_info"]["completion_tokens"] == 120 for o in outs)
        scale_in = executor.get_request("scale_in", "si-1")
        assert scale_in["status"] == "COMPLETED"
        assert scale_in["victims"][0]["aborted_requests"] == 0 and scale_in["victims"][0]["drain_s"] > 0
        assert pool.get("engine_1").state is EngineState.REMOVED and "engine_1" not in launcher.procs
        assert [s.placement_group for s in launcher.released] == ["pg-engine_1"]  # its placement is given back

        # a dead server (its process group killed, as when its node dies) is failed and, being an initial
        # engine, replaced in its own bundle; a live but unanswering one would have been kept
        proc = launcher.procs["engine_0"]
        os.killpg(proc.pid, signal.SIGKILL)
        await wait_for(lambda: not proc.alive, 10, "the server to die")
        await fleet.on_engine_failure("engine_0", ConnectionError("connection refused"))
        assert pool.get("engine_0").state is EngineState.FAILED and router.routable() == []
        await wait_for(lambda: any(r.kind is EngineKind.INITIAL for r in pool.active()), 120, "the replacement")
        (replacement,) = pool.active()
        assert replacement.engine_id == "engine_2" and replacement.bundle == pool.get("engine_0").bundle
        kinds = [e.kind.value for e in events.newest(engine_id="engine_0")]
        assert "engine_failed" in kinds and "engine_restarted" in kinds
    finally:
        await executor.aclose()
        await fleet.shutdown()
    assert launcher.procs == {}  # every server the fleet started is stopped


class SteppingSource(ThreadWeightSource):
    """The real sender, with a trainer that steps twice while a joining engine's weight group opens: the
    version the fleet chose for the engine is dropped before its send begins (seen on a fast machine, where
    the tiny run steps every 0.1 s and a join's group took 0.12 s to open)."""

    def __init__(self, sender: WeightSender, step: Any) -> None:
        super().__init__(sender)
        self._step = step

    async def open(self, name: str, world_size: int, backend: str, timeout_s: float) -> dict[str, Any]:
        info = await super().open(name, world_size, backend, timeout_s)
        self._step()
        self._step()
        return info


async def test_a_joining_engine_whose_version_is_superseded_moves_on_to_the_newest(start_engine, tiny_preset) -> None:
    state = load_file(str(tiny_preset.model_dir / "model.safetensors"))
    sender = WeightSender("127.0.0.1", keep=2)
    weights = WeightRegistry()
    source: SteppingSource

    def step() -> None:
        version = (weights.latest_version or 0) + 1
        weights.publish(version, [], sender.hold(version, state), sender=source)

    source = SteppingSource(sender, step)
    weights.publish(1, [], sender.hold(1, state), sender=source)
    events = EventLog()
    pool = EnginePool(time.time, on_transition=transition_recorder(events, lambda: weights.latest_version))
    launcher = ProcessLauncher(start_engine, str(tiny_preset.model_dir))
    fleet = build_fleet(pool, Router(), events, weights, launcher,
                        FleetSettings(model_path=str(tiny_preset.model_dir), request_timeout_s=60,
                                      health_timeout_s=60, drain_timeout_s=60, shutdown_timeout_s=5),
                        client_factory=lambda url, timeout, token: EngineClient(url, timeout=timeout, token=token))
    try:
        await fleet.start_initial([("stable-group", 0)])
        (record,) = pool.active()  # v1 was dropped while its group opened; it joined on v3 instead of failing
        assert record.weight_version == 3 and held_versions(sender) == [2, 3]
        assert await fleet.client(record.engine_id).get_weight_version() == "3"
        assert not (await fleet.client(record.engine_id).get_server_info())["paused"]
    finally:
        await fleet.shutdown()
        sender.shutdown()
    assert launcher.procs == {}
