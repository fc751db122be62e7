"""The dispatcher: sends each generation to an engine, streams it, and carries out ``rollout.dispatch.journey``'s rules.

Thin on purpose (docs/architecture.md, "Dispatch"): it picks the engine (``Router``), holds a request while its
engine loads weights, sends it streamed so the prefix of every generation in flight is held
(``relax.engines.event_stream``), and asks :class:`~relax.rollout.dispatch.journey.RequestJourney` what to do when the
attempt ends. The rollout manager composes it; the generation loop and evaluation call :meth:`generate`.

An engine that dies without notice: its stream breaks (connection reset), or — a node that vanished without a
word — the fleet declares it FAILED (health loop, Ray) and :meth:`on_transition` cancels the streams still
waiting on it. Either way each of its requests continues on a surviving engine from its last complete chunk.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from relax.engines.client import EngineError, EngineUnavailable
from relax.engines.event_stream import EventStream
from relax.rollout.dispatch.generator import Generation
from relax.rollout.dispatch.journey import Action, RequestJourney, Step, stream_interval
from relax.rollout.pool.engines import EnginePool, EngineRecord, EngineState
from relax.rollout.routing.router import FailureKind, NoEngineAvailable, RetryPolicy, Router
from relax.rollout.settings import DispatchSettings

log = logging.getLogger("relax.rollout")

__all__ = ["DispatchSettings", "Dispatcher", "EngineLost", "MigrationStats", "SampleLostError"]


class SampleLostError(RuntimeError):
    """A request failed on every engine it was tried on; raised instead of silently dropping it.

    ``refused``: the engine refused the request itself (a client error: too long, malformed); no engine would
    take it, so its group is dropped (counted) rather than the run ended."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class EngineLost(ConnectionError):
    """The fleet declared the engine FAILED while this request was streaming from it."""


class _SyncGate(Protocol):
    async def wait_not_syncing(self, engine_id: str) -> None: ...


class DispatchFleet(Protocol):
    """What the dispatcher needs of ``rollout.fleet.lifecycle.EngineFleet``."""

    routable: asyncio.Event

    def client(self, engine_id: str) -> Any: ...

    def note_release(self, engine_id: str) -> None: ...

    def note_answer(self, engine_id: str, version: int) -> None: ...

    async def on_engine_failure(self, engine_id: str, exc: BaseException) -> None: ...


@dataclass
class MigrationStats:
    """Tokens kept by migration vs thrown away and generated again, over the run (Relax /metrics, status)."""

    migrated_requests: int = 0
    tokens_kept: int = 0
    tokens_regenerated: int = 0
    restarts: int = 0

    def record(self, step: Step) -> None:
        self.tokens_kept += step.kept
        if step.regenerated:
            self.tokens_regenerated += step.regenerated
            self.restarts += 1
        if step.action is Action.DONE and step.segments > 1:
            self.migrated_requests += 1

    def to_dict(self) -> dict[str, Any]:
        total = self.tokens_kept + self.tokens_regenerated
        return {**asdict(self), "tokens_kept_fraction": self.tokens_kept / total if total else None}


@dataclass(eq=False)  # identity: a set member per attempt
class _Attempt:
    engine_id: str
    held: EventStream = field(default_factory=EventStream)
    task: asyncio.Task[Any] | None = None


#: HTTP statuses that mean "this engine cannot take it now" (overloaded, restarting, a proxy in front gave up).
UNAVAILABLE_STATUS = frozenset({408, 429, 502, 503, 504})


def classify_error(exc: BaseException) -> FailureKind:
    """Map an exception from an engine call to a :class:`FailureKind`.

    Reads the typed errors of :mod:`relax.engines.client` and the standard transport errors; here, in the shell,
    so the router's rules stay free of HTTP. Anything else is ``OTHER``: an error of our own making must
    surface, not be retried until it happens to disappear.
    """
    status = getattr(exc, "status_code", None)
    if isinstance(exc, EngineUnavailable):
        return FailureKind.ENGINE_UNAVAILABLE
    if isinstance(status, int) and not isinstance(status, bool):
        if status in UNAVAILABLE_STATUS:
            return FailureKind.ENGINE_UNAVAILABLE
        if 400 <= status < 500:
            return FailureKind.CLIENT_ERROR
        if status >= 500:
            return FailureKind.SERVER_ERROR
    if isinstance(exc, EngineError):
        return FailureKind.SERVER_ERROR  # answered, but with a body that breaks the contract
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | ConnectionError):
        return FailureKind.ENGINE_UNAVAILABLE
    return FailureKind.OTHER



class Dispatcher:
    def __init__(self, router: Router, pool: EnginePool, fleet: DispatchFleet, policy: RetryPolicy,
                 settings: DispatchSettings, *, sync: _SyncGate) -> None:
        self.router = router
        self.pool = pool
        self.fleet = fleet
        self.policy = policy
        self.settings = settings
        self.sync = sync  # the WeightSync: a request waits here while its engine loads weights
        self.migration = MigrationStats()
        self.tokens_generated = 0
        self._attempts: dict[str, set[_Attempt]] = {}  # engine id -> attempts streaming from it

    async def generate(self, group_key: str, input_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        """One generation on an ACTIVE engine; failures are retried elsewhere as the rules decide.

        A sample is never silently lost: a request that cannot be served ends in :class:`SampleLostError`.
        """
        journey = RequestJourney(input_ids, sampling_params, policy=self.policy, migrate=self.settings.migrate,
                                 eos_ids=self.settings.eos_ids, max_context=self.settings.max_context)
        while True:
            send = journey.send()
            engine_id = await self._acquire(group_key, send.exclude)
            step, error = await self._attempt(journey, engine_id, send)
            self.tokens_generated += step.generated
            self.migration.record(step)
            if step.action is Action.DONE:
                assert step.output is not None
                if step.segments > 1:
                    log.info("request continued on %s: %d segment(s), %d token(s)", engine_id, step.segments,
                             step.output["meta_info"].get("completion_tokens", 0))
                return Generation(engine_id=engine_id, output=step.output, dispatch_version=step.dispatch_version)
            if step.action is Action.LOST:
                refused = error is not None and classify_error(error) is FailureKind.CLIENT_ERROR
                raise SampleLostError(f"{step.reason}: {error}", refused=refused) from error
            if step.regenerated:
                log.info("%d generated token(s) thrown away and regenerated (%s)", step.regenerated, step.reason)

    async def _attempt(self, journey: RequestJourney, engine_id: str, send: Step) -> tuple[Step, BaseException | None]:
        attempt = _Attempt(engine_id)
        version = 0
        error: Exception | None = None
        try:
            await self.sync.wait_not_syncing(engine_id)  # a weight load in progress: hold it here
            version = self.pool.get(engine_id).weight_version or 0
            output = await self._send(attempt, send)
        except Exception as exc:
            error = exc
        finally:  # released before anything else, so a drain waiting on this engine sees it at once
            self.router.release(engine_id)
            self.fleet.note_release(engine_id)
        if error is not None:
            failure = FailureKind.ENGINE_FAILED if isinstance(error, EngineLost) else classify_error(error)
            prefix = attempt.held.latest() if self._prefix_readable(attempt) else None
            step = journey.failed(engine_id, failure, prefix, version)
            if failure in (FailureKind.ENGINE_UNAVAILABLE, FailureKind.ENGINE_FAILED):
                await self.fleet.on_engine_failure(engine_id, error)
            return step, error
        step = journey.answered(engine_id, output, version)
        if step.action is Action.DONE:
            self.fleet.note_answer(engine_id, version)
        return step, None if step.action is not Action.LOST else RuntimeError(f"aborted on {engine_id}")

    async def _send(self, attempt: _Attempt, send: Step) -> Mapping[str, Any]:
        client = self.fleet.client(attempt.engine_id)
        rid = uuid.uuid4().hex
        interval = stream_interval(int(send.sampling_params.get("max_new_tokens", 128)), self.settings.stream_interval,
                                   self.settings.stream_min_tokens) if self.settings.stream else None
        if interval is None:
            return await client.generate(input_ids=list(send.input_ids), sampling_params=dict(send.sampling_params),
                                         return_logprob=True, rid=rid)
        params = {**send.sampling_params, "stream_interval": interval}
        attempt.task = asyncio.ensure_future(client.generate_stream(
            attempt.held, input_ids=list(send.input_ids), sampling_params=params,
            return_logprob=True, rid=rid))
        streams = self._attempts.setdefault(attempt.engine_id, set())
        streams.add(attempt)
        try:
            return await attempt.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are being cancelled (shutdown), not the engine lost
            raise EngineLost(f"{attempt.engine_id} failed while the request was streaming") from None
        finally:
            streams.discard(attempt)
            if not streams:
                self._attempts.pop(attempt.engine_id, None)

    @staticmethod
    def _prefix_readable(attempt: _Attempt) -> bool:
        try:
            attempt.held.latest()
        except ValueError:  # a chunk that is not JSON: nothing is trusted
            return False
        return True

    def on_transition(self, record: EngineRecord, src: EngineState, dst: EngineState) -> None:
        """The pool's listener: an engine that FAILED takes its streams with it (a node gone without a reset
        would otherwise hold them until the request timeout)."""
        if dst is not EngineState.FAILED:
            return
        streams = self._attempts.get(record.engine_id, ())
        for attempt in list(streams):
            if attempt.task is not None and not attempt.task.done():
                attempt.task.cancel()
        if streams:
            log.info("%s failed: %d streaming request(s) continue elsewhere from their prefix", record.engine_id,
                     len(streams))

    async def _acquire(self, group_key: str, excluded: frozenset[str]) -> str:
        while True:
            try:
                engine_id = self.router.acquire(group_key, exclude=excluded)
            except NoEngineAvailable:
                self.fleet.routable.clear()
                await self.fleet.routable.wait()
                continue
            self.pool.set_in_flight(engine_id, self.router.in_flight(engine_id))
            return engine_id
