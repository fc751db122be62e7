"""The rollout pool's control API: what ``/rollout/*`` and the autoscaler ask of a run.

One object answers for a run, whoever hosts it: the Ray :class:`~relax.rollout.manager.RolloutManager`
delegates its remote methods here, and the in-process ``relax.testing.local_rollout.LocalRollout`` is this
class over simulated engines. The methods are the backend contract of the REST routes and the autoscaler
(``rollout.control.api.RolloutBackend``), hence async even where nothing awaits. Answers are plain JSON-able values;
a refusal is a typed error of ``rollout.scaling`` (the REST layer maps it to a status code).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from relax.rollout.fleet.bringup import BringUpLog
from relax.rollout.fleet.executor import ScaleExecutor
from relax.rollout.fleet.joins import JoinLog
from relax.rollout.pool.engines import EnginePool, EngineState, UnknownEngine
from relax.rollout.pool.events import SCALE_EVENT_KINDS, EventLog
from relax.rollout.scaling import (
    DEFAULT_MODEL,
    NoSuchEngine,
    RejectedRequest,
    ScaleInSpec,
    ScaleOutSpec,
    check_model_name,
    current_engine_count,
)


class RolloutControl:
    """Views of the pool and the scale entry points of one run."""

    def __init__(
        self,
        pool: EnginePool,
        executor: ScaleExecutor,
        events: EventLog,
        *,
        in_flight: Callable[[str], int] | None = None,
        run_status: Callable[[], Mapping[str, Any]] = dict,
        joins: JoinLog | None = None,
        bring_ups: BringUpLog | None = None,
        verify: Callable[[str], Awaitable[Mapping[str, Any]]] | None = None,
    ) -> None:
        self.pool = pool
        self._verify = verify
        self.executor = executor
        self.event_log = events
        self._in_flight = in_flight
        self._joins = joins
        self._bring_ups = bring_ups
        self._run_status = run_status

    # -- views ------------------------------------------------------------------------------------
    async def engines_view(self, model_name: str | None = None) -> dict[str, Any]:
        """``GET /rollout/engines``: live engines with their lifecycle status; removed and failed are hidden."""
        if model_name is not None:
            check_model_name(model_name)
        self._refresh_in_flight()
        live = [r for r in self.pool.records() if not r.state.terminal]
        view = [self._engine_view(r) for r in live]
        return {"models": {model_name or DEFAULT_MODEL: {"engines": view}}, "total_engines": len(view),
                "active_engines": len(self.pool.active())}

    async def engine_view(self, engine_id: str) -> dict[str, Any]:
        """``GET /rollout/engines/{engine_id}``: one engine, live or recently gone, with its bring-up, its states
        and its last error."""
        try:
            record = self.pool.get(engine_id)
        except UnknownEngine:
            raise NoSuchEngine(engine_id) from None
        self._refresh_in_flight()
        return {**self._engine_view(record), "created_at": record.created_at, "last_error": record.last_error,
                "transitions": [{"status": state.value, "at": at} for state, at in record.transitions]}

    def _engine_view(self, r: Any) -> dict[str, Any]:
        join = self._joins.get(r.engine_id) if self._joins is not None else None
        return {"engine_id": r.engine_id, "url": r.url, "kind": r.kind.value, "status": r.state.value,
                "weight_version": r.weight_version, "weight_digest": r.weight_digest,
                "weights_verified": r.weights_verified, "in_flight": r.in_flight, "node_id": r.node_id,
                "join_active_s": join.decision_to_active_s if join else None,
                "join_first_answer_s": join.decision_to_first_answer_s if join else None,
                "bring_up": self._bring_ups.view(r.engine_id) if self._bring_ups is not None else None}

    async def engine_urls(self) -> dict[str, str]:
        """ACTIVE engines' URLs (what the autoscaler scrapes)."""
        return {r.engine_id: r.url for r in self.pool.active() if r.url}

    async def events(self, limit: int = 100, kind: str | None = None) -> dict[str, Any]:
        """``GET /rollout/events``: newest first, optionally of one kind."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise RejectedRequest(f"limit: must be an integer >= 0, got {limit!r}", field="limit")
        try:
            return self.event_log.to_dict(limit, kind)
        except ValueError as exc:
            raise RejectedRequest(f"kind: {exc}", field="kind") from None

    async def relax_status(self) -> dict[str, Any]:
        """What ``/metrics`` and the autoscaler read: the pool's figures plus the run's (``run_status``)."""
        version = self.pool.min_active_weight_version()
        counts = self.event_log.counts()
        return {
            "engines_by_state": {state.value: n for state, n in self.pool.counts().items()},
            "active_engines": len(self.pool.active()),
            "current_engines": current_engine_count(self.pool),
            "engine_weight_version": -1 if version is None else version,
            "scale_events_total": {k.value: counts[k.value] for k in SCALE_EVENT_KINDS if k.value in counts},
            "initial_engines": self.executor.settings.initial_engines,
            "scale_request_running": self.executor.running_request_id(),
            **dict(self._run_status()),
        }

    def _refresh_in_flight(self) -> None:
        if self._in_flight is not None:
            for record in self.pool.records():
                self.pool.set_in_flight(record.engine_id, self._in_flight(record.engine_id))

    # -- weights ----------------------------------------------------------------------------------
    async def verify_engine(self, engine_id: str) -> dict[str, Any]:
        """``POST /rollout/engines/{engine_id}/verify``: check an ACTIVE engine's served weights against its
        version's publication now; a mismatch is reloaded once, a second one fails the engine."""
        try:
            record = self.pool.get(engine_id)
        except UnknownEngine:
            raise NoSuchEngine(engine_id) from None
        if self._verify is None:
            raise RejectedRequest("this rollout has no weight publications to verify against", code="no_weights")
        if record.state is not EngineState.ACTIVE:
            raise RejectedRequest(f"{engine_id} is {record.state.value}: only an ACTIVE engine's weights are checked "
                                  "on demand (a joining engine is checked as it loads)", code="not_active")
        return dict(await self._verify(engine_id))

    # -- scaling ----------------------------------------------------------------------------------
    async def scale_out(self, spec: ScaleOutSpec) -> dict[str, Any]:
        return self.executor.scale_out(spec)

    async def scale_in(self, spec: ScaleInSpec) -> dict[str, Any]:
        return self.executor.scale_in(spec)

    async def list_scale_requests(self, direction: str, status: str | None = None,
                            model_name: str | None = None) -> list[dict[str, Any]]:
        return self.executor.list_requests(direction, status, model_name)

    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return self.executor.get_request(direction, request_id)

    async def cancel_scale_out(self, request_id: str) -> dict[str, Any]:
        return self.executor.cancel(request_id)

    async def cancel_scale_out_batch(self, status_filter: list[str] | None = None,
                                     dry_run: bool = False) -> dict[str, Any]:
        return self.executor.cancel_batch(status_filter, dry_run)


__all__ = ["RolloutControl"]
