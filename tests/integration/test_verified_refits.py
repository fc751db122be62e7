"""A refit is verified on real built-in engines: weights changed behind Relax's back are caught, repaired or
replaced, and nothing is generated on them after the check (``rollout.refit.rules``, ``WeightSync``).

The fleet runs as in ``test_fleet`` (real engine processes, real HTTP, the real broadcast from a real
``WeightSender``; the launcher port starts local processes instead of actors). The engines' ``/weights_checker``
is the built-in one, answering in SGLang's shape; tests/sglang/test_verified_refits.py does the same against the
real SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from relax.config.verify_weights import VerifyPolicy
from relax.engines.client import EngineClient, WeightsUncheckable
from relax.rollout.assembly import build_fleet
from relax.rollout.fleet.lifecycle import EngineFleet
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventLog, transition_recorder
from relax.rollout.refit.broadcast import ThreadWeightSource
from relax.rollout.refit.rules import VerifyResult
from relax.rollout.routing.router import Router
from relax.rollout.settings import FleetSettings
from relax.training.sender import WeightSender
from relax.weights.digest import layout_checksums, version_digest
from relax.weights.publication import WeightRegistry
from tests.integration.test_fleet import ProcessLauncher, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = [1, 2, 3, 4, 5]


class WatchedClient(EngineClient):
    """An engine client that notes the engine's generated-token count when a check answers and when a reload ends,
    and can have the engine's weights changed behind Relax's back after every load (``corrupt_with``): an engine
    whose loads answer success but leave other weights (as the real SGLang's partial sessions do on AMX CPUs)."""

    corrupt_with: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, int, int]] = []  # (what, tokens generated so far, requests finished so far)

    async def _generated(self) -> int:
        return int((await self.get_server_info())["stats"]["generated_tokens"])

    async def _note(self, what: str) -> None:
        stats = (await self.get_server_info())["stats"]
        self.notes.append((what, int(stats["generated_tokens"]), int(stats["finished_requests"])))

    async def weights_checksums(self, **kwargs: Any) -> dict[str, str]:
        answer = await super().weights_checksums(**kwargs)
        await self._note("checked")
        return answer

    async def end_weight_update(self, *args: Any, **kwargs: Any) -> Any:
        answer = await super().end_weight_update(*args, **kwargs)
        if self.corrupt_with is not None:
            await corrupt(self, self.corrupt_with)
        await self._note("loaded")
        return answer


async def corrupt(client: EngineClient, model_dir: str) -> None:
    """Load other weights into the engine without telling Relax, keeping the version it reports."""
    version = await client.get_weight_version()
    await client.update_weights_from_disk(model_dir, version)


async def greedy(client: EngineClient) -> tuple[list[int], list[float]]:
    out = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0.0},
                                return_logprob=True, timeout=60)
    pairs = out["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


@dataclass
class Running:
    """Two real built-in engines ACTIVE in a fleet, and the trainer's side of the broadcast."""

    fleet: EngineFleet
    events: EventLog
    sender: WeightSender
    source: ThreadWeightSource


@contextlib.asynccontextmanager
async def two_engines(start_engine, model_dir: str, policy: VerifyPolicy) -> AsyncIterator[Running]:
    """A fleet of two engines with ``policy``; afterwards every server it started is stopped."""
    weights = WeightRegistry()
    events = EventLog()
    pool = EnginePool(time.time, on_transition=transition_recorder(events, lambda: weights.latest_version))
    launcher = ProcessLauncher(start_engine, model_dir)
    fleet = build_fleet(pool, Router(), events, weights, launcher,
                        FleetSettings(model_path=model_dir, request_timeout_s=60, health_timeout_s=60,
                                      drain_timeout_s=30, shutdown_timeout_s=5, verify_weights=policy),
                        client_factory=lambda url, timeout, keys: WatchedClient(url, timeout=timeout, token=keys))
    sender = WeightSender("127.0.0.1", keep=2)
    try:
        await fleet.start_initial([("pg", 0), ("pg", 1)])
        yield Running(fleet, events, sender, ThreadWeightSource(sender))
    finally:
        await fleet.shutdown()
        sender.shutdown()
    assert launcher.procs == {}


async def test_weights_changed_behind_relax_are_caught_repaired_and_never_generate_after_the_check(
        start_engine, tiny_preset, perturbed, logprob_tol) -> None:
    _, state = perturbed
    async with two_engines(start_engine, str(tiny_preset.model_dir), VerifyPolicy.FIRST) as run:
        fleet, events, sender, source = run.fleet, run.events, run.sender, run.source
        expected = version_digest(layout_checksums(state, "hf"))
        fleet.weight_sync.publish(1, [], sender.hold(1, state), source=source)
        await fleet.weight_sync.settle()
        records = {r.engine_id: r for r in fleet.pool.active()}
        assert {(r.weight_version, r.weights_verified, r.weight_digest) for r in records.values()} == {
            (1, True, expected)}  # each engine's first load is checked: (version, digest) known and verified
        good, bad = (fleet.client(e) for e in ("engine_0", "engine_1"))
        reference = await greedy(good)

        # a retried publication is a no-op: nothing is sent again
        loads = [(await c.get_server_info())["distributed_buckets_loaded"] for c in (good, bad)]
        fleet.weight_sync.publish(1, [], sender.hold(1, {k: v.clone() for k, v in state.items()}), source=source)
        await fleet.weight_sync.settle()
        assert [(await c.get_server_info())["distributed_buckets_loaded"] for c in (good, bad)] == loads

        # engine_1's weights change behind Relax's back (the base checkpoint, same version label): it generates
        # differently, and the next check catches it
        await corrupt(bad, str(tiny_preset.model_dir))
        assert await bad.get_weight_version() == "1" and await greedy(bad) != reference
        before = await bad._generated()
        finished = int((await bad.get_server_info())["stats"]["finished_requests"])
        long = asyncio.ensure_future(bad.generate(input_ids=PROMPT, sampling_params={
            "max_new_tokens": 240, "ignore_eos": True, "temperature": 1.0}, timeout=120))
        deadline = time.monotonic() + 60
        while await bad._generated() < before + 5:  # in flight on the corrupt weights when the check comes
            assert time.monotonic() < deadline and not long.done(), "the long request never started"
            await asyncio.sleep(0.02)
        bad.notes.clear()
        outcome = await fleet.verify_engine("engine_1")
        assert outcome.result is VerifyResult.VERIFIED and outcome.attempt == 1  # caught, reloaded, verified
        (mismatch,) = events.newest(kind="weights_mismatch")
        assert mismatch.engine_ids == ("engine_1",) and mismatch.details["served_digest"] != expected
        assert mismatch.details["expected_digest"] == expected and mismatch.details["mismatched"]
        # from the failed check to the end of the reload the engine generated nothing (paused), with the long
        # request in flight all along; it went on after the repair
        assert [n for n, _, _ in bad.notes] == ["checked", "loaded", "checked"]
        assert bad.notes[0][1] == bad.notes[1][1] and bad.notes[0][2] == bad.notes[1][2] == finished
        assert (await long)["meta_info"]["completion_tokens"] == 240
        tokens, logprobs = await greedy(bad)
        assert tokens == reference[0]
        assert max(abs(a - b) for a, b in zip(logprobs, reference[1], strict=True)) < logprob_tol
        assert fleet.weight_sync.verifications == {"verified": 3, "mismatch": 1, "uncheckable": 0}
        assert fleet.pool.get("engine_1").state is EngineState.ACTIVE


async def test_an_engine_whose_loads_leave_other_weights_is_failed_and_replaced_by_one_that_verifies(
        start_engine, tiny_preset, perturbed) -> None:
    _, state = perturbed
    async with two_engines(start_engine, str(tiny_preset.model_dir), VerifyPolicy.EVERY) as run:
        fleet, events, sender, source = run.fleet, run.events, run.sender, run.source
        fleet.client("engine_1").corrupt_with = str(tiny_preset.model_dir)  # every load of engine_1 is undone
        fleet.weight_sync.publish(1, [], sender.hold(1, state), source=source)
        await wait_for(lambda: fleet.pool.get("engine_1").state is EngineState.FAILED, 120, "engine_1 failed")
        assert "still after one full reload" in (fleet.pool.get("engine_1").last_error or "")
        assert [e.details["attempt"] for e in reversed(events.newest(kind="weights_mismatch"))] == [0, 1]
        await wait_for(lambda: any(r.engine_id == "engine_2" for r in fleet.pool.active()), 120, "the replacement")
        replacement = fleet.pool.get("engine_2")
        assert (replacement.weight_version, replacement.weights_verified) == (1, True)
        assert fleet.pool.get("engine_0").weights_verified and fleet.pool.get("engine_1").weight_version == 0
        assert sorted(fleet.router.routable()) == ["engine_0", "engine_2"]


class JoinLauncher(ProcessLauncher):
    """Starts an engine the way the Ray launcher does when told ``dummy_weights``: ``--load-format dummy``, from a
    model directory whose weight file is garbage (``joiner_dir``): a start that read it would fail."""

    def __init__(self, start_engine: Any, model_dir: str, joiner_dir: str) -> None:
        super().__init__(start_engine, model_dir)
        self.joiner_dir = joiner_dir
        self.dummy: dict[str, bool] = {}

    async def start(self, engine_id: str, slot: Any, initial_weights: Any = None, *,
                    dummy_weights: bool = False) -> dict[str, Any]:
        self.dummy[engine_id] = dummy_weights
        if not dummy_weights:
            return await super().start(engine_id, slot, initial_weights)
        proc = await asyncio.to_thread(self._start_engine, self.joiner_dir, load_format="dummy")
        self.procs[engine_id] = proc
        return {"url": proc.url, "node_id": "local"}


class UncheckableClient(WatchedClient):
    async def weights_checksums(self, **kwargs: Any) -> dict[str, str]:
        raise WeightsUncheckable("this engine cannot report its weights", url=self.base_url,
                                 endpoint="/weights_checker")


@contextlib.asynccontextmanager
async def joining_fleet(start_engine, model_dir: str, joiner_dir: str, policy: VerifyPolicy,
                        client: type[WatchedClient] = WatchedClient) -> AsyncIterator[tuple[Running, JoinLauncher]]:
    """One initial engine, --joiner-weights dummy, a version published by broadcast before anyone joins."""
    weights, events = WeightRegistry(), EventLog()
    pool = EnginePool(time.time, on_transition=transition_recorder(events, lambda: weights.latest_version))
    launcher = JoinLauncher(start_engine, model_dir, joiner_dir)
    fleet = build_fleet(pool, Router(), events, weights, launcher,
                        FleetSettings(model_path=model_dir, request_timeout_s=60, health_timeout_s=60,
                                      drain_timeout_s=30, shutdown_timeout_s=5, verify_weights=policy,
                                      dummy_joins=True),
                        client_factory=lambda url, timeout, keys: client(url, timeout=timeout, token=keys))
    sender = WeightSender("127.0.0.1", keep=2)
    try:
        await fleet.start_initial([("pg", 0)])
        yield Running(fleet, events, sender, ThreadWeightSource(sender)), launcher
    finally:
        await fleet.shutdown()
        sender.shutdown()
    assert launcher.procs == {}


async def join_after_a_broadcast(run: Running, state: dict[str, Any]) -> str:
    """Version 1 published by broadcast and loaded by the initial engine, then an elastic engine joins."""
    run.fleet.weight_sync.publish(1, [], run.sender.hold(1, state), source=run.source)
    await run.fleet.weight_sync.settle()
    joiner = run.fleet.pool.add(EngineKind.ELASTIC).engine_id
    await run.fleet.bring_up_elastic(joiner, timeout_s=120, cancelled=lambda: False)
    return joiner


@pytest.fixture
def joiner_dir(tiny_preset, tmp_path) -> str:
    """The tiny model's directory with its weight file replaced by garbage: only config and tokenizer are good."""
    import shutil

    target = tmp_path / "joiner-model"
    shutil.copytree(tiny_preset.model_dir, target)
    (target / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    return str(target)


async def test_a_joiner_reads_no_checkpoint_and_serves_only_after_its_verified_refit(
        start_engine, tiny_preset, perturbed, joiner_dir, logprob_tol) -> None:
    _, state = perturbed
    async with joining_fleet(start_engine, str(tiny_preset.model_dir), joiner_dir, VerifyPolicy.OFF) as (run, launcher):
        fleet = run.fleet
        joiner = await join_after_a_broadcast(run, state)
        record = fleet.pool.get(joiner)
        assert launcher.dummy == {"engine_0": False, joiner: True}  # the initial engine served version 0
        assert record.state is EngineState.ACTIVE, record.last_error
        # checked although --verify-weights off: random weights are never routed unverified
        assert (record.weight_version, record.weights_verified) == (1, True)
        assert record.weight_digest == version_digest(layout_checksums(state, "hf"))
        tokens, logprobs = await greedy(fleet.client(joiner))
        reference = await greedy(fleet.client("engine_0"))
        assert tokens == reference[0]
        assert max(abs(a - b) for a, b in zip(logprobs, reference[1], strict=True)) < logprob_tol
        phases = fleet.bring_ups.view(joiner)["phases"]
        assert {"capacity", "first_answer", "weight_sync", "verify"} <= set(phases)


async def test_a_joiner_whose_refit_cannot_be_verified_is_failed_and_never_routed(
        start_engine, tiny_preset, perturbed, joiner_dir) -> None:
    _, state = perturbed
    async with joining_fleet(start_engine, str(tiny_preset.model_dir), joiner_dir, VerifyPolicy.OFF,
                             UncheckableClient) as (run, _):
        fleet = run.fleet
        joiner = await join_after_a_broadcast(run, state)
        record = fleet.pool.get(joiner)
        assert record.state is EngineState.FAILED
        assert "started with random weights (--joiner-weights dummy)" in (record.last_error or "")
        assert "could not be verified (uncheckable" in (record.last_error or "")
        assert fleet.router.routable() == ["engine_0"]
