"""Elastic scaling inside the RolloutManager: the REST/autoscaler entry points and their execution.

Decisions (targets, NOOP, one-at-a-time, victims, partial outcomes) are made by the pure
`rollout.scaling`; this mixin carries them out on Ray: one placement group per new engine (the resource
demand a cluster provisioner sees), engine bring-up, drains, rollbacks. Every entry point answers an
envelope `{"http_status", "body"}` so HTTP semantics cross the Ray boundary intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ray.util.placement_group import placement_group

from relax.rollout.api_models import RequestError
from relax.rollout.engine_lifecycle import EngineSlot
from relax.rollout.events import EventKind
from relax.rollout.pool import EngineKind, EngineState
from relax.rollout.scaling import (
    Noop,
    ScaleInPlan,
    ScaleInRequest,
    ScaleInStatus,
    ScaleKind,
    ScaleOutRequest,
    ScaleOutStatus,
    decide_partial_outcome,
)

if TYPE_CHECKING:
    from relax.rollout.manager import RolloutManager

log = logging.getLogger("relax.rollout")


def envelope(status: int, body: Any) -> dict[str, Any]:
    return {"http_status": status, "body": body}


def _error(exc: RequestError) -> dict[str, Any]:
    return envelope(exc.http_status or 400, exc.to_dict())


class ElasticScaling:
    """Mixin of RolloutManager (see that class for the attributes it relies on)."""

    # ------------------------------------------------------------------ entry points (REST + autoscaler)
    async def scale_out(self: RolloutManager, body: dict[str, Any]) -> dict[str, Any]:
        try:
            existing = [r.url for r in self.pool.live() if r.url]
            outcome = self.scale_requests.submit_scale_out(
                body, self.pool, initial_count=self.initial_count, max_engines=self.cfg.max_engines,
                existing_urls=existing)
        except RequestError as exc:
            return _error(exc)
        if isinstance(outcome, Noop):
            return envelope(200, outcome.to_dict())
        self.events.append(EventKind.SCALE_OUT_REQUESTED, _describe_out(outcome), request_id=outcome.request_id)
        log.info("scale-out %s accepted: %s", outcome.request_id, _describe_out(outcome))
        self._spawn_background(self._run_scale_out(outcome))
        return envelope(200, {"request_id": outcome.request_id, "status": outcome.status.value})

    async def scale_in(self: RolloutManager, body: dict[str, Any]) -> dict[str, Any]:
        try:
            outcome = self.scale_requests.submit_scale_in(body, self.pool, initial_count=self.initial_count)
        except RequestError as exc:
            return _error(exc)
        if isinstance(outcome, Noop):
            return envelope(200, outcome.to_dict())
        if isinstance(outcome, ScaleInPlan):  # dry run: only say who would go
            return envelope(200, {"status": "DRY_RUN", **outcome.to_dict()})
        self.events.append(EventKind.SCALE_IN_REQUESTED, f"target {outcome.target}, victims "
                           f"{', '.join(outcome.victim_ids)}", engine_ids=outcome.victim_ids,
                           request_id=outcome.request_id)
        log.info("scale-in %s accepted: victims %s", outcome.request_id, ", ".join(outcome.victim_ids))
        self._spawn_background(self._run_scale_in(outcome))
        return envelope(200, {"request_id": outcome.request_id, "status": outcome.status.value})

    async def list_scale_requests(self: RolloutManager, direction: str, status: str | None = None,
                                  model_name: str | None = None) -> dict[str, Any]:
        try:
            requests = self.scale_requests.list_requests(direction, status=status, model_name=model_name)
        except RequestError as exc:
            return _error(exc)
        for request in requests:
            request.observe(self.pool)
        return envelope(200, [r.to_dict() for r in requests])

    async def get_scale_request(self: RolloutManager, direction: str, request_id: str) -> dict[str, Any]:
        try:
            request = self.scale_requests.get(request_id, direction)
        except RequestError as exc:
            return _error(exc)
        request.observe(self.pool)
        return envelope(200, request.to_dict())

    async def cancel_scale_out(self: RolloutManager, request_id: str) -> dict[str, Any]:
        try:
            request = self.scale_requests.cancel(request_id)
        except RequestError as exc:
            return _error(exc)
        self._on_cancel(request)
        return envelope(200, request.to_dict())

    async def cancel_scale_out_batch(self: RolloutManager, body: dict[str, Any] | None = None) -> dict[str, Any]:
        body = body or {}
        try:
            result = self.scale_requests.cancel_batch(body.get("status_filter"), dry_run=bool(body.get("dry_run")))
        except RequestError as exc:
            return _error(exc)
        if not result.dry_run:
            for request_id in result.cancelled:
                self._on_cancel(self.scale_requests.get(request_id))
        return envelope(200, result.to_dict())

    def _on_cancel(self: RolloutManager, request: Any) -> None:
        self._cancelled_engines.update(request.engine_ids)
        self.events.append(EventKind.SCALE_CANCELLED, "cancel requested", request_id=request.request_id,
                           engine_ids=request.engine_ids)
        self._state_changed.set()

    # ------------------------------------------------------------------ scale-out execution
    async def _run_scale_out(self: RolloutManager, request: ScaleOutRequest) -> None:
        began = time.monotonic()
        deadline = began + (request.timeout_secs or self.cfg.scale_out_timeout_s)
        if request.kind is ScaleKind.RAY_NATIVE:
            engine_ids = [self.pool.add(EngineKind.ELASTIC).engine_id for _ in range(request.to_create)]
            coros = [self._bring_up_elastic(request, eid, deadline) for eid in engine_ids]
        else:
            engine_ids = [self.pool.add(EngineKind.EXTERNAL, url=url).engine_id for url in request.urls]
            coros = [self._bring_up_external(request, eid, url, deadline)
                     for eid, url in zip(engine_ids, request.urls, strict=True)]
        for engine_id in engine_ids:
            request.add_engine(engine_id, self.pool.get(engine_id).url)
        await asyncio.gather(*coros, return_exceptions=True)
        request.observe(self.pool)
        results = {eid: self.pool.get(eid).state for eid in engine_ids}
        if request.cancel_requested:
            final, teardown = ScaleOutStatus.CANCELLED, [e for e, s in results.items() if s is not EngineState.ACTIVE]
        else:
            final, teardown = decide_partial_outcome(results, self.cfg.partial_success_policy)
        for engine_id in teardown:
            await self._retire(engine_id, force=False, drain_timeout_s=self.cfg.scale_in_drain_timeout_s,
                               shutdown_timeout_s=self.cfg.scale_in_shutdown_timeout_s, reason="scale-out rollback")
        errors = [f"{eid}: {self.pool.get(eid).last_error}" for eid in engine_ids if self.pool.get(eid).last_error]
        request.advance(final, "; ".join(errors)[:2000] or None)
        request.observe(self.pool)
        took = time.monotonic() - began
        kind = EventKind.SCALE_COMPLETED if final in (ScaleOutStatus.ACTIVE, ScaleOutStatus.PARTIAL) else (
            EventKind.SCALE_CANCELLED if request.status is ScaleOutStatus.CANCELLED else EventKind.SCALE_FAILED)
        self.events.append(kind, f"scale-out {request.status.value} in {took:.1f}s", request_id=request.request_id,
                           engine_ids=engine_ids, details=request.timings())
        log.info("scale-out %s %s in %.1fs (%s)", request.request_id, request.status.value, took,
                 ", ".join(f"{e}={self.pool.get(e).state.value}" for e in engine_ids))
        self._state_changed.set()

    async def _bring_up_elastic(self: RolloutManager, request: ScaleOutRequest, engine_id: str,
                                deadline: float) -> None:
        """One placement group per engine (PACK, no node-group markers): pending = provisioner demand."""
        bundles = [{"GPU": 1, "CPU": 1} for _ in range(self.cfg.gpus_per_engine)]
        group = placement_group(bundles, strategy="PACK", name=f"relax-{engine_id}")
        slot = EngineSlot(group, 0, owns_group=True)
        self._slots[engine_id] = slot
        ready = asyncio.ensure_future(_await_ref(group.ready()))
        try:
            while not ready.done():  # wait for capacity, honouring cancel and the request's deadline
                if request.cancel_requested:
                    raise asyncio.CancelledError("cancelled while its placement group was pending")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"placement group not ready after {self.cfg.scale_out_timeout_s:.0f}s: the "
                                       "cluster has no free {GPU:1, CPU:1}; is the provisioner adding nodes?")
                await asyncio.wait([ready], timeout=min(remaining, 1.0))
            ready.result()
            log.info("%s: placement group ready", engine_id)
        except BaseException as exc:
            ready.cancel()
            await self._cleanup_failed(engine_id, exc)
            return
        with contextlib.suppress(BaseException):  # the failure is recorded on the engine; the request decides
            await asyncio.wait_for(self._bring_up(engine_id, slot), timeout=max(1.0, deadline - time.monotonic()))

    async def _bring_up_external(self: RolloutManager, request: ScaleOutRequest, engine_id: str, url: str,
                                 deadline: float) -> None:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self._bring_up(engine_id, None, url=url),
                                   timeout=max(1.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ scale-in execution
    async def _run_scale_in(self: RolloutManager, request: ScaleInRequest) -> None:
        began = time.monotonic()
        if self._sync_task is not None and not self._sync_task.done():  # DESIGN 4: wait for a publication
            with contextlib.suppress(Exception):
                await self._sync_task
        request.advance(ScaleInStatus.DRAINING)
        drain = request.timeout_secs or self.cfg.scale_in_drain_timeout_s

        async def one(engine_id: str) -> None:
            await self._retire(engine_id, force=request.force, drain_timeout_s=drain,
                               shutdown_timeout_s=self.cfg.scale_in_shutdown_timeout_s, reason="scale-in",
                               on_drained=lambda aborted: request.note_drained(engine_id, aborted_requests=aborted))

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
        took = time.monotonic() - began
        self.events.append(EventKind.SCALE_COMPLETED if not errors else EventKind.SCALE_FAILED,
                           f"scale-in {request.status.value} in {took:.1f}s", request_id=request.request_id,
                           engine_ids=request.victim_ids)
        log.info("scale-in %s %s in %.1fs", request.request_id, request.status.value, took)


async def _await_ref(ref: Any) -> Any:
    return await ref


def _describe_out(request: ScaleOutRequest) -> str:
    if request.kind is ScaleKind.RAY_NATIVE:
        return f"target {request.target} engines (+{request.to_create})"
    return f"attach {', '.join(request.urls)}"
