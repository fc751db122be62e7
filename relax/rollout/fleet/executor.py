"""The scale executor: carries out scale requests against the pool's rules, whatever runs the engines.

What a request *means* is decided by the pure planners and the registry in ``rollout.scaling`` (absolute
targets, the initial-engine floor, one operation at a time, sticky cancel, the partial-success policy).
This class carries the decision out over a :class:`ScaleFleet` — the port to whatever brings engines up
and takes them out — and keeps the request record and the event log honest along the way.

One executor, three fleets: the Ray rollout manager drives it with
:class:`~relax.rollout.fleet.lifecycle.EngineFleet` (real engines), the in-process test double
``relax.testing.local_rollout`` with simulated engines that take a step per phase, and the autoscaler simulator
with simulated engines on a virtual clock. So a policy comparison measures the executor users run, and the REST
contract tests exercise its real rules.

The control methods answer JSON-able dicts (the REST bodies) and raise the typed errors of
``rollout.scaling.errors``; mapping those to HTTP status codes is the REST layer's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from relax.rollout.pool.engines import EngineKind, EnginePool
from relax.rollout.pool.events import EventKind, EventLog
from relax.rollout.scaling import (
    Direction,
    Noop,
    ScaleInPlan,
    ScaleInRequest,
    ScaleInSpec,
    ScaleInStatus,
    ScaleKind,
    ScaleOutRequest,
    ScaleOutSpec,
    ScaleOutStatus,
    ScaleRequestRegistry,
    decide_partial_outcome,
)
from relax.rollout.settings import ScalingSettings

log = logging.getLogger("relax.rollout")

Clock = Callable[[], float]


class ScaleFleet(Protocol):
    """What the executor needs from whatever runs the engines. Bring-ups never raise: the outcome of each
    engine is its state in the pool (ACTIVE, or FAILED / REMOVED with its error)."""

    async def bring_up_elastic(self, engine_id: str, *, timeout_s: float, cancelled: Callable[[], bool]) -> None:
        """Place and start a new engine; give up after ``timeout_s`` or once ``cancelled()``."""
        ...

    async def attach_external(self, engine_id: str, url: str, *, timeout_s: float) -> None:
        """Check a running server at ``url`` and join it to the router."""
        ...

    def cancel(self, engine_ids: Iterable[str]) -> None:
        """These engines must never become ACTIVE (sticky)."""
        ...

    async def retire(self, engine_id: str, *, force: bool, drain_timeout_s: float, reason: str,
                     on_drained: Callable[[int], None] | None = None) -> int:
        """Drain (unless ``force``), abort what is left (retried elsewhere), remove; returns how many were aborted."""
        ...

    async def settle_weights(self) -> None:
        """Wait for a weight publication in progress to finish."""
        ...


class ScaleExecutor:
    """Accepts scale requests (REST and autoscaler alike) and runs each one to its end in the background."""

    def __init__(
        self,
        pool: EnginePool,
        fleet: ScaleFleet,
        events: EventLog,
        settings: ScalingSettings,
        *,
        drain_timeout_s: float = 30.0,
        clock: Clock = time.time,
        timer: Clock = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.pool = pool
        self.fleet = fleet
        self.events = events
        self.settings = settings
        self.drain_timeout_s = drain_timeout_s  # the fleet's (--scale-in-drain-timeout): a scale-in's default
        self.registry = ScaleRequestRegistry(clock)
        self._timer = timer
        self._on_change = on_change
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ control API
    def scale_out(self, spec: ScaleOutSpec) -> dict[str, Any]:
        """Accept a scale-out (``{"request_id", "status"}``) or answer NOOP; raises a ScalingError on a rule."""
        existing = [r.url for r in self.pool.live() if r.url]
        outcome = self.registry.submit_scale_out(spec, self.pool, initial_count=self.settings.initial_engines,
                                                 max_engines=self.settings.max_engines, existing_urls=existing)
        if isinstance(outcome, Noop):
            return outcome.to_dict()
        request = outcome
        answer = _accepted(request)  # PENDING: its engines are created below
        if request.kind is ScaleKind.RAY_NATIVE:
            for _ in range(request.to_create):
                request.add_engine(self.pool.add(EngineKind.ELASTIC).engine_id)
        else:
            for url in request.urls:
                request.add_engine(self.pool.add(EngineKind.EXTERNAL, url=url).engine_id, url)
        what = _describe_out(request)
        self.events.append(EventKind.SCALE_OUT_REQUESTED, what, request_id=request.request_id,
                           engine_ids=request.engine_ids)
        log.info("scale-out %s accepted: %s", request.request_id, what)
        self._spawn(self._run_scale_out(request))
        return answer

    def scale_in(self, spec: ScaleInSpec) -> dict[str, Any]:
        """Accept a scale-in, answer NOOP, or (``dry_run``) say who would go; raises a ScalingError on a rule."""
        outcome = self.registry.submit_scale_in(spec, self.pool, initial_count=self.settings.initial_engines)
        if isinstance(outcome, Noop | ScaleInPlan):
            return outcome.to_dict()
        request = outcome
        self.events.append(EventKind.SCALE_IN_REQUESTED, f"target {request.target}, victims "
                           f"{', '.join(request.victim_ids)}", engine_ids=request.victim_ids,
                           request_id=request.request_id)
        log.info("scale-in %s accepted: victims %s", request.request_id, ", ".join(request.victim_ids))
        self._spawn(self._run_scale_in(request))
        return _accepted(request)

    def list_requests(self, direction: str, status: str | None = None,
                      model_name: str | None = None) -> list[dict[str, Any]]:
        requests = self.registry.list_requests(Direction(direction), status=status, model_name=model_name)
        return [self._view(r) for r in requests]

    def get_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return self._view(self.registry.get(request_id, Direction(direction)))

    def cancel(self, request_id: str) -> dict[str, Any]:
        request = self.registry.cancel(request_id)
        self._on_cancel(request)
        return self._view(request)

    def cancel_batch(self, status_filter: list[str] | None = None, dry_run: bool = False) -> dict[str, Any]:
        result = self.registry.cancel_batch(status_filter, dry_run=dry_run)
        if not result.dry_run:
            for request_id in result.cancelled:
                self._on_cancel(self.registry.get(request_id))
        return result.to_dict()

    def running_request_id(self) -> str | None:
        running = self.registry.running()
        return None if running is None else running.request_id

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until every accepted request has run to its end (tests, shutdown)."""
        if self._tasks:
            done, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
            if pending:
                raise TimeoutError(f"{self.running_request_id()} still running after {timeout_s}s")

    async def aclose(self) -> None:
        """Stop running requests where they are (shutdown): their engines are the fleet's to stop."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------ scale-out
    async def _run_scale_out(self, request: ScaleOutRequest) -> None:
        began = self._timer()
        timeout = request.timeout_secs or self.settings.scale_out_timeout_s
        engine_ids = request.engine_ids
        if request.kind is ScaleKind.RAY_NATIVE:
            bring_ups = [self.fleet.bring_up_elastic(eid, timeout_s=timeout, cancelled=lambda: request.cancel_requested)
                         for eid in engine_ids]
        else:
            bring_ups = [self.fleet.attach_external(eid, url, timeout_s=timeout)
                         for eid, url in zip(engine_ids, request.urls, strict=True)]
        await asyncio.gather(*bring_ups, return_exceptions=True)
        request.observe(self.pool)
        results = {eid: self.pool.get(eid).state for eid in engine_ids}
        final, teardown = decide_partial_outcome(results, self.settings.partial_success_policy,
                                                 cancelled=request.cancel_requested)
        for engine_id in teardown:
            await self.fleet.retire(engine_id, force=False, drain_timeout_s=self.drain_timeout_s,
                                    reason="scale-out rollback")
        errors = [f"{eid}: {self.pool.get(eid).last_error}" for eid in engine_ids if self.pool.get(eid).last_error]
        request.observe(self.pool)
        request.advance(final, "; ".join(errors)[:2000] or None)
        request.observe(self.pool)
        took = self._timer() - began
        kind = {ScaleOutStatus.CANCELLED: EventKind.SCALE_CANCELLED,
                ScaleOutStatus.FAILED: EventKind.SCALE_FAILED}.get(request.status, EventKind.SCALE_COMPLETED)
        self.events.append(kind, f"scale-out {request.status.value} in {took:.1f}s", request_id=request.request_id,
                           engine_ids=engine_ids, details=request.timings())
        log.info("scale-out %s %s in %.1fs (%s)", request.request_id, request.status.value, took,
                 ", ".join(f"{e}={self.pool.get(e).state.value}" for e in engine_ids))
        self._on_change()

    def _on_cancel(self, request: Any) -> None:
        """The cancel is recorded once, as the request's end (``scale_cancelled``), so the counter counts cancels."""
        self.fleet.cancel(request.engine_ids)
        log.info("scale-out %s: cancel requested (%s)", request.request_id, ", ".join(request.engine_ids))

    # ------------------------------------------------------------------ scale-in
    async def _run_scale_in(self, request: ScaleInRequest) -> None:
        began = self._timer()
        await self.fleet.settle_weights()  # never pull an engine out in the middle of a weight load
        request.advance(ScaleInStatus.DRAINING)
        drain = request.timeout_secs or self.drain_timeout_s

        async def one(engine_id: str) -> None:
            await self.fleet.retire(engine_id, force=request.force, drain_timeout_s=drain, reason="scale-in",
                                    on_drained=lambda aborted: request.note_drained(engine_id,
                                                                                    aborted_requests=aborted))

        results = await asyncio.gather(*(one(e) for e in request.victim_ids), return_exceptions=True)
        request.advance(ScaleInStatus.REMOVING)
        errors = []
        for engine_id, result in zip(request.victim_ids, results, strict=True):
            if isinstance(result, BaseException):
                request.note_error(engine_id, str(result))
                errors.append(f"{engine_id}: {result}")
        request.observe(self.pool)
        if errors:
            request.fail("; ".join(errors)[:2000])
        else:
            request.advance(ScaleInStatus.COMPLETED)
        took = self._timer() - began
        self.events.append(EventKind.SCALE_COMPLETED if not errors else EventKind.SCALE_FAILED,
                           f"scale-in {request.status.value} in {took:.1f}s", request_id=request.request_id,
                           engine_ids=request.victim_ids)
        log.info("scale-in %s %s in %.1fs", request.request_id, request.status.value, took)
        self._on_change()

    # ------------------------------------------------------------------ helpers
    def _view(self, request: ScaleOutRequest | ScaleInRequest) -> dict[str, Any]:
        request.observe(self.pool)
        return request.to_dict()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _accepted(request: ScaleOutRequest | ScaleInRequest) -> dict[str, Any]:
    return {"request_id": request.request_id, "status": request.status.value}


def _describe_out(request: ScaleOutRequest) -> str:
    if request.kind is ScaleKind.RAY_NATIVE:
        return f"target {request.target} engines (+{request.to_create})"
    return f"attach {', '.join(request.urls)}"


__all__ = ["ScaleExecutor", "ScaleFleet", "ScalingSettings"]
