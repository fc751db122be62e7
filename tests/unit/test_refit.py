"""A refit as a transaction (``rollout.refit.rules`` and ``WeightSync``'s use of it), with a fake engine: no process.

The engine here is a dict of checksums: a load copies the publication's in (unless the test corrupts it), and
``weights_checksums`` answers what it holds, as ``/weights_checker`` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from relax.config.verify_weights import VerifyPolicy
from relax.engines.client import WeightsUncheckable
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.refit.rules import (
    EngineWeights,
    RefitStep,
    Verification,
    VerifyResult,
    WeightMismatch,
    load_verified,
    plan_refit,
    should_verify,
)
from relax.rollout.refit.transport import TransportKind
from relax.rollout.refit.weight_sync import WeightSync
from relax.weights.digest import version_digest
from relax.weights.publication import WeightConflict, WeightManifest, WeightRegistry

S = EngineState


def test_a_version_the_engine_holds_is_not_sent_again_and_another_digest_under_it_is_refused() -> None:
    assert plan_refit(EngineWeights(None), 1) is RefitStep.SEND
    assert plan_refit(EngineWeights(1, "aa"), 2, "bb") is RefitStep.SEND
    assert plan_refit(EngineWeights(2, "aa"), 2, "aa") is RefitStep.NOTHING
    assert plan_refit(EngineWeights(2), 2, "aa") is RefitStep.NOTHING  # unchecked: trusted, as the loads were
    assert plan_refit(EngineWeights(2, "aa"), 2) is RefitStep.NOTHING  # the publication's digest not known yet
    assert plan_refit(EngineWeights(3, "aa"), 2, "bb") is RefitStep.NOTHING  # never backwards
    assert plan_refit(EngineWeights(2, "aa"), 2, "bb") is RefitStep.REFUSE


def test_which_loads_are_checked() -> None:
    assert should_verify("every", verified_before=True) and should_verify("every", verified_before=False)
    assert should_verify("first", verified_before=False) and not should_verify("first", verified_before=True)
    assert not should_verify(VerifyPolicy.OFF, verified_before=False)
    with pytest.raises(ValueError):
        should_verify("sometimes", verified_before=False)


def outcome(ok: bool, attempt: int = 0) -> Verification:
    return Verification("engine_0", 1, VerifyResult.VERIFIED if ok else VerifyResult.MISMATCH, "e" * 64,
                        "e" * 64 if ok else "f" * 64, () if ok else ("w",), attempt=attempt)


def run_load_verified(results: list[bool], *, loaded: bool = False) -> tuple[int, list[Verification]]:
    loads, answers = [], iter(results)

    async def load() -> int:
        loads.append(1)
        return len(loads)

    async def check(attempt: int) -> Verification:
        return outcome(next(answers), attempt)

    async def main() -> tuple[int, list[Verification]]:
        _, checks = await load_verified(load, check, loaded=loaded)
        return len(loads), checks

    return asyncio.run(main())


def test_a_mismatch_is_loaded_once_more_in_full_and_a_second_one_raises() -> None:
    assert run_load_verified([True]) == (1, [outcome(True)])
    loads, checks = run_load_verified([False, True])
    assert loads == 2 and [c.result for c in checks] == [VerifyResult.MISMATCH, VerifyResult.VERIFIED]
    with pytest.raises(WeightMismatch, match="still after one full reload") as caught:
        run_load_verified([False, False])
    assert [v.attempt for v in caught.value.verifications] == [0, 1]
    assert run_load_verified([True], loaded=True) == (0, [outcome(True)])  # a check on demand loads nothing
    assert run_load_verified([False, True], loaded=True)[0] == 1


def test_an_engine_that_cannot_report_its_weights_is_not_failed_for_it() -> None:
    v = Verification("engine_0", 1, VerifyResult.UNCHECKABLE, "e" * 64, detail="no /weights_checker")
    assert v.passed and "not verified: no /weights_checker" in v.describe()


# -------------------------------------------------------------------------------------- WeightSync


class FakeEngine:
    """What one engine serves: a dict of checksums (``None``: it cannot report them)."""

    def __init__(self) -> None:
        self.served: dict[str, str] | None = {"w": "00", "b": "00"}
        self.corrupt_next_loads = 0
        self.loads = 0
        self.paused = False
        self.server_info: dict[str, Any] = {"device": "cpu"}

    async def get_server_info(self) -> dict[str, Any]:
        return self.server_info

    async def weights_checksums(self, *, timeout: float | None = None) -> dict[str, str]:
        if self.served is None:
            raise WeightsUncheckable("no route", url="http://fake", endpoint="/weights_checker", status_code=404)
        return dict(self.served)


class LoadingTransport:
    """Loads the publication's checksums into the fake engine, paused, with the check inside the pause."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.engines = engines
        self.paused_during_check: list[bool] = []

    async def send(self, engine_id: str, client: Any, latest: Any, check: Any = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        engine = self.engines[engine_id]

        async def load() -> None:
            engine.loads += 1
            engine.served = dict(latest.manifest.checksums)
            if engine.corrupt_next_loads:
                engine.corrupt_next_loads -= 1
                engine.served["w"] = "bad"

        async def checked(attempt: int) -> Verification:
            self.paused_during_check.append(engine.paused)
            return await check(attempt)

        engine.paused = True
        _, checks = await load_verified(load, checked if check else None, loaded=verify_only)
        engine.paused = False
        return {"paused_s": 0.0, "verifications": checks}

    async def forget(self, engine_id: str, client: Any | None) -> None:
        return None


def manifest(version: int) -> WeightManifest:
    return WeightManifest(version, ("w", "b"), ((4,), (2,)), ("float32", "float32"), 24, (2,),
                          checksums={"w": f"{version:02d}", "b": "0b"})


def setup(n: int, policy: str) -> tuple[EnginePool, WeightSync, dict[str, FakeEngine], list, list]:
    pool = EnginePool(time.time)
    engines: dict[str, FakeEngine] = {}
    for _ in range(n):
        record = pool.add(EngineKind.INITIAL)
        for state in (S.STARTING, S.HEALTH_CHECKING, S.WEIGHT_SYNCING):
            pool.transition(record.engine_id, state)
        pool.set_weight_version(record.engine_id, 0)
        pool.transition(record.engine_id, S.ACTIVE)
        engines[record.engine_id] = FakeEngine()
    failures: list = []
    seen: list[Verification] = []

    async def on_failure(engine_id: str, exc: BaseException) -> None:
        failures.append((engine_id, exc))

    transport = LoadingTransport(engines)
    sync = WeightSync(pool, WeightRegistry(keep=2), {kind: transport for kind in TransportKind}, engines.__getitem__,
                      on_failure=on_failure, verify=policy, on_verification=seen.append)
    sync.transport = transport  # type: ignore[attr-defined]
    return pool, sync, engines, failures, seen


async def publish_and_settle(sync: WeightSync, version: int) -> None:
    sync.publish(version, ["ref"], manifest(version))
    await sync.settle()


def test_first_checks_a_join_and_trusts_later_loads_whose_digest_is_still_known() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(1, "first")
        await publish_and_settle(sync, 1)
        record = pool.get("engine_0")
        assert (record.weight_version, record.weights_verified) == (1, True)
        assert record.weight_digest == version_digest(manifest(1).checksums)
        await publish_and_settle(sync, 2)
        await asyncio.sleep(0)  # the digest of v2 is learned from its publication, in the background
        record = pool.get("engine_0")
        assert (record.weight_version, record.weights_verified) == (2, False)
        assert record.weight_digest == version_digest(manifest(2).checksums)
        assert [v.version for v in seen] == [1] and sync.verifications["verified"] == 1 and not failures
        assert sync.transport.paused_during_check == [True]  # type: ignore[attr-defined]

    asyncio.run(main())


def test_every_load_is_checked_and_a_corrupt_load_is_reloaded_before_the_engine_continues() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(2, "every")
        engines["engine_1"].corrupt_next_loads = 1
        await publish_and_settle(sync, 1)
        assert [(v.engine_id, v.result) for v in seen if v.result is VerifyResult.MISMATCH] == [
            ("engine_1", VerifyResult.MISMATCH)]
        assert engines["engine_1"].loads == 2 and engines["engine_0"].loads == 1
        assert all(pool.get(e).weights_verified and pool.get(e).weight_version == 1 for e in engines)
        assert sync.verifications == {"verified": 2, "mismatch": 1, "uncheckable": 0} and not failures
        assert all(sync.transport.paused_during_check)  # type: ignore[attr-defined]
        mismatch = next(v for v in seen if v.result is VerifyResult.MISMATCH)
        assert mismatch.mismatched == ("w",) and "engine_1 serves other weights than v1" in mismatch.describe()

    asyncio.run(main())


def test_an_engine_still_wrong_after_a_full_reload_is_failed_and_never_counts_the_version() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(1, "every")
        engines["engine_0"].corrupt_next_loads = 2
        await publish_and_settle(sync, 1)
        assert len(failures) == 1 and isinstance(failures[0][1], WeightMismatch)
        assert pool.get("engine_0").weight_version == 0  # never counted as serving v1
        assert [v.attempt for v in seen] == [0, 1]

    asyncio.run(main())


def test_a_check_on_demand_finds_weights_changed_behind_relax_and_repairs_them() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(1, "first")
        await publish_and_settle(sync, 1)
        engines["engine_0"].served["b"] = "changed behind Relax's back"  # type: ignore[index]
        repaired = await sync.verify("engine_0")
        assert repaired.result is VerifyResult.VERIFIED and repaired.attempt == 1
        assert [v.result for v in seen] == [VerifyResult.VERIFIED, VerifyResult.MISMATCH, VerifyResult.VERIFIED]
        assert engines["engine_0"].loads == 2 and pool.get("engine_0").weights_verified
        clean = await sync.verify("engine_0")  # nothing wrong: nothing loaded
        assert clean.result is VerifyResult.VERIFIED and engines["engine_0"].loads == 2
        engines["engine_0"].served["b"], engines["engine_0"].corrupt_next_loads = "x", 1  # type: ignore[index]
        with pytest.raises(WeightMismatch):
            await sync.verify("engine_0")

    asyncio.run(main())


def test_an_engine_that_cannot_be_checked_serves_unverified() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(1, "every")
        engines["engine_0"].served = None

        async def uncheckable() -> dict[str, str]:
            raise WeightsUncheckable("TP 2", url="u", endpoint="/weights_checker")

        engines["engine_0"].weights_checksums = lambda **_: uncheckable()  # type: ignore[method-assign]
        await publish_and_settle(sync, 1)
        record = pool.get("engine_0")
        assert record.weight_version == 1 and not record.weights_verified and not failures
        assert sync.verifications["uncheckable"] == 1

    asyncio.run(main())


def test_publishing_a_version_again_is_a_no_op_and_other_weights_under_it_are_refused() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(1, "off")
        await publish_and_settle(sync, 1)
        sync.publish(1, ["ref"], manifest(1))  # a retried publication
        await sync.settle()
        assert engines["engine_0"].loads == 1
        with pytest.raises(WeightConflict):
            sync.publish(1, ["ref"], dataclasses.replace(manifest(1), checksums={"w": "99", "b": "0b"}))
        assert not seen and pool.get("engine_0").weight_digest is None  # off: nothing asked, nothing known

    asyncio.run(main())


def test_an_engine_on_a_gpu_is_checked_in_sglangs_gpu_hash_which_an_object_store_version_lacks() -> None:
    async def main() -> None:
        pool, sync, engines, failures, seen = setup(1, "every")
        engines["engine_0"].server_info = {"device": "cuda", "tp_size": 1}
        await publish_and_settle(sync, 1)  # the manifest carries SHA-256 checksums only
        (outcome,) = seen
        assert outcome.result is VerifyResult.UNCHECKABLE and "sglang-gpu" in outcome.detail
        assert pool.get("engine_0").weight_version == 1 and not failures

    asyncio.run(main())


def test_which_hash_an_engine_uses_is_read_from_its_server_info() -> None:
    from relax.weights.digest import ChecksumAlgorithm, checksum_algorithm

    assert checksum_algorithm({"engine": "relax-builtin", "device": "cuda"}) is ChecksumAlgorithm.SHA256
    assert checksum_algorithm({"device": "cpu"}) is ChecksumAlgorithm.SHA256  # SGLang on CPU
    assert checksum_algorithm({"device": "cuda"}) is ChecksumAlgorithm.SGLANG_GPU
    assert checksum_algorithm({}) is ChecksumAlgorithm.SGLANG_GPU  # SGLang's default device
