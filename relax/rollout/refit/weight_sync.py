"""Weight sync: every ACTIVE engine brought to the newest published version, and never serving a stale one.

The one component of the weight path on the rollout side (docs/architecture.md, "Weights and staleness"). It
owns the rules; how the bytes travel is a :class:`~relax.rollout.refit.transport.WeightTransport`, chosen per
engine and version by ``choose_transport``; the engine's lifecycle (start, fail, retire) is the fleet's.

* **publish** records a version and brings every ACTIVE engine behind it up to date in the background; the
  trainer never waits. A version published while engines sync is picked up when they finish (each engine
  loops until it holds the newest).
* **sync_to_latest** brings one engine to the newest version (a joining engine does this before it is ACTIVE).
  One sync per engine at a time. A version the trainer dropped before its send began, or whose checksums were
  dropped with it while the load was being checked (``VersionSuperseded``), is skipped for the next one: the
  engine catches up to the newest instead of failing.
* **syncing** engines are paused or loading: the fleet does not health-probe them (a paused SGLang fails its
  health generation) and the dispatcher holds their requests (:meth:`wait_not_syncing`).
* A failed load fails the engine (``on_failure``): it is never resumed on part of a version or left serving
  the old one as if current.
* **verified** (``--verify-weights``, the rules in ``rollout.refit.rules``): a load is checked against the version's
  publication before the engine continues; a mismatch is reported (``on_verification``), reloaded once in full,
  and a second one fails the engine. :meth:`verify` checks an engine on demand. Each engine's (version, digest)
  is in its pool record; a version it holds already is not sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from relax.engines.client import WeightsUncheckable
from relax.rollout.pool.engines import EnginePool, EngineRecord
from relax.rollout.refit.rules import (
    EngineWeights,
    RefitStep,
    Verification,
    VerifyPolicy,
    VerifyResult,
    plan_refit,
    should_verify,
)
from relax.rollout.refit.transport import Check, TransportKind, VersionSuperseded, WeightTransport, choose_transport
from relax.weights.digest import ChecksumAlgorithm, checksum_algorithm, checksum_mismatches, version_digest
from relax.weights.publication import PublishedWeights, WeightConflict, WeightManifest, WeightRegistry

__all__ = ["WeightSync", "check_served_weights", "engines_behind"]

log = logging.getLogger("relax.rollout")

#: How long a check may take: the engine hashes every tensor it serves (about 1.3 GB/s per rank on CPU), and the
#: trainer's rank 0 the publication, once per version.
VERIFY_TIMEOUT_S = 300.0

#: How long an engine whose version was superseded waits for the newer one to be registered (the trainer held
#: it before it dropped the old one, so it is at most a registration away).
SUPERSEDED_WAIT_S = 60.0


def engines_behind(active: Iterable[EngineRecord], latest_version: int | None) -> list[str]:
    """The ACTIVE engines that hold an older version than ``latest_version`` (none when nothing is published)."""
    if latest_version is None:
        return []
    return [r.engine_id for r in active if (r.weight_version or 0) < latest_version]


async def check_served_weights(engine_id: str, version: int, client: Any,
                               expected: Callable[[], Awaitable[Mapping[str, str]]], *, attempt: int = 0,
                               timeout_s: float = VERIFY_TIMEOUT_S) -> Verification:
    """One check: the engine's ``/weights_checker`` answer against ``expected()`` (the publication's checksums).

    Both sides hash at once (the trainer's rank 0 its held version, once per version; the engine what it serves),
    so a check costs the slower of the two, not their sum.
    """
    began = time.monotonic()
    served_call = asyncio.ensure_future(client.weights_checksums(timeout=timeout_s))
    # The publication's checksums are fetched once per version for every engine checked against it: shielded, so
    # one check that is cancelled (its engine's deadline, the run's shutdown) never cancels the others' fetch.
    fetch = asyncio.ensure_future(expected())
    try:
        wanted = dict(await asyncio.shield(fetch))
    except Exception as exc:  # noqa: BLE001 - nothing to compare with: the engine cannot be judged, not failed
        served_call.cancel()
        served_call.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, never "never retrieved"
        log.warning("%s: no checksums of v%d to check it against: %s", engine_id, version, exc)
        return Verification(engine_id, version, VerifyResult.UNCHECKABLE, "", seconds=time.monotonic() - began,
                            attempt=attempt, detail=f"no checksums of v{version} to compare with: {exc}")
    except asyncio.CancelledError:
        served_call.cancel()
        if not fetch.cancelled():  # this check itself is being cancelled (shutdown, a deadline): let it go
            raise
        # The fetch was dropped with its version (``_expected_checksums``): a newer one was published meanwhile.
        raise VersionSuperseded(f"weights v{version} were replaced by a newer publication while {engine_id} was "
                                "checked against them") from None
    except BaseException:
        served_call.cancel()
        raise
    expected_digest = version_digest(wanted)
    try:
        served = await served_call
    except WeightsUncheckable as exc:
        return Verification(engine_id, version, VerifyResult.UNCHECKABLE, expected_digest,
                            seconds=time.monotonic() - began, attempt=attempt, detail=str(exc))
    bad = checksum_mismatches(wanted, served)
    return Verification(engine_id, version, VerifyResult.MISMATCH if bad else VerifyResult.VERIFIED, expected_digest,
                        version_digest(served), tuple(bad), time.monotonic() - began, attempt)


class UnverifiedWeights(RuntimeError):
    """An engine that must be shown to serve the publication (it started with random weights) could not be."""


class WeightSync:
    """Published versions → engines, through the transports; the rules above, in one place."""

    def __init__(
        self,
        pool: EnginePool,
        registry: WeightRegistry,
        transports: Mapping[TransportKind, WeightTransport],
        client: Callable[[str], Any],
        *,
        on_failure: Callable[[str, BaseException], Awaitable[None]],
        on_change: Callable[[], None] = lambda: None,
        superseded_wait_s: float = SUPERSEDED_WAIT_S,
        verify: VerifyPolicy | str = VerifyPolicy.FIRST,
        on_verification: Callable[[Verification], None] = lambda v: None,
        verify_timeout_s: float = VERIFY_TIMEOUT_S,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.transports = dict(transports)
        self._client = client
        self._on_failure = on_failure
        self._on_change = on_change
        self._superseded_wait_s = superseded_wait_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._idle: dict[str, asyncio.Event] = {}  # per engine: set while it is not loading weights
        self._published = asyncio.Event()  # replaced at each publication; set wakes who waits for a newer one
        self._loop_task: asyncio.Task[None] | None = None
        self.last_syncs: dict[str, dict[str, Any]] = {}  # per engine: its last load's timings
        self.verify_policy = VerifyPolicy(verify)
        self._on_verification = on_verification
        self._verify_timeout_s = verify_timeout_s
        self._verified: set[str] = set()  # engines one of whose loads passed a check
        self._must_verify: set[str] = set()  # engines started with random weights, not yet verified
        # per (version, hash): the publication's checksums; per engine: how it hashes
        self._expected: dict[tuple[int, ChecksumAlgorithm], asyncio.Task[dict[str, str]]] = {}
        self._algorithms: dict[str, ChecksumAlgorithm] = {}
        self.verifications: dict[str, int] = {r.value: 0 for r in VerifyResult}  # checks made, by result
        self.last_verifications: dict[str, dict[str, Any]] = {}  # per engine: its last check

    # ------------------------------------------------------------------ publication
    def publish(self, version: int, bucket_refs: Sequence[Any], manifest: WeightManifest, *,
                source: Any = None) -> PublishedWeights:
        """Record ``version`` (``source``: the trainer's rank 0, for broadcast) and sync every engine behind it.

        The same publication again is a no-op; the same version with other weights raises ``WeightConflict``.
        """
        again = version in self.registry.versions()
        entry = self.registry.publish(version, list(bucket_refs), manifest, sender=source)
        if again:
            return entry
        published, self._published = self._published, asyncio.Event()
        published.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._sync_loop())
        return entry

    async def settle(self) -> None:
        """Wait for a publication in progress (a scale-in must not pull an engine out in mid-load)."""
        if self._loop_task is not None and not self._loop_task.done():
            with contextlib.suppress(Exception):
                await self._loop_task

    async def _sync_loop(self) -> None:
        """Bring every ACTIVE engine to the latest version; newer versions published meanwhile win.

        An engine whose load failed is handed to ``on_failure`` once and not retried here (the fleet takes it
        out of service), so a failure the fleet cannot act on never spins this loop.
        """
        failed: set[str] = set()
        while True:
            latest = self.registry.latest()
            behind = [eid for eid in engines_behind(self.pool.active(), None if latest is None else latest.version)
                      if eid not in failed]
            if latest is None or not behind:
                return
            began = time.monotonic()
            results = await asyncio.gather(*(self.sync_to_latest(eid) for eid in behind), return_exceptions=True)
            for eid, res in zip(behind, results, strict=True):
                if isinstance(res, BaseException):
                    failed.add(eid)
                    await self._on_failure(eid, res)  # never serve stale weights
            paused = [p for eid in behind if (p := self.last_syncs.get(eid, {}).get("paused_s")) is not None]
            log.debug("weights v%d on %d engine(s) in %.2fs (engines paused %s)", latest.version, len(behind),
                     time.monotonic() - began, f"max {max(paused):.2f}s" if paused else "n/a")
            self._on_change()

    # ------------------------------------------------------------------ one engine
    async def sync_to_latest(self, engine_id: str) -> None:
        """Bring one engine to the newest published version (looping while newer ones land); raises on failure."""
        async with self._locks.setdefault(engine_id, asyncio.Lock()):
            while True:
                latest = self.registry.latest()
                if latest is None:
                    return
                record = self.pool.get(engine_id)
                known = self._known_digest(engine_id, latest.version)
                step = plan_refit(EngineWeights(record.weight_version, record.weight_digest), latest.version, known)
                if step is RefitStep.NOTHING:
                    return
                if step is RefitStep.REFUSE:
                    raise WeightConflict(f"{engine_id} holds weights v{latest.version} with digest "
                                         f"{(record.weight_digest or '')[:12]}, but v{latest.version} was published "
                                         f"with digest {(known or '')[:12]}")
                must = engine_id in self._must_verify
                check = (self._check(engine_id, latest)
                         if must or should_verify(self.verify_policy, verified_before=engine_id in self._verified)
                         else None)
                try:
                    timings = await self._send(engine_id, latest, check)
                except VersionSuperseded as superseded:
                    log.info("%s: %s; moving on to the newest", engine_id, superseded)
                    await self._newer_than(latest.version)
                    continue
                if must:
                    self._must_be_verified(engine_id, latest.version, timings)
                self._loaded(engine_id, latest, timings)

    def require_verified(self, engine_id: str) -> None:
        """The engine started with random weights (``--joiner-weights dummy``): its first load is checked whatever
        ``--verify-weights`` says, and one that cannot be shown to serve the publication fails it."""
        self._must_verify.add(engine_id)

    def _must_be_verified(self, engine_id: str, version: int, timings: Mapping[str, Any]) -> None:
        checks = list(timings.get("verifications") or ())
        last = checks[-1] if checks else None
        if last is None or last.result is not VerifyResult.VERIFIED:
            why = "no check was made" if last is None else f"{last.result.value}: {last.detail or last.describe()}"
            raise UnverifiedWeights(f"{engine_id} started with random weights (--joiner-weights dummy) and its "
                                    f"first refit to v{version} could not be verified ({why}); it never serves "
                                    "(--joiner-weights checkpoint starts from the checkpoint instead)")
        self._must_verify.discard(engine_id)

    async def verify(self, engine_id: str) -> Verification:
        """Check an engine's served weights against the version it holds, now (paused for the check); a mismatch
        is repaired with one full load of that version, and a second one raises ``WeightMismatch`` (the caller
        fails the engine)."""
        async with self._locks.setdefault(engine_id, asyncio.Lock()):
            record = self.pool.get(engine_id)
            latest = self.registry.latest()
            if latest is None or record.weight_version != latest.version:
                held = "nothing published" if latest is None else f"the newest is v{latest.version}"
                return Verification(engine_id, record.weight_version or 0, VerifyResult.UNCHECKABLE, "",
                                    detail=f"it holds v{record.weight_version} and {held}: a load will verify it")
            try:
                timings = await self._send(engine_id, latest, self._check(engine_id, latest), verify_only=True)
            except VersionSuperseded as superseded:  # a newer version landed meanwhile: the next load checks it
                return Verification(engine_id, latest.version, VerifyResult.UNCHECKABLE, "", detail=str(superseded))
            self._loaded(engine_id, latest, timings)
            return timings["verifications"][-1]

    async def _send(self, engine_id: str, latest: PublishedWeights, check: Check | None, *,
                    verify_only: bool = False) -> dict[str, Any]:
        kind = choose_transport(latest.broadcast, self.pool.get(engine_id).kind)
        idle = self._idle.setdefault(engine_id, asyncio.Event())
        idle.clear()
        began = time.monotonic()
        try:
            timings = await self.transports[kind].send(engine_id, self._client(engine_id), latest, check,
                                                       verify_only=verify_only)
        finally:
            idle.set()
        return {**(timings or {}), "total_s": time.monotonic() - began}

    def _loaded(self, engine_id: str, latest: PublishedWeights, timings: dict[str, Any]) -> None:
        """The engine holds ``latest`` now: its record says so, with the digest a check found."""
        checks: list[Verification] = list(timings.get("verifications") or ())
        verified = bool(checks) and checks[-1].result is VerifyResult.VERIFIED
        self.last_syncs[engine_id] = {**{k: v for k, v in timings.items() if k != "verifications"},
                                      "version": latest.version, "verified": verified}
        self.pool.set_weight_version(engine_id, latest.version, checks[-1].served_digest if verified else None,
                                     verified)
        if verified:
            self._verified.add(engine_id)
        elif self.verify_policy is not VerifyPolicy.OFF and engine_id in self._algorithms:
            # (version, digest) known without a check of this load: the publication's digest in the engine's hash

            def learn(task: asyncio.Task[dict[str, str]]) -> None:
                if not task.cancelled() and task.exception() is None and engine_id in self._locks:
                    self.pool.set_weight_digest(engine_id, latest.version, version_digest(task.result()))

            self._expected_checksums(latest, self._algorithms[engine_id]).add_done_callback(learn)

    # ------------------------------------------------------------------ verification
    def _known_digest(self, engine_id: str, version: int) -> str | None:
        """The digest of ``version`` as ``engine_id`` would report it, when already known (its hash is known and the
        version's checksums in that hash were fetched)."""
        algorithm = self._algorithms.get(engine_id)
        task = None if algorithm is None else self._expected.get((version, algorithm))
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return version_digest(task.result())

    async def _algorithm(self, engine_id: str) -> ChecksumAlgorithm:
        """How the engine hashes what it serves (``checksum_algorithm`` of its ``/server_info``), asked once."""
        algorithm = self._algorithms.get(engine_id)
        if algorithm is None:
            info = await self._client(engine_id).get_server_info()
            algorithm = self._algorithms[engine_id] = checksum_algorithm(info if isinstance(info, dict) else {})
        return algorithm

    def _expected_checksums(self, latest: PublishedWeights,
                            algorithm: ChecksumAlgorithm = ChecksumAlgorithm.SHA256) -> asyncio.Task[dict[str, str]]:
        """The checksums an engine holding ``latest`` and hashing with ``algorithm`` reports: the manifest's (SHA-256
        only), or asked of the trainer's rank 0 (once per version and hash; it hashes its held buffers)."""
        key = (latest.version, ChecksumAlgorithm(algorithm))
        task = self._expected.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            async def fetch() -> dict[str, str]:
                if latest.manifest.checksums is not None and key[1] is ChecksumAlgorithm.SHA256:
                    return dict(latest.manifest.checksums)
                if latest.sender is None:
                    raise LookupError(f"weights v{latest.version} carry no {key[1].value} checksums (an object-store "
                                      "publication has SHA-256 ones only) and have no sender to ask")
                return dict(await asyncio.wait_for(
                    latest.sender.checksums(latest.version, self._verify_timeout_s, key[1].value),
                    self._verify_timeout_s + 5.0))

            task = self._expected[key] = asyncio.ensure_future(fetch())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"
            held = set(self.registry.versions())
            for old in [k for k in self._expected if k[0] not in held]:
                self._expected.pop(old).cancel()
        return task

    def _check(self, engine_id: str, latest: PublishedWeights) -> Check:
        """The check of one engine against ``latest``, as ``rollout.refit.rules.load_verified`` calls it."""

        async def check(attempt: int) -> Verification:
            algorithm = await self._algorithm(engine_id)
            outcome = await check_served_weights(engine_id, latest.version, self._client(engine_id),
                                                 lambda: self._expected_checksums(latest, algorithm), attempt=attempt,
                                                 timeout_s=self._verify_timeout_s)
            self._record(outcome)
            return outcome

        return check

    def _record(self, outcome: Verification) -> None:
        self.verifications[outcome.result.value] += 1
        self.last_verifications[outcome.engine_id] = outcome.to_dict()
        if outcome.result is VerifyResult.MISMATCH:
            log.error("%s%s", outcome.describe(), "; loading it again in full" if outcome.attempt == 0 else
                      "; still after a full reload: the engine is failed")
        elif outcome.result is VerifyResult.UNCHECKABLE:
            log.warning("%s", outcome.describe())
        else:
            log.info("%s in %.2fs", outcome.describe(), outcome.seconds)
        self._on_verification(outcome)

    async def _newer_than(self, version: int) -> None:
        deadline = time.monotonic() + self._superseded_wait_s
        while (latest := self.registry.latest()) is None or latest.version <= version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no weight version newer than v{version} was published within "
                                   f"{self._superseded_wait_s:g}s, and the trainer no longer holds it")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), remaining)

    def is_syncing(self, engine_id: str) -> bool:
        """Paused or loading now: not to be health-probed, its requests held."""
        idle = self._idle.get(engine_id)
        return idle is not None and not idle.is_set()

    async def wait_not_syncing(self, engine_id: str) -> None:
        """Hold a request for an engine that is paused for a weight load until it continues.

        Sent now, it would only wait in the engine's queue, where the autoscaler reads queued requests as
        missing capacity; more engines would not help, they pause for each publication too. Held here, the
        wait still shows in the request's latency and the rollout's time, but not as a queue.
        """
        if self.is_syncing(engine_id):
            await self._idle[engine_id].wait()

    async def forget(self, engine_id: str, client: Any | None) -> None:
        """The engine leaves: each transport releases what it keeps for it (its weight group)."""
        for transport in self.transports.values():
            await transport.forget(engine_id, client)
        self._locks.pop(engine_id, None)
        self._verified.discard(engine_id)
        self._must_verify.discard(engine_id)
        self._algorithms.pop(engine_id, None)
        idle = self._idle.pop(engine_id, None)
        if idle is not None:
            idle.set()  # nothing waits on a departed engine

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in self._expected.values():
            task.cancel()
