"""All scale requests of a run: submission, one-at-a-time, lookup, listing, cancel, history.

(docs/architecture.md, "Scale requests".) The REST routes and the autoscaler both go through
:meth:`ScaleRequestRegistry.submit_scale_out` / :meth:`~ScaleRequestRegistry.submit_scale_in`, so they get the
same rules and the same messages. The registry checks before it mutates: a rejected request changes nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from relax.rollout.pool.engines import EnginePool
from relax.rollout.scaling.errors import NotCancellable, RejectedRequest, ScaleConflict, UnknownRequest
from relax.rollout.scaling.planner import (
    Noop,
    Rejection,
    ScaleInPlan,
    ScaleInSpec,
    ScaleOutPlan,
    ScaleOutSpec,
    check_model_name,
    plan_scale_in,
    plan_scale_out,
)
from relax.rollout.scaling.requests import Clock, ScaleInRequest, ScaleOutRequest, ScaleRequest
from relax.rollout.scaling.states import Direction, ScaleInStatus, ScaleOutStatus

__all__ = ["CancelBatchResult", "ScaleRequestRegistry"]


@dataclass(frozen=True)
class CancelBatchResult:
    """What ``POST /rollout/scale_out_cancel`` did (or, with ``dry_run``, would do)."""

    dry_run: bool
    cancelled: list[str]
    skipped: list[dict[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "cancelled": list(self.cancelled), "skipped": [dict(s) for s in self.skipped]}


_ID_PREFIX = {Direction.SCALE_OUT: "so", Direction.SCALE_IN: "si"}
_STATUS_ENUM: dict[Direction, type[Enum]] = {Direction.SCALE_OUT: ScaleOutStatus, Direction.SCALE_IN: ScaleInStatus}


def _parse_statuses(values: Iterable[str], enum: type[Enum], field_name: str) -> set[Enum]:
    """Status names, case-insensitive; an unknown one is a :class:`RejectedRequest` naming the field and the
    allowed names."""
    out: set[Enum] = set()
    for value in values:
        try:
            out.add(enum(str(value).upper()))
        except ValueError:
            allowed = ", ".join(s.value for s in enum)
            raise RejectedRequest(
                f"{field_name}: unknown status {value!r} (allowed: {allowed})", field=field_name, code="bad_status"
            ) from None
    return out


class ScaleRequestRegistry:
    """All scale requests of a run: creation, one-at-a-time, lookup, listing, cancel, garbage collection.

    Ids are ``so-<n>`` / ``si-<n>``, numbered per direction from 1 and never reused. At most one request
    (of either direction) is non-terminal at any time; reaching a terminal status frees the slot. Finished
    requests are kept for the newest ``keep`` per direction; running ones are never collected.
    """

    def __init__(self, clock: Clock = time.time, keep: int = 100) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self._clock = clock
        self._keep = keep
        self._requests: dict[str, ScaleRequest] = {}  # in creation order
        self._seq = itertools.count(1)
        self._numbers = dict.fromkeys(Direction, 0)

    @property
    def keep(self) -> int:
        return self._keep

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    # -- one at a time ------------------------------------------------------------------------------

    def running(self) -> ScaleRequest | None:
        """The non-terminal request, if any."""
        for request in self._requests.values():
            if not request.terminal:
                return request
        return None

    def ensure_idle(self) -> None:
        """Raise :class:`ScaleConflict` (with the running id) when a scale operation is in progress."""
        running = self.running()
        if running is not None:
            raise ScaleConflict(running.request_id, running.status.value, running.direction.value)

    # -- creation -----------------------------------------------------------------------------------

    def create(self, plan: ScaleOutPlan | ScaleInPlan) -> ScaleRequest:
        """Register an accepted plan as a PENDING request; raises :class:`ScaleConflict` if one runs."""
        if not isinstance(plan, ScaleOutPlan | ScaleInPlan):
            raise TypeError(f"only a ScaleOutPlan or ScaleInPlan can be registered, got {type(plan).__name__}")
        if isinstance(plan, ScaleInPlan) and plan.dry_run:
            raise ValueError("a dry-run scale-in plan is only shown, never registered")
        self.ensure_idle()
        direction = Direction.SCALE_OUT if isinstance(plan, ScaleOutPlan) else Direction.SCALE_IN
        self._numbers[direction] += 1
        request_id = f"{_ID_PREFIX[direction]}-{self._numbers[direction]}"
        cls = ScaleOutRequest if direction is Direction.SCALE_OUT else ScaleInRequest
        request = cls.from_plan(plan, request_id, seq=next(self._seq), clock=self._clock)  # type: ignore[arg-type]
        self._requests[request_id] = request
        self.gc()
        return request

    def submit_scale_out(
        self,
        spec: ScaleOutSpec,
        pool: EnginePool,
        *,
        initial_count: int,
        max_engines: int | None = None,
        existing_urls: Iterable[str] = (),
    ) -> ScaleOutRequest | Noop:
        """The ``POST /rollout/scale_out`` entry point (REST and autoscaler alike).

        Order of answers: rule violations first (:class:`~relax.rollout.scaling.errors.RejectedRequest`,
        :class:`~relax.rollout.scaling.errors.UnknownModel`), since they are wrong whatever runs; then
        :class:`ScaleConflict` if another operation runs; then NOOP or a new PENDING request.
        """
        outcome = plan_scale_out(
            spec, pool, initial_count=initial_count, max_engines=max_engines, existing_urls=existing_urls
        )
        if isinstance(outcome, Rejection):
            raise outcome.to_error()
        self.ensure_idle()
        if isinstance(outcome, Noop):
            return outcome
        return self.create(outcome)  # type: ignore[return-value]

    def submit_scale_in(
        self, spec: ScaleInSpec, pool: EnginePool, *, initial_count: int
    ) -> ScaleInRequest | Noop | ScaleInPlan:
        """The ``POST /rollout/scale_in`` entry point; a dry run returns the plan and may run while another
        operation is in progress (it changes nothing). A rejection about the pool's state (too few ACTIVE
        elastic engines) while another operation runs is that operation's :class:`ScaleConflict`."""
        outcome = plan_scale_in(spec, pool, initial_count=initial_count)
        if isinstance(outcome, Rejection):
            if outcome.depends_on_pool and not spec.dry_run:
                self.ensure_idle()  # the pool is being changed: 409 names the running request, not a 400
            raise outcome.to_error()
        if isinstance(outcome, ScaleInPlan) and outcome.dry_run:
            return outcome
        self.ensure_idle()
        if isinstance(outcome, Noop):
            return outcome
        return self.create(outcome)  # type: ignore[return-value]

    # -- lookup -------------------------------------------------------------------------------------

    def get(self, request_id: str, direction: Direction | str | None = None) -> ScaleRequest:
        """The request with this id; :class:`UnknownRequest` if unknown or of the other direction."""
        wanted = None if direction is None else Direction(direction)
        request = self._requests.get(request_id) if isinstance(request_id, str) else None
        if request is None or (wanted is not None and request.direction is not wanted):
            raise UnknownRequest(str(request_id), None if wanted is None else wanted.value)
        return request

    def list_requests(
        self,
        direction: Direction | str | None = None,
        *,
        status: str | Iterable[str] | None = None,
        model_name: str | None = None,
    ) -> list[ScaleRequest]:
        """Requests newest first, filtered by direction, status name(s) and model.

        An unknown status name is a :class:`RejectedRequest`, an unknown model an ``UnknownModel``.

        Collects garbage first: requests end without telling the registry, so this is where history is trimmed
        for whoever looks at it.
        """
        wanted = None if direction is None else Direction(direction)
        statuses: set[str] | None = None
        if status is not None:
            names = [status] if isinstance(status, str) else list(status)
            enums = [_STATUS_ENUM[wanted]] if wanted is not None else list(_STATUS_ENUM.values())
            valid = {s.value for e in enums for s in e}
            statuses = set()
            for name in names:
                if str(name).upper() not in valid:
                    raise RejectedRequest(
                        f"status: unknown status {name!r} (allowed: {', '.join(sorted(valid))})",
                        field="status",
                        code="bad_status",
                    )
                statuses.add(str(name).upper())
        if model_name is not None:
            check_model_name(model_name)
        self.gc()
        return self._select(wanted, statuses, model_name)

    def _select(
        self, direction: Direction | None, statuses: set[str] | None = None, model_name: str | None = None
    ) -> list[ScaleRequest]:
        out = [
            r
            for r in self._requests.values()
            if (direction is None or r.direction is direction)
            and (statuses is None or r.status.value in statuses)
            and (model_name is None or r.model_name == model_name)
        ]
        return sorted(out, key=lambda r: r.seq, reverse=True)

    # -- cancel -------------------------------------------------------------------------------------

    def cancel(self, request_id: str) -> ScaleOutRequest:
        """Set the sticky cancel flag of a running scale-out: :class:`UnknownRequest` for an unknown id,
        :class:`NotCancellable` once finished or for a scale-in."""
        request = self.get(request_id)
        if isinstance(request, ScaleInRequest):
            raise NotCancellable(
                request_id,
                request.status.value,
                f"request {request_id} is a scale-in, which cannot be cancelled (its engines are already "
                "leaving the router); scale out again afterwards if needed",
            )
        request.request_cancel()
        return request

    def cancel_batch(self, status_filter: Iterable[str] | None = None, *, dry_run: bool = False) -> CancelBatchResult:
        """Cancel every running scale-out whose status is in ``status_filter`` (all running ones when None).

        Matching requests that already ended are listed in ``skipped``. ``dry_run`` changes nothing and says
        what would be cancelled. An unknown status name is a :class:`RejectedRequest` naming
        ``status_filter`` (nothing changed).
        """
        wanted = None if status_filter is None else _parse_statuses(status_filter, ScaleOutStatus, "status_filter")
        cancelled: list[str] = []
        skipped: list[dict[str, str]] = []
        targets = [r for r in self._select(Direction.SCALE_OUT) if wanted is None or r.status in wanted]
        for request in targets:
            if request.terminal:
                if wanted is not None:
                    skipped.append(
                        {"request_id": request.request_id, "status": request.status.value, "reason": "finished"}
                    )
                continue
            if not dry_run:
                request.request_cancel()  # type: ignore[union-attr]
            cancelled.append(request.request_id)
        return CancelBatchResult(dry_run=dry_run, cancelled=cancelled, skipped=skipped)

    # -- history ------------------------------------------------------------------------------------

    def gc(self) -> list[str]:
        """Forget finished requests beyond the newest ``keep`` per direction; returns the forgotten ids."""
        gone: list[str] = []
        for direction in Direction:
            finished = [r for r in self._requests.values() if r.direction is direction and r.terminal]
            finished.sort(key=lambda r: r.seq, reverse=True)
            gone.extend(r.request_id for r in finished[self._keep :])
        for request_id in gone:
            del self._requests[request_id]
        return gone
