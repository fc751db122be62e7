"""The weight-sync rules (``rollout.refit.weight_sync``, ``rollout.refit.transport``) with a fake transport: no engine.

Every rule the issue of stale weights depends on, in milliseconds: a superseded version moves on to the
newest, a failed load fails the engine and never counts as served, a syncing engine is neither probed nor
sent requests, a version published mid-sync is picked up, and the path is chosen by one pure rule.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from relax.rollout.assembly import build_fleet
from relax.rollout.fleet import lifecycle as fleet_module
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventLog
from relax.rollout.pool.launcher import EngineSlot
from relax.rollout.refit.transport import TransportKind, VersionSuperseded, choose_transport
from relax.rollout.refit.weight_sync import WeightSync, engines_behind
from relax.rollout.routing.router import Router
from relax.rollout.settings import FleetSettings
from relax.weights.pause_mode import PauseMode
from relax.weights.publication import WeightManifest, WeightRegistry

S = EngineState


def manifest(version: int) -> WeightManifest:
    return WeightManifest(version, ("w",), ((4,),), ("float32",), 16, (1,))


class FakeTransport:
    """Records each send; a send may be held (``gate``), fail, or find its version superseded."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.forgotten: list[str] = []
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()
        self.fail: dict[tuple[str, int], BaseException] = {}

    async def send(self, engine_id: str, client: Any, latest: Any, check: Any = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        self.sent.append((engine_id, latest.version))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        error = self.fail.get((engine_id, latest.version))
        if error is not None:
            raise error
        return {"paused_s": 0.01}

    async def forget(self, engine_id: str, client: Any | None) -> None:
        self.forgotten.append(engine_id)


def active_pool(n: int, kind: EngineKind = EngineKind.INITIAL, version: int = 0) -> EnginePool:
    pool = EnginePool(time.time)
    for _ in range(n):
        record = pool.add(kind)
        for state in (S.STARTING, S.HEALTH_CHECKING, S.WEIGHT_SYNCING):
            pool.transition(record.engine_id, state)
        pool.set_weight_version(record.engine_id, version)
        pool.transition(record.engine_id, S.ACTIVE)
    return pool


def make_sync(pool: EnginePool, transport: FakeTransport, failures: list | None = None) -> WeightSync:
    async def on_failure(engine_id: str, exc: BaseException) -> None:
        (failures if failures is not None else []).append((engine_id, exc))

    return WeightSync(pool, WeightRegistry(keep=2), {kind: transport for kind in TransportKind},
                      lambda engine_id: f"client-of-{engine_id}", on_failure=on_failure, superseded_wait_s=2.0)


def test_the_path_is_chosen_by_one_rule() -> None:
    assert choose_transport(True, EngineKind.INITIAL) is TransportKind.BROADCAST
    assert choose_transport(True, EngineKind.EXTERNAL) is TransportKind.BROADCAST  # bytes only in rank 0
    assert choose_transport(False, EngineKind.ELASTIC) is TransportKind.OBJECT_STORE
    assert choose_transport(False, EngineKind.EXTERNAL) is TransportKind.DISK  # no actor of ours on its node


def test_engines_behind_the_latest_version() -> None:
    pool = active_pool(3, version=1)
    pool.set_weight_version("engine_2", 2)
    assert engines_behind(pool.active(), 2) == ["engine_0", "engine_1"]
    assert engines_behind(pool.active(), None) == []


async def test_publish_brings_every_active_engine_to_the_version() -> None:
    pool, transport = active_pool(2), FakeTransport()
    sync = make_sync(pool, transport)
    sync.publish(1, [], manifest(1), source="rank0")
    await sync.settle()
    assert sorted(transport.sent) == [("engine_0", 1), ("engine_1", 1)]
    assert [r.weight_version for r in pool.active()] == [1, 1]
    assert set(sync.last_syncs) == {"engine_0", "engine_1"} and sync.last_syncs["engine_0"]["version"] == 1


async def test_a_superseded_version_moves_on_to_the_newest_without_touching_the_engine() -> None:
    pool, transport = active_pool(1), FakeTransport()
    sync = make_sync(pool, transport)
    transport.fail[("engine_0", 1)] = VersionSuperseded("v1 dropped")
    transport.gate = asyncio.Event()
    sync.publish(1, [], manifest(1), source="rank0")
    await transport.started.wait()
    sync.registry.publish(2, [], manifest(2), sender="rank0")  # the trainer stepped on meanwhile
    transport.gate.set()
    await sync.settle()
    assert transport.sent == [("engine_0", 1), ("engine_0", 2)]
    assert pool.get("engine_0").weight_version == 2


async def test_a_superseded_version_waits_for_the_newer_publication() -> None:
    pool, transport = active_pool(1), FakeTransport()
    sync = make_sync(pool, transport)
    transport.fail[("engine_0", 1)] = VersionSuperseded("v1 dropped")
    sync.publish(1, [], manifest(1), source="rank0")
    await transport.started.wait()
    await asyncio.sleep(0)  # the sync now waits for a newer version (woken by publish, no polling)
    sync.publish(2, [], manifest(2), source="rank0")
    await sync.settle()
    assert transport.sent == [("engine_0", 1), ("engine_0", 2)] and pool.get("engine_0").weight_version == 2


class CheckedClient:
    """An engine's checks: how it hashes (SHA-256, the default) and what it serves."""

    async def get_server_info(self) -> dict[str, Any]:
        return {}

    async def weights_checksums(self, timeout: float | None = None) -> dict[str, str]:
        return {"w": "abc"}


class RankZero:
    """The trainer's rank 0 as a sender: the checksums of v1 are slow to come (never, here); later ones at once."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.slow = asyncio.Event()

    async def checksums(self, version: int, timeout: float, algorithm: str) -> dict[str, str]:
        self.asked.append(version)
        if version == 1:
            self.slow.set()
            await asyncio.Event().wait()
        return {"w": "abc"}


class CheckingTransport(FakeTransport):
    async def send(self, engine_id: str, client: Any, latest: Any, check: Any = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        self.sent.append((engine_id, latest.version))
        return {"verifications": [await check(0)]} if check is not None else {}


async def test_a_join_checked_against_a_version_that_a_newer_one_replaces_catches_up_instead_of_failing() -> None:
    """The soak's "timed out while WEIGHT_SYNCING" 0.37 s into a good refit: the joiner's load of v1 was being
    checked when v2 and v3 were published; v1 left the registry (it keeps 2) and its checksums' fetch was
    cancelled under the check. Now the join moves on to v3 and becomes ACTIVE on it, verified."""
    pool, transport, failures = EnginePool(time.time), CheckingTransport(), []
    joiner = pool.add(EngineKind.ELASTIC).engine_id
    for state in (S.STARTING, S.HEALTH_CHECKING, S.WEIGHT_SYNCING):
        pool.transition(joiner, state)
    rank0 = RankZero()

    async def on_failure(engine_id: str, exc: BaseException) -> None:
        failures.append((engine_id, exc))

    sync = WeightSync(pool, WeightRegistry(keep=2), {kind: transport for kind in TransportKind},
                      lambda engine_id: CheckedClient(), on_failure=on_failure, superseded_wait_s=2.0)
    sync.registry.publish(1, [], manifest(1), sender=rank0)
    join = asyncio.create_task(sync.sync_to_latest(joiner))
    await rank0.slow.wait()  # v1 is loaded; its check waits for v1's checksums
    for version in (2, 3):
        sync.publish(version, [], manifest(version), source=rank0)
    sync._expected_checksums(sync.registry.latest())  # the next check's fetch drops the fetches of dropped versions
    await asyncio.wait_for(join, 5.0)
    await sync.settle()
    assert failures == []
    assert transport.sent[0] == (joiner, 1) and transport.sent[-1][1] == 3
    record = pool.get(joiner)
    assert record.weight_version == 3 and sync.last_syncs[joiner]["verified"]


async def test_a_failed_load_fails_the_engine_and_never_counts_as_served() -> None:
    pool, transport, failures = active_pool(2), FakeTransport(), []
    sync = make_sync(pool, transport, failures)
    transport.fail[("engine_1", 1)] = RuntimeError("broadcast on group g failed: Connection reset by peer")
    sync.publish(1, [], manifest(1), source="rank0")
    await sync.settle()
    assert [(eid, str(exc)) for eid, exc in failures] == [
        ("engine_1", "broadcast on group g failed: Connection reset by peer")]
    assert pool.get("engine_0").weight_version == 1
    assert pool.get("engine_1").weight_version == 0  # not recorded as holding v1
    assert sync.is_syncing("engine_1") is False


async def test_a_version_published_mid_sync_is_picked_up() -> None:
    pool, transport = active_pool(1), FakeTransport()
    sync = make_sync(pool, transport)
    transport.gate = asyncio.Event()
    sync.publish(1, [], manifest(1), source="rank0")
    await transport.started.wait()
    sync.publish(2, [], manifest(2), source="rank0")  # lands while v1 is loading
    transport.gate.set()
    await sync.settle()
    assert transport.sent == [("engine_0", 1), ("engine_0", 2)] and pool.get("engine_0").weight_version == 2


async def test_a_syncing_engine_holds_its_requests_until_the_load_ends() -> None:
    pool, transport = active_pool(1), FakeTransport()
    sync = make_sync(pool, transport)
    transport.gate = asyncio.Event()
    sync.publish(1, [], manifest(1), source="rank0")
    await transport.started.wait()
    assert sync.is_syncing("engine_0")
    held = asyncio.ensure_future(sync.wait_not_syncing("engine_0"))
    await asyncio.sleep(0)
    assert not held.done()
    transport.gate.set()
    await held
    await sync.settle()
    assert not sync.is_syncing("engine_0")
    await asyncio.wait_for(sync.wait_not_syncing("engine_0"), 1)  # an idle engine is not held


async def test_forget_releases_what_each_transport_keeps_and_wakes_waiters() -> None:
    pool, transport = active_pool(1), FakeTransport()
    sync = make_sync(pool, transport)
    transport.gate = asyncio.Event()
    sync.publish(1, [], manifest(1), source="rank0")
    await transport.started.wait()
    held = asyncio.ensure_future(sync.wait_not_syncing("engine_0"))
    await sync.forget("engine_0", None)
    await asyncio.wait_for(held, 1)
    assert transport.forgotten == ["engine_0"] * len(TransportKind)
    transport.gate.set()
    sync.shutdown()


# -- the fleet reads the rules: a syncing engine is not health-probed --------------------------------------


class ProbedClient:
    def __init__(self) -> None:
        self.probes = 0
        self.probed = asyncio.Event()

    async def health_generate(self, *, timeout: float | None = None) -> None:
        return None

    async def is_healthy(self, *, generate: bool = False, timeout: float | None = None) -> bool:
        self.probes += 1
        self.probed.set()
        return True

    async def aclose(self) -> None:
        return None


class StubLauncher:
    def __init__(self) -> None:
        self.ids: list[str] = []

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None) -> dict[str, Any]:
        self.ids.append(engine_id)
        return {"url": f"http://{engine_id}", "node_id": "n"}

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool:
        return True

    async def stop(self, engine_id: str, grace_s: float) -> None:
        self.ids.remove(engine_id)

    def release(self, slot: EngineSlot) -> None:
        return None

    def engine_ids(self) -> list[str]:
        return list(self.ids)


async def test_the_fleet_does_not_health_probe_a_syncing_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "HEALTH_INTERVAL_S", 0.001)
    client, transport = ProbedClient(), FakeTransport()
    registry = WeightRegistry()
    pool = EnginePool(time.time)
    fleet = build_fleet(pool, Router(), EventLog(), registry, StubLauncher(), FleetSettings(),
                        client_factory=lambda url, timeout, token: client,
                        transports={kind: transport for kind in TransportKind})
    try:
        await fleet.start_initial([("group", 0)])
        await asyncio.wait_for(client.probed.wait(), 2)  # an idle ACTIVE engine is probed
        transport.gate = asyncio.Event()
        fleet.weight_sync.publish(1, [], manifest(1), source="rank0")
        await transport.started.wait()
        client.probed.clear()
        probes = client.probes
        for _ in range(20):  # many health intervals pass while the engine loads
            await asyncio.sleep(0.002)
        assert client.probes == probes and fleet.weight_sync.is_syncing("engine_0")
        transport.gate.set()
        await fleet.settle_weights()
        await asyncio.wait_for(client.probed.wait(), 2)  # probed again once the load is over
        assert pool.get("engine_0").weight_version == 1
    finally:
        await fleet.shutdown()


def test_pause_mode_is_one_enum_from_the_flag_to_the_client() -> None:
    from relax.config.flags import parse_args

    assert parse_args(["--weight-sync-pause-mode", "in_place"]).weight_sync_pause_mode is PauseMode.IN_PLACE
    assert [m.pauses for m in PauseMode] == [True, True, True, False]
    assert FleetSettings().weight_sync_pause_mode is PauseMode.RETRACT


async def test_one_cancelled_check_leaves_the_shared_checksum_fetch_to_the_others() -> None:
    """Engines checked against one version share one fetch of its checksums: a check cancelled by its own engine's
    deadline must not cancel the fetch under the others (they would read it as a superseded version)."""
    from relax.rollout.refit.weight_sync import check_served_weights

    answer: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
    fetch = asyncio.ensure_future(asyncio.shield(answer))

    def expected() -> asyncio.Future[dict[str, str]]:
        return fetch

    first = asyncio.create_task(check_served_weights("engine_0", 1, CheckedClient(), expected))
    second = asyncio.create_task(check_served_weights("engine_1", 1, CheckedClient(), expected))
    await asyncio.sleep(0)  # both wait for the fetch
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    answer.set_result({"w": "abc"})
    outcome = await asyncio.wait_for(second, 2.0)
    assert outcome.result.value == "verified" and not fetch.cancelled()
