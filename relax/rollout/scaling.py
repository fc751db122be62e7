"""The pure core of elastic scaling (DESIGN 4): plans, request records, one-at-a-time, cancel, history.

The RolloutManager's scale controller is a thin async shell around this module. It asks a planner what a
request means against the pool right now (:func:`plan_scale_out`, :func:`plan_scale_in`), registers it
(:class:`ScaleRequestRegistry`, which enforces *one scale operation at a time*), then carries the plan out
with Ray and reports progress back into the request record (``add_engine``, ``observe``, ``advance``).
The REST routes and the autoscaler both go through :meth:`ScaleRequestRegistry.submit_scale_out` /
:meth:`~ScaleRequestRegistry.submit_scale_in`, so they get the same rules and the same messages.

Three rules shape everything here:

* ``num_replicas`` is an **absolute target** of live engines, never a delta, so a retried request is
  harmless: once the target is met the answer is NOOP. Engines still starting count as live (they will be
  serving soon; counting them stops a retry from asking twice); draining engines do not (they are leaving).
* **Rejections change nothing.** Planners are pure functions; the registry checks before it mutates.
* **Cancel is sticky.** Once a scale-out is asked to cancel it ends CANCELLED whatever the shell reports
  next, and the engines it created that are not yet ACTIVE are the ones to roll back.

No Ray, no HTTP, no asyncio; the clock is injected.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from relax.config.flags import PartialSuccessPolicy
from relax.rollout.api_models import (
    DEFAULT_MODEL,
    RequestError,
    ScaleInBody,
    ScaleOutBody,
    normalize_engine_url,
    parse_body,
)
from relax.rollout.pool import EngineKind, EnginePool, EngineRecord, EngineState, engine_number

Clock = Callable[[], float]

__all__ = [
    "KNOWN_MODELS",
    "CancelBatchResult",
    "Direction",
    "EngineOutcome",
    "IllegalRequestTransition",
    "Noop",
    "NotCancellable",
    "PartialSuccessPolicy",
    "RejectedRequest",
    "Rejection",
    "ScaleConflict",
    "ScaleInPlan",
    "ScaleInRequest",
    "ScaleInStatus",
    "ScaleKind",
    "ScaleOutPlan",
    "ScaleOutRequest",
    "ScaleOutStatus",
    "ScalePlan",
    "ScaleRequest",
    "ScaleRequestRegistry",
    "ScalingError",
    "UnknownModel",
    "UnknownRequest",
    "Victim",
    "VictimOutcome",
    "check_model_name",
    "current_engine_count",
    "decide_partial_outcome",
    "engine_phase_timings",
    "plan_scale_in",
    "plan_scale_out",
]

KNOWN_MODELS: tuple[str, ...] = (DEFAULT_MODEL,)
"""Models a run serves. Relax trains one policy, so the REST ``model_name`` can only be ``default``."""


# -- errors ------------------------------------------------------------------------------------------


class ScalingError(RequestError):
    """Base of every scaling rule violation; ``http_status`` is what the route answers (400 by default)."""


class UnknownModel(ScalingError):
    """``model_name`` names a model this run does not serve (404)."""

    default_status = 404

    def __init__(self, model_name: str) -> None:
        known = ", ".join(repr(m) for m in KNOWN_MODELS)
        super().__init__(f"model_name: unknown model {model_name!r}; this run serves {known}", field="model_name")
        self.model_name = model_name


class RejectedRequest(ScalingError):
    """A well-formed request that the scaling rules refuse (below the initial count, URL not attached...)."""

    def __init__(self, message: str, *, field: str | None = None, http_status: int = 400, code: str = "rejected"):
        super().__init__(message, field=field, http_status=http_status)
        self.code = code


class ScaleConflict(ScalingError):
    """Another scale operation is running (409); carries its id so the client can poll or cancel it."""

    default_status = 409

    def __init__(self, running_request_id: str, running_status: str, direction: str) -> None:
        how = (
            f"cancel it with POST /rollout/scale_out/{running_request_id}/cancel"
            if direction == Direction.SCALE_OUT.value
            else "scale-in cannot be cancelled"
        )
        super().__init__(
            f"another scale operation is running: {running_request_id} ({direction}, {running_status}); "
            f"one scale operation runs at a time: wait for it to finish (GET /rollout/{direction}/"
            f"{running_request_id}) or {how}"
        )
        self.running_request_id = running_request_id
        self.running_status = running_status
        self.direction = direction

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "running_request_id": self.running_request_id}


class UnknownRequest(ScalingError):
    """No scale request with this id (never existed, other direction, or garbage-collected): 404."""

    default_status = 404

    def __init__(self, request_id: str, direction: str | None = None) -> None:
        where = f"{direction} " if direction else "scale "
        super().__init__(f"unknown {where}request id {request_id!r} (only the newest finished requests are kept)")
        self.request_id = request_id


class NotCancellable(ScalingError):
    """The request can no longer be cancelled (it finished), or is a scale-in (never cancellable): 400."""

    def __init__(self, request_id: str, status: str, reason: str | None = None) -> None:
        super().__init__(reason or f"request {request_id} is no longer cancellable: it already ended {status}")
        self.request_id = request_id
        self.status = status


class IllegalRequestTransition(ValueError):
    """The shell tried a status move the request state machine forbids: a bug, not a client error (500)."""

    def __init__(self, request_id: str, src: Enum, dst: Enum, why: str = "") -> None:
        super().__init__(f"{request_id}: illegal transition {src.value} -> {dst.value}" + (f" ({why})" if why else ""))
        self.request_id = request_id
        self.src = src
        self.dst = dst

    def __reduce__(self):
        return (type(self), (self.request_id, self.src, self.dst))


@dataclass(frozen=True)
class Rejection:
    """A planner's "no": the HTTP status, a machine-readable ``code``, the field to fix, and why.

    Planners return it instead of raising so that in-process callers (the autoscaler) can look at the
    reason without exception plumbing; :meth:`to_error` gives the typed exception a route raises.
    """

    http_status: int
    code: str
    field: str | None
    message: str
    value: Any = None  # the offending value, when one value is to blame

    def to_error(self) -> ScalingError:
        if self.code == "unknown_model":
            return UnknownModel(self.value)
        return RejectedRequest(self.message, field=self.field, http_status=self.http_status, code=self.code)


# -- states -------------------------------------------------------------------------------------------


class Direction(str, Enum):
    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"


class ScaleKind(str, Enum):
    """How a scale-out gets its engines."""

    RAY_NATIVE = "ray_native"  # Relax creates placement groups and EngineActors (num_replicas)
    EXTERNAL = "external"  # running servers are attached by URL (engine_urls)


class ScaleOutStatus(str, Enum):
    """Scale-out request states (DESIGN 4). The request is in the phase its most advanced engine reached."""

    PENDING = "PENDING"
    CREATING = "CREATING"  # ray_native: placement groups requested, engine actors starting
    CONNECTING = "CONNECTING"  # external: attaching the URLs
    HEALTH_CHECKING = "HEALTH_CHECKING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"
    ACTIVE = "ACTIVE"  # every engine joined the router
    PARTIAL = "PARTIAL"  # some engines joined, the others failed and were cleaned up (keep_partial)
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in _SO_TERMINAL

    def can_transition_to(self, target: ScaleOutStatus) -> bool:
        return ScaleOutStatus(target) in _SO_LEGAL[self]


_SO = ScaleOutStatus
_SO_TERMINAL = frozenset({_SO.ACTIVE, _SO.PARTIAL, _SO.FAILED, _SO.CANCELLED})
_SO_LEGAL: dict[ScaleOutStatus, frozenset[ScaleOutStatus]] = {
    _SO.PENDING: frozenset({_SO.CREATING, _SO.CONNECTING, _SO.FAILED, _SO.CANCELLED}),
    _SO.CREATING: frozenset({_SO.HEALTH_CHECKING, _SO.FAILED, _SO.CANCELLED}),
    _SO.CONNECTING: frozenset({_SO.HEALTH_CHECKING, _SO.FAILED, _SO.CANCELLED}),
    _SO.HEALTH_CHECKING: frozenset({_SO.WEIGHT_SYNCING, _SO.FAILED, _SO.CANCELLED}),
    # ACTIVE/PARTIAL need at least one engine that reached weight sync, i.e. the request did.
    _SO.WEIGHT_SYNCING: frozenset({_SO.ACTIVE, _SO.PARTIAL, _SO.FAILED, _SO.CANCELLED}),
    **{s: frozenset() for s in _SO_TERMINAL},
}
_SO_RANK = {_SO.PENDING: 0, _SO.CREATING: 1, _SO.CONNECTING: 1, _SO.HEALTH_CHECKING: 2, _SO.WEIGHT_SYNCING: 3}


class ScaleInStatus(str, Enum):
    """Scale-in request states (DESIGN 4)."""

    PENDING = "PENDING"
    DRAINING = "DRAINING"  # victims are out of the router; waiting for their in-flight requests
    REMOVING = "REMOVING"  # shutting engines down and removing their placement groups
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (ScaleInStatus.COMPLETED, ScaleInStatus.FAILED)

    def can_transition_to(self, target: ScaleInStatus) -> bool:
        return ScaleInStatus(target) in _SI_LEGAL[self]


_SI = ScaleInStatus
_SI_LEGAL: dict[ScaleInStatus, frozenset[ScaleInStatus]] = {
    _SI.PENDING: frozenset({_SI.DRAINING, _SI.FAILED}),
    _SI.DRAINING: frozenset({_SI.REMOVING, _SI.FAILED}),
    _SI.REMOVING: frozenset({_SI.COMPLETED, _SI.FAILED}),
    _SI.COMPLETED: frozenset(),
    _SI.FAILED: frozenset(),
}

# Engine states from which a scale-out rollback may remove an engine directly (never served, nothing to drain).
_ROLLBACK_STATES = frozenset(
    {EngineState.PENDING, EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING}
)
# How far an engine state carries its scale-out request (see ScaleOutStatus: the furthest engine decides).
_ENGINE_RANK = {
    EngineState.PENDING: 1,
    EngineState.STARTING: 1,
    EngineState.HEALTH_CHECKING: 2,
    EngineState.WEIGHT_SYNCING: 3,
    EngineState.ACTIVE: 3,
    EngineState.DRAINING: 3,
}


# -- counting and small rules ---------------------------------------------------------------------------


def current_engine_count(pool: EnginePool) -> int:
    """Engines an absolute target is compared with: live and not ``DRAINING``.

    Starting engines count so a retried scale-out does not ask twice; draining ones do not, because they
    will never serve again: counting them would leave a scale-out short and make a scale-in remove one
    engine too many once the drain finishes.
    """
    return sum(1 for r in pool.live() if r.state is not EngineState.DRAINING)


def check_model_name(model_name: str) -> None:
    """Raise :class:`UnknownModel` (404) unless ``model_name`` is served by this run (filters use it too)."""
    if model_name not in KNOWN_MODELS:
        raise UnknownModel(model_name)


def _model_rejection(model_name: str) -> Rejection | None:
    if model_name in KNOWN_MODELS:
        return None
    error = UnknownModel(model_name)
    return Rejection(error.http_status, "unknown_model", "model_name", error.message, value=model_name)


def _canonical(url: str) -> str:
    try:
        return normalize_engine_url(url)
    except ValueError:
        return url


def _live_by_url(pool: EnginePool) -> dict[str, EngineRecord]:
    """Live engines by canonical URL (the shell may have stored a URL in a slightly different spelling)."""
    out: dict[str, EngineRecord] = {}
    for record in pool.live():
        if record.url:
            out.setdefault(_canonical(record.url), record)
    return out


def _check_count(value: Any, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def engine_phase_timings(record: EngineRecord) -> dict[str, float | None]:
    """Seconds an engine spent in each start-up phase, read from its lifecycle timestamps (``None`` = not done).

    ``placement_wait_s`` (PENDING: waiting for the placement group, i.e. for the provisioner), ``start_s``
    (server process start), ``health_s``, ``weight_sync_s``, and ``total_s`` from request to ACTIVE. These
    are the raw numbers of the scale-out latency benchmark.
    """
    at = {state: record.entered_at(state) for state in _ROLLBACK_STATES | {EngineState.ACTIVE}}

    def span(start: EngineState, end: EngineState) -> float | None:
        a, b = at[start], at[end]
        return None if a is None or b is None else max(0.0, b - a)

    return {
        "placement_wait_s": span(EngineState.PENDING, EngineState.STARTING),
        "start_s": span(EngineState.STARTING, EngineState.HEALTH_CHECKING),
        "health_s": span(EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING),
        "weight_sync_s": span(EngineState.WEIGHT_SYNCING, EngineState.ACTIVE),
        "total_s": span(EngineState.PENDING, EngineState.ACTIVE),
    }


# -- plans --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Noop:
    """The target is already met: answer 200 ``{"status": "NOOP"}`` and change nothing."""

    direction: Direction
    model_name: str
    message: str
    current_engines: int
    target: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The REST answer (see ``api_models.ScaleNoop``)."""
        return {
            "status": "NOOP",
            "message": self.message,
            "model_name": self.model_name,
            "current_engines": self.current_engines,
            "target": self.target,
        }


@dataclass(frozen=True)
class ScaleOutPlan:
    """What an accepted scale-out will do: create ``to_create`` engines, or attach ``urls``."""

    model_name: str
    kind: ScaleKind
    engines_before: int
    to_create: int
    target: int | None = None  # ray_native only
    urls: tuple[str, ...] = ()  # external only: the canonical URLs not yet attached
    timeout_secs: float | None = None

    @property
    def engines_after(self) -> int:
        return self.engines_before + self.to_create


ScalePlan = ScaleOutPlan


@dataclass(frozen=True)
class Victim:
    """An engine a scale-in will remove, with what its drain will wait on."""

    engine_id: str
    url: str | None
    kind: EngineKind
    in_flight: int

    @classmethod
    def from_record(cls, record: EngineRecord) -> Victim:
        return cls(record.engine_id, record.url, record.kind, record.in_flight)

    def to_dict(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "url": self.url, "kind": self.kind.value, "in_flight": self.in_flight}


@dataclass(frozen=True)
class ScaleInPlan:
    """What an accepted scale-in will remove, newest engine first. ``dry_run`` plans are only shown."""

    model_name: str
    engines_before: int
    victims: tuple[Victim, ...]
    target: int | None = None
    urls: tuple[str, ...] = ()
    force: bool = False
    timeout_secs: float | None = None
    dry_run: bool = False

    @property
    def engines_after(self) -> int:
        return self.engines_before - len(self.victims)

    @property
    def victim_ids(self) -> list[str]:
        return [v.engine_id for v in self.victims]

    def to_dict(self) -> dict[str, Any]:
        """The dry-run answer (see ``api_models.ScaleInDryRun``)."""
        return {
            "status": "DRY_RUN",
            "dry_run": True,
            "model_name": self.model_name,
            "current_engines": self.engines_before,
            "target": self.target,
            "engines_after": self.engines_after,
            "victims": [v.to_dict() for v in self.victims],
            "force": self.force,
        }


def plan_scale_out(
    body: ScaleOutBody | Mapping[str, Any],
    pool: EnginePool,
    *,
    initial_count: int,
    max_engines: int | None = None,
    existing_urls: Iterable[str] = (),
) -> ScaleOutPlan | Noop | Rejection:
    """Decide what a scale-out request means against the pool now. Pure: reads the pool, changes nothing.

    * ``num_replicas`` (ray_native) is the absolute total wanted: create ``target - current`` engines, or
      NOOP when ``current >= target``. A target below ``initial_count`` is rejected rather than NOOP'd: it
      can only come from a client that thinks ``num_replicas`` is a number to add.
    * ``engine_urls`` (external) attaches the URLs not attached yet (canonical comparison), NOOP when all
      are. ``existing_urls`` adds URLs the shell is attaching or knows about outside the pool.
    * A result above ``max_engines`` (the autoscaler's upper bound, when configured) is rejected.

    A dict body is validated first (:class:`~relax.rollout.api_models.InvalidBody`, 422, on bad shape).
    """
    body = parse_body(ScaleOutBody, body)
    _check_count(initial_count, "initial_count")
    _check_count(max_engines, "max_engines", allow_none=True)
    rejection = _model_rejection(body.model_name)
    if rejection is not None:
        return rejection
    current = current_engine_count(pool)

    if body.engine_urls:
        attached = set(_live_by_url(pool)) | {_canonical(u) for u in existing_urls}
        new = tuple(u for u in body.engine_urls if u not in attached)
        if not new:
            return Noop(Direction.SCALE_OUT, body.model_name, "every URL in engine_urls is already attached", current)
        after = current + len(new)
        if max_engines is not None and after > max_engines:
            return Rejection(
                400,
                "above_max",
                "engine_urls",
                f"engine_urls: attaching {len(new)} engine(s) would make {after} engines, above "
                f"max_engines={max_engines}; attach at most {max(0, max_engines - current)}",
            )
        return ScaleOutPlan(
            body.model_name, ScaleKind.EXTERNAL, current, len(new), urls=new, timeout_secs=body.timeout_secs
        )

    target = body.num_replicas
    if target < initial_count:
        return Rejection(
            400,
            "below_initial",
            "num_replicas",
            f"num_replicas: {target} is below the initial engine count {initial_count}; num_replicas is the "
            f"absolute total of engines, not a number to add (there are {current} engines now; to add 2 of them, "
            f"send num_replicas={current + 2})",
        )
    if max_engines is not None and target > max_engines:
        return Rejection(
            400,
            "above_max",
            "num_replicas",
            f"num_replicas: {target} is above max_engines={max_engines}; ask for at most {max_engines}",
        )
    if target <= current:
        return Noop(
            Direction.SCALE_OUT, body.model_name, f"target {target} already met: {current} engines", current, target
        )
    return ScaleOutPlan(
        body.model_name, ScaleKind.RAY_NATIVE, current, target - current, target=target, timeout_secs=body.timeout_secs
    )


def plan_scale_in(
    body: ScaleInBody | Mapping[str, Any],
    pool: EnginePool,
    *,
    initial_count: int,
) -> ScaleInPlan | Noop | Rejection:
    """Decide what a scale-in request means against the pool now. Pure: reads the pool, changes nothing.

    * ``num_replicas`` is the absolute total wanted. Below ``initial_count`` → 400: initial engines sit
      on the stable node group and are never removed by scale-in. At or above the current count → NOOP.
      Victims are the newest ACTIVE elastic engines (LIFO: the last capacity added is the first the
      provisioner can reclaim); if there are not enough of them (external engines are not picked by
      count) → 400 saying to name the external engines by URL.
    * ``engine_urls`` names the victims: each must be attached, not initial, and ACTIVE; otherwise 400
      naming every bad URL. An engine already DRAINING is skipped (it is leaving anyway), so a retry is a
      NOOP.
    * ``dry_run`` returns the same plan marked dry; the registry never registers it.
    """
    body = parse_body(ScaleInBody, body)
    _check_count(initial_count, "initial_count")
    rejection = _model_rejection(body.model_name)
    if rejection is not None:
        return rejection
    current = current_engine_count(pool)

    def plan(victims: Iterable[EngineRecord], target: int | None) -> ScaleInPlan:
        return ScaleInPlan(
            body.model_name,
            current,
            tuple(Victim.from_record(r) for r in victims),
            target=target,
            urls=tuple(body.engine_urls),
            force=body.force,
            timeout_secs=body.timeout_secs,
            dry_run=body.dry_run,
        )

    if body.engine_urls:
        by_url = _live_by_url(pool)
        problems: list[str] = []
        victims: list[EngineRecord] = []
        for url in body.engine_urls:
            record = by_url.get(url)
            if record is None:
                problems.append(f"{url} is not attached to any live engine")
            elif record.kind is EngineKind.INITIAL:
                problems.append(f"{url} is initial engine {record.engine_id}, which scale-in never removes")
            elif record.state is EngineState.DRAINING:
                continue
            elif record.state is not EngineState.ACTIVE:
                problems.append(
                    f"{url} ({record.engine_id}) is {record.state.value}, not ACTIVE; "
                    "cancel the scale-out that is starting it instead"
                )
            else:
                victims.append(record)
        if problems:
            return Rejection(400, "bad_url", "engine_urls", "engine_urls: " + "; ".join(problems))
        if not victims:
            return Noop(Direction.SCALE_IN, body.model_name, "every engine in engine_urls is already draining", current)
        return plan(sorted(victims, key=lambda r: r.number, reverse=True), None)

    target = body.num_replicas
    if target < initial_count:
        return Rejection(
            400,
            "below_initial",
            "num_replicas",
            f"num_replicas: {target} is below the initial engine count {initial_count}; initial engines are never "
            f"removed by scale-in, so the smallest target is {initial_count}",
        )
    if target >= current:
        return Noop(
            Direction.SCALE_IN, body.model_name, f"target {target} already met: {current} engines", current, target
        )
    need = current - target
    victims = pool.elastic_victims(need)
    if len(victims) < need:
        return Rejection(
            400,
            "not_enough_victims",
            "num_replicas",
            f"num_replicas: scaling in to {target} needs {need} engine(s) removed but only {len(victims)} ACTIVE "
            "elastic engine(s) can be picked by count; remove external engines by engine_urls",
        )
    return plan(victims, target)


# -- request records --------------------------------------------------------------------------------------


@dataclass
class EngineOutcome:
    """One engine of a scale-out request: last known lifecycle state, error, and phase timings."""

    engine_id: str
    url: str | None = None
    state: EngineState | None = None
    error: str | None = None
    timings: dict[str, float | None] = field(default_factory=dict)

    def update_from(self, record: EngineRecord) -> None:
        self.url = record.url or self.url
        self.state = record.state
        self.error = record.last_error or self.error
        self.timings = engine_phase_timings(record)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine_id": self.engine_id,
            "url": self.url,
            "state": self.state.value if self.state else None,
            "error": self.error,
        }
        for key in ("placement_wait_s", "start_s", "health_s", "weight_sync_s", "total_s"):
            out[key] = self.timings.get(key)
        return out


class _Lifecycle:
    """Status bookkeeping shared by both request kinds (``status``, ``transitions``, ``clock``)."""

    status: Any
    transitions: list[tuple[Any, float]]
    created_at: float
    request_id: str
    clock: Clock

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @property
    def finished_at(self) -> float | None:
        return self.transitions[-1][1] if self.terminal and self.transitions else None

    def _enter(self, status: Any) -> None:
        self.status = status
        self.transitions.append((status, self.clock()))

    def _in_status_s(self) -> dict[str, float]:
        """Seconds spent in each status passed through (the current one counts up to now while running)."""
        out: dict[str, float] = {}
        stamps = self.transitions
        for (status, start), (_, end) in itertools.pairwise(stamps):
            out[status.value] = out.get(status.value, 0.0) + max(0.0, end - start)
        if stamps and not self.terminal:
            status, start = stamps[-1]
            out[status.value] = out.get(status.value, 0.0) + max(0.0, self.clock() - start)
        return out

    def deadline(self, default_timeout_secs: float) -> float:
        """When the shell gives up: the request's own ``timeout_secs`` or the flag's default, from creation."""
        timeout = getattr(self, "timeout_secs", None)
        return self.created_at + (timeout if timeout is not None else default_timeout_secs)

    def _total_s(self) -> float | None:
        end = self.finished_at
        return None if end is None else max(0.0, end - self.created_at)


@dataclass(kw_only=True)
class ScaleOutRequest(_Lifecycle):
    """The record of one scale-out, as ``GET /rollout/scale_out/{id}`` shows it.

    The shell reports progress with :meth:`add_engine` (an engine was created / attached for this request),
    :meth:`observe` (refresh per-engine states and timings from the pool; the request status follows its
    most advanced engine), and :meth:`advance` (explicit moves, the terminal one included).
    """

    direction: ClassVar[Direction] = Direction.SCALE_OUT

    request_id: str
    model_name: str
    kind: ScaleKind
    created_at: float
    seq: int = 0
    target: int | None = None
    urls: tuple[str, ...] = ()
    engines_before: int = 0
    to_create: int = 0
    timeout_secs: float | None = None
    status: ScaleOutStatus = ScaleOutStatus.PENDING
    error: str | None = None
    cancel_requested: bool = False
    cancel_requested_at: float | None = None
    engines: dict[str, EngineOutcome] = field(default_factory=dict)
    transitions: list[tuple[ScaleOutStatus, float]] = field(default_factory=list)
    clock: Clock = field(default=time.time, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.transitions:
            self.transitions.append((self.status, self.created_at))

    @classmethod
    def from_plan(
        cls, plan: ScaleOutPlan, request_id: str, *, seq: int = 0, clock: Clock = time.time
    ) -> ScaleOutRequest:
        return cls(
            request_id=request_id,
            model_name=plan.model_name,
            kind=plan.kind,
            created_at=clock(),
            seq=seq,
            target=plan.target,
            urls=plan.urls,
            engines_before=plan.engines_before,
            to_create=plan.to_create,
            timeout_secs=plan.timeout_secs,
            clock=clock,
        )

    @property
    def engine_ids(self) -> list[str]:
        return list(self.engines)

    def add_engine(self, engine_id: str, url: str | None = None) -> EngineOutcome:
        """Record that ``engine_id`` was created (or attached) for this request; moves PENDING to CREATING
        (ray_native) or CONNECTING (external). Idempotent per engine."""
        engine_number(engine_id)
        if self.terminal:
            raise IllegalRequestTransition(self.request_id, self.status, self.status, "request already finished")
        outcome = self.engines.get(engine_id)
        if outcome is None:
            outcome = self.engines[engine_id] = EngineOutcome(engine_id, url=url, state=EngineState.PENDING)
        elif url is not None:
            outcome.url = url
        if self.status is ScaleOutStatus.PENDING:
            self._enter(self._first_phase)
        return outcome

    @property
    def _first_phase(self) -> ScaleOutStatus:
        return ScaleOutStatus.CREATING if self.kind is ScaleKind.RAY_NATIVE else ScaleOutStatus.CONNECTING

    def observe(self, pool: EnginePool) -> ScaleOutStatus:
        """Refresh engine outcomes from the pool and move the status up to the furthest phase any engine
        reached. Never ends the request (that is the shell's decision, see :func:`decide_partial_outcome`);
        after the end it still refreshes outcomes, e.g. to show rolled-back engines as REMOVED."""
        rank = 0
        for engine_id, outcome in self.engines.items():
            if engine_id in pool:
                record = pool.get(engine_id)
                outcome.update_from(record)
                rank = max([rank, *(_ENGINE_RANK.get(state, 0) for state, _ in record.transitions)])
        if not self.terminal:
            chain = [self._first_phase, ScaleOutStatus.HEALTH_CHECKING, ScaleOutStatus.WEIGHT_SYNCING]
            for status in chain[: max(0, rank)]:
                if _SO_RANK[status] > _SO_RANK[self.status]:
                    self._enter(status)
        return self.status

    def advance(self, status: ScaleOutStatus | str, error: str | None = None) -> ScaleOutStatus:
        """Move to ``status`` (same status: no-op). Once cancel was requested, any end is CANCELLED.

        Raises :class:`IllegalRequestTransition` for a move the state machine forbids, or CREATING for an
        external request / CONNECTING for a ray_native one.
        """
        status = ScaleOutStatus(status)
        if status is self.status and not self.terminal:
            return self.status
        if self.terminal or not self.status.can_transition_to(status):
            raise IllegalRequestTransition(self.request_id, self.status, status)
        if status in (ScaleOutStatus.CREATING, ScaleOutStatus.CONNECTING) and status is not self._first_phase:
            raise IllegalRequestTransition(self.request_id, self.status, status, f"a {self.kind.value} request")
        if status.terminal and self.cancel_requested:
            status = ScaleOutStatus.CANCELLED  # sticky: whatever the shell saw last, the user asked to stop
        if error is not None:
            self.error = error
        elif status is ScaleOutStatus.FAILED and self.error is None:
            self.error = "scale-out failed"
        self._enter(status)
        return self.status

    def fail(self, error: str) -> ScaleOutStatus:
        return self.advance(ScaleOutStatus.FAILED, error)

    def request_cancel(self) -> bool:
        """Ask this request to stop; returns True the first time. Raises :class:`NotCancellable` once it ended.

        Only sets the sticky flag: the shell sees it at its next step, rolls back
        :meth:`rollback_candidates` and advances to CANCELLED (any other end is turned into CANCELLED).
        """
        if self.terminal:
            raise NotCancellable(self.request_id, self.status.value)
        if self.cancel_requested:
            return False
        self.cancel_requested = True
        self.cancel_requested_at = self.clock()
        return True

    def rollback_candidates(self, pool: EnginePool) -> list[EngineRecord]:
        """Engines this request created that never became ACTIVE and are still live: the ones a cancel (or
        a ``rollback_all`` failure) removes directly. ACTIVE engines are kept: they serve, and only a
        scale-in (with a real drain) may take them out."""
        out = []
        for engine_id in self.engines:
            if engine_id in pool:
                record = pool.get(engine_id)
                if record.state in _ROLLBACK_STATES:
                    out.append(record)
        return sorted(out, key=lambda r: r.number)

    def timings(self) -> dict[str, Any]:
        """Request totals: end-to-end ``total_s``, seconds per status, and per phase the slowest engine
        (engines start in parallel, so the slowest one is the phase's share of the end-to-end latency)."""
        out: dict[str, Any] = {"total_s": self._total_s(), "in_status_s": self._in_status_s()}
        for key in ("placement_wait_s", "start_s", "health_s", "weight_sync_s"):
            values = [o.timings[key] for o in self.engines.values() if o.timings.get(key) is not None]
            out[key] = max(values) if values else None
        return out

    def to_dict(self) -> dict[str, Any]:
        """The REST record (see ``api_models.ScaleOutRequestView``)."""
        return {
            "request_id": self.request_id,
            "direction": self.direction.value,
            "model_name": self.model_name,
            "kind": self.kind.value,
            "status": self.status.value,
            "target": self.target,
            "urls": list(self.urls),
            "engines_before": self.engines_before,
            "to_create": self.to_create,
            "timeout_secs": self.timeout_secs,
            "engine_ids": self.engine_ids,
            "engines": [o.to_dict() for o in self.engines.values()],
            "error": self.error,
            "cancel_requested": self.cancel_requested,
            "cancel_requested_at": self.cancel_requested_at,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "transitions": [{"status": s.value, "at": at} for s, at in self.transitions],
            "timings": self.timings(),
        }


@dataclass
class VictimOutcome:
    """One engine of a scale-in: where its removal got to, how long the drain and the shutdown took."""

    engine_id: str
    url: str | None
    kind: EngineKind
    state: EngineState | None = None
    error: str | None = None
    aborted_requests: int = 0  # left in flight at the drain timeout (or at once with force): retried elsewhere
    drain_started_at: float | None = None
    drained_at: float | None = None
    removed_at: float | None = None

    @property
    def drain_s(self) -> float | None:
        if self.drain_started_at is None or self.drained_at is None:
            return None
        return max(0.0, self.drained_at - self.drain_started_at)

    @property
    def shutdown_s(self) -> float | None:
        if self.drained_at is None or self.removed_at is None:
            return None
        return max(0.0, self.removed_at - self.drained_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "url": self.url,
            "kind": self.kind.value,
            "state": self.state.value if self.state else None,
            "error": self.error,
            "aborted_requests": self.aborted_requests,
            "drain_s": self.drain_s,
            "shutdown_s": self.shutdown_s,
        }


@dataclass(kw_only=True)
class ScaleInRequest(_Lifecycle):
    """The record of one scale-in, as ``GET /rollout/scale_in/{id}`` shows it. Scale-in is not cancellable:
    a half-drained engine is already out of the router, and putting it back would race the drain."""

    direction: ClassVar[Direction] = Direction.SCALE_IN

    request_id: str
    model_name: str
    created_at: float
    seq: int = 0
    target: int | None = None
    urls: tuple[str, ...] = ()
    engines_before: int = 0
    force: bool = False
    timeout_secs: float | None = None
    status: ScaleInStatus = ScaleInStatus.PENDING
    error: str | None = None
    victims: dict[str, VictimOutcome] = field(default_factory=dict)
    transitions: list[tuple[ScaleInStatus, float]] = field(default_factory=list)
    clock: Clock = field(default=time.time, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.transitions:
            self.transitions.append((self.status, self.created_at))

    @classmethod
    def from_plan(cls, plan: ScaleInPlan, request_id: str, *, seq: int = 0, clock: Clock = time.time) -> ScaleInRequest:
        if plan.dry_run:
            raise ValueError("a dry-run scale-in plan is only shown, never registered")
        return cls(
            request_id=request_id,
            model_name=plan.model_name,
            created_at=clock(),
            seq=seq,
            target=plan.target,
            urls=plan.urls,
            engines_before=plan.engines_before,
            force=plan.force,
            timeout_secs=plan.timeout_secs,
            victims={v.engine_id: VictimOutcome(v.engine_id, v.url, v.kind) for v in plan.victims},
            clock=clock,
        )

    @property
    def victim_ids(self) -> list[str]:
        return list(self.victims)

    def advance(self, status: ScaleInStatus | str, error: str | None = None) -> ScaleInStatus:
        """Move to ``status`` (same status: no-op); raises :class:`IllegalRequestTransition` otherwise."""
        status = ScaleInStatus(status)
        if status is self.status and not self.terminal:
            return self.status
        if not self.status.can_transition_to(status):
            raise IllegalRequestTransition(self.request_id, self.status, status)
        if error is not None:
            self.error = error
        elif status is ScaleInStatus.FAILED and self.error is None:
            self.error = "scale-in failed"
        self._enter(status)
        return self.status

    def fail(self, error: str) -> ScaleInStatus:
        return self.advance(ScaleInStatus.FAILED, error)

    def note_drained(self, engine_id: str, *, aborted_requests: int = 0) -> None:
        """The victim's in-flight count reached zero, or the drain timed out with ``aborted_requests`` left."""
        _check_count(aborted_requests, "aborted_requests")
        victim = self._victim(engine_id)
        victim.drained_at = self.clock()
        victim.aborted_requests = aborted_requests

    def note_error(self, engine_id: str, error: str) -> None:
        self._victim(engine_id).error = error

    def _victim(self, engine_id: str) -> VictimOutcome:
        try:
            return self.victims[engine_id]
        except KeyError:
            raise KeyError(f"{engine_id} is not a victim of {self.request_id}") from None

    def observe(self, pool: EnginePool) -> ScaleInStatus:
        """Refresh victim states and drain/removal timestamps from the pool."""
        for engine_id, victim in self.victims.items():
            if engine_id not in pool:
                continue
            record = pool.get(engine_id)
            victim.state = record.state
            victim.error = record.last_error or victim.error
            victim.drain_started_at = record.entered_at(EngineState.DRAINING)
            removed = record.entered_at(EngineState.REMOVED)
            victim.removed_at = removed if removed is not None else record.entered_at(EngineState.FAILED)
        return self.status

    def to_dict(self) -> dict[str, Any]:
        """The REST record (see ``api_models.ScaleInRequestView``)."""
        return {
            "request_id": self.request_id,
            "direction": self.direction.value,
            "model_name": self.model_name,
            "status": self.status.value,
            "target": self.target,
            "urls": list(self.urls),
            "engines_before": self.engines_before,
            "force": self.force,
            "timeout_secs": self.timeout_secs,
            "victims": [v.to_dict() for v in self.victims.values()],
            "error": self.error,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "transitions": [{"status": s.value, "at": at} for s, at in self.transitions],
            "timings": {"total_s": self._total_s(), "in_status_s": self._in_status_s()},
        }


ScaleRequest = ScaleOutRequest | ScaleInRequest


# -- partial outcomes ---------------------------------------------------------------------------------


def decide_partial_outcome(
    results: Mapping[str, bool | EngineState | str],
    policy: PartialSuccessPolicy | str = PartialSuccessPolicy.ROLLBACK_ALL,
) -> tuple[ScaleOutStatus, list[str]]:
    """How a scale-out ends once every engine came up or gave up (``--scale-out-partial-success-policy``).

    ``results`` maps engine id to whether it came up (``True`` or ``EngineState.ACTIVE``). Returns the final
    status and the engines the shell must tear down, by engine number: everything not kept, failed ones
    included (their placement groups and processes still need cleaning). All up → ACTIVE, nothing to tear
    down. None up → FAILED. Some up: ``rollback_all`` → FAILED and tear down all (a half-done target is
    not what was asked, and the autoscaler will ask again); ``keep_partial`` → PARTIAL, tear down the failed.
    Tearing down an ACTIVE engine goes through a drain like any scale-in.
    """
    if not results:
        raise ValueError("decide_partial_outcome needs the result of at least one engine")
    policy = PartialSuccessPolicy(policy)
    up = {engine_id for engine_id, result in results.items() if _came_up(result)}
    down = [e for e in results if e not in up]
    everything = sorted(results, key=engine_number)
    if not down:
        return ScaleOutStatus.ACTIVE, []
    if not up or policy is PartialSuccessPolicy.ROLLBACK_ALL:
        return ScaleOutStatus.FAILED, everything
    return ScaleOutStatus.PARTIAL, sorted(down, key=engine_number)


def _came_up(result: bool | EngineState | str) -> bool:
    if isinstance(result, bool):
        return result
    return EngineState(result) is EngineState.ACTIVE


# -- registry -------------------------------------------------------------------------------------------


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
    """Status names, case-insensitive; an unknown one is a 400 naming the field and the allowed names."""
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
        """Raise :class:`ScaleConflict` (409, with the running id) when a scale operation is in progress."""
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
        body: ScaleOutBody | Mapping[str, Any],
        pool: EnginePool,
        *,
        initial_count: int,
        max_engines: int | None = None,
        existing_urls: Iterable[str] = (),
    ) -> ScaleOutRequest | Noop:
        """The ``POST /rollout/scale_out`` entry point (REST and autoscaler alike).

        Order of answers: bad shape (422) and rule violations (4xx) first, since they are wrong whatever
        runs; then 409 if another operation runs; then NOOP or a new PENDING request.
        """
        outcome = plan_scale_out(
            body, pool, initial_count=initial_count, max_engines=max_engines, existing_urls=existing_urls
        )
        if isinstance(outcome, Rejection):
            raise outcome.to_error()
        self.ensure_idle()
        if isinstance(outcome, Noop):
            return outcome
        return self.create(outcome)  # type: ignore[return-value]

    def submit_scale_in(
        self, body: ScaleInBody | Mapping[str, Any], pool: EnginePool, *, initial_count: int
    ) -> ScaleInRequest | Noop | ScaleInPlan:
        """The ``POST /rollout/scale_in`` entry point; a dry run returns the plan and may run while another
        operation is in progress (it changes nothing)."""
        outcome = plan_scale_in(body, pool, initial_count=initial_count)
        if isinstance(outcome, Rejection):
            raise outcome.to_error()
        if isinstance(outcome, ScaleInPlan) and outcome.dry_run:
            return outcome
        self.ensure_idle()
        if isinstance(outcome, Noop):
            return outcome
        return self.create(outcome)  # type: ignore[return-value]

    # -- lookup -------------------------------------------------------------------------------------

    def get(self, request_id: str, direction: Direction | str | None = None) -> ScaleRequest:
        """The request with this id; :class:`UnknownRequest` (404) if unknown or of the other direction."""
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
        """Requests newest first, filtered by direction, status name(s) and model (unknown ones: 400 / 404).

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
        """Set the sticky cancel flag of a running scale-out; 404 unknown id, 400 finished or scale-in."""
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
        what would be cancelled. An unknown status name is a 400 naming ``status_filter`` (nothing changed).
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
