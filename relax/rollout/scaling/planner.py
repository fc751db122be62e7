"""What a scale request means against the pool right now: specs in, plans (or a reasoned "no") out.

(docs/architecture.md, "Scale requests".) A spec (:class:`ScaleOutSpec`, :class:`ScaleInSpec`) is a request
whose shape was already validated (by the REST layer's bodies, or built directly by an in-process caller).
The planners are pure: they read the pool and change nothing. Two rules shape them:

* ``num_replicas`` is an **absolute target** of live engines, never a delta, so a retried request is
  harmless: once the target is met the answer is NOOP. Engines still starting count as live (they will be
  serving soon; counting them stops a retry from asking twice); draining engines do not (they are leaving).
* **Rejections change nothing.** A planner answers :class:`Rejection` instead of raising, so in-process
  callers can look at the reason; :meth:`Rejection.to_error` gives the typed error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from relax.config.flags import PartialSuccessPolicy
from relax.rollout.pool.engine_url import normalize_engine_url
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineRecord, EngineState, engine_number
from relax.rollout.scaling.errors import RejectedRequest, ScalingError, UnknownModel
from relax.rollout.scaling.states import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ROLLBACK_STATES,
    Direction,
    ScaleKind,
    ScaleOutStatus,
    current_engine_count,
)

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "Noop",
    "Rejection",
    "ScaleInPlan",
    "ScaleInSpec",
    "ScaleOutPlan",
    "ScaleOutSpec",
    "ScalePlan",
    "Victim",
    "check_model_name",
    "decide_partial_outcome",
    "engine_phase_timings",
    "plan_scale_in",
    "plan_scale_out",
]

# -- specs --------------------------------------------------------------------------------------------


def _check_count(value: Any, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _check_target(spec: ScaleOutSpec | ScaleInSpec) -> None:
    """Cheap structural checks shared by both specs: one target, a sane count, URLs as a tuple, seconds as float."""
    if isinstance(spec.engine_urls, str):
        raise ValueError("engine_urls must be a sequence of URLs, not one string")
    object.__setattr__(spec, "engine_urls", tuple(spec.engine_urls))
    _check_count(spec.num_replicas, "num_replicas", allow_none=True)
    if spec.num_replicas is not None and spec.engine_urls:
        raise ValueError("give either num_replicas (an absolute target) or engine_urls, not both")
    if spec.num_replicas is None and not spec.engine_urls:
        raise ValueError("give num_replicas (an absolute target) or engine_urls")
    if spec.timeout_secs is not None:
        if isinstance(spec.timeout_secs, bool) or not isinstance(spec.timeout_secs, int | float):
            raise ValueError(f"timeout_secs must be a number of seconds, got {spec.timeout_secs!r}")
        object.__setattr__(spec, "timeout_secs", float(spec.timeout_secs))


@dataclass(frozen=True)
class ScaleOutSpec:
    """A validated scale-out request: grow to ``num_replicas`` engines, or attach ``engine_urls``."""

    num_replicas: int | None = None
    engine_urls: tuple[str, ...] = ()
    model_name: str = DEFAULT_MODEL
    timeout_secs: float | None = None

    def __post_init__(self) -> None:
        _check_target(self)


@dataclass(frozen=True)
class ScaleInSpec:
    """A validated scale-in request: shrink to ``num_replicas`` engines, or remove ``engine_urls``."""

    num_replicas: int | None = None
    engine_urls: tuple[str, ...] = ()
    model_name: str = DEFAULT_MODEL
    force: bool = False
    timeout_secs: float | None = None
    dry_run: bool = False

    def __post_init__(self) -> None:
        _check_target(self)


# -- answers ------------------------------------------------------------------------------------------


#: Rejections that describe the pool's current state rather than the request: too few ACTIVE elastic engines
#: to pick by count (a scale-out's engines still starting are not ACTIVE yet).
POOL_STATE_CODES = frozenset({"not_enough_victims"})


@dataclass(frozen=True)
class Rejection:
    """A planner's "no": a machine-readable ``code``, the field to fix, and why.

    Planners return it instead of raising so that in-process callers (the autoscaler) can look at the
    reason without exception plumbing; :meth:`to_error` gives the typed exception a route raises.
    """

    code: str
    field: str | None
    message: str
    value: Any = None  # the offending value, when one value is to blame

    @property
    def depends_on_pool(self) -> bool:
        """A "no" about the pool as it is this moment, not about the request: while another scale operation
        changes the pool, that operation is the answer (409, ask again), not this (400, fix the request)."""
        return self.code in POOL_STATE_CODES

    def to_error(self) -> ScalingError:
        if self.code == "unknown_model":
            return UnknownModel(self.value)
        return RejectedRequest(self.message, field=self.field, code=self.code)


@dataclass(frozen=True)
class Noop:
    """The target is already met: answer ``{"status": "NOOP"}`` and change nothing."""

    direction: Direction
    model_name: str
    message: str
    current_engines: int
    target: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The REST answer (schema: ``ScaleNoop``)."""
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
        """The dry-run answer (schema: ``ScaleInDryRun``)."""
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


# -- small rules ------------------------------------------------------------------------------------------


def check_model_name(model_name: str) -> None:
    """Raise :class:`UnknownModel` unless ``model_name`` is served by this run (filters use it too)."""
    if model_name not in KNOWN_MODELS:
        raise UnknownModel(model_name, KNOWN_MODELS)


def _model_rejection(model_name: str) -> Rejection | None:
    if model_name in KNOWN_MODELS:
        return None
    error = UnknownModel(model_name, KNOWN_MODELS)
    return Rejection("unknown_model", "model_name", error.message, value=model_name)


def _canonical(url: str) -> str:
    try:
        return normalize_engine_url(url)
    except ValueError:
        return url


def _canonical_urls(urls: Iterable[str]) -> tuple[str, ...]:
    """Canonical spellings, first occurrence of each kept, in the order given."""
    return tuple(dict.fromkeys(_canonical(u) for u in urls))


def _live_by_url(pool: EnginePool) -> dict[str, EngineRecord]:
    """Live engines by canonical URL (the shell may have stored a URL in a slightly different spelling)."""
    out: dict[str, EngineRecord] = {}
    for record in pool.live():
        if record.url:
            out.setdefault(_canonical(record.url), record)
    return out


def engine_phase_timings(record: EngineRecord) -> dict[str, float | None]:
    """Seconds an engine spent in each start-up phase, read from its lifecycle timestamps (``None`` = not done).

    ``placement_wait_s`` (PENDING: waiting for the placement group, i.e. for the provisioner), ``start_s``
    (server process start), ``health_s``, ``weight_sync_s``, and ``total_s`` from request to ACTIVE. These
    are the raw numbers of the scale-out latency benchmark.
    """
    at = {state: record.entered_at(state) for state in ROLLBACK_STATES | {EngineState.ACTIVE}}

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


# -- planners -----------------------------------------------------------------------------------------


def _require(spec: object, cls: type) -> None:
    if not isinstance(spec, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(spec).__name__} (validate REST bodies with to_spec())")


def plan_scale_out(
    spec: ScaleOutSpec,
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
    """
    _require(spec, ScaleOutSpec)
    _check_count(initial_count, "initial_count")
    _check_count(max_engines, "max_engines", allow_none=True)
    rejection = _model_rejection(spec.model_name)
    if rejection is not None:
        return rejection
    current = current_engine_count(pool)

    if spec.engine_urls:
        attached = set(_live_by_url(pool)) | {_canonical(u) for u in existing_urls}
        new = tuple(u for u in _canonical_urls(spec.engine_urls) if u not in attached)
        if not new:
            return Noop(Direction.SCALE_OUT, spec.model_name, "every URL in engine_urls is already attached", current)
        after = current + len(new)
        if max_engines is not None and after > max_engines:
            return Rejection(
                "above_max",
                "engine_urls",
                f"engine_urls: attaching {len(new)} engine(s) would make {after} engines, above "
                f"max_engines={max_engines}; attach at most {max(0, max_engines - current)}",
            )
        return ScaleOutPlan(
            spec.model_name, ScaleKind.EXTERNAL, current, len(new), urls=new, timeout_secs=spec.timeout_secs
        )

    target = spec.num_replicas
    assert target is not None  # the spec guarantees one target
    if target < initial_count:
        return Rejection(
            "below_initial",
            "num_replicas",
            f"num_replicas: {target} is below the initial engine count {initial_count}; num_replicas is the "
            f"absolute total of engines, not a number to add (there are {current} engines now; to add 2 of them, "
            f"send num_replicas={current + 2})",
            value=target,
        )
    if max_engines is not None and target > max_engines:
        return Rejection(
            "above_max",
            "num_replicas",
            f"num_replicas: {target} is above max_engines={max_engines}; ask for at most {max_engines}",
            value=target,
        )
    if target <= current:
        return Noop(
            Direction.SCALE_OUT, spec.model_name, f"target {target} already met: {current} engines", current, target
        )
    return ScaleOutPlan(
        spec.model_name, ScaleKind.RAY_NATIVE, current, target - current, target=target, timeout_secs=spec.timeout_secs
    )


def plan_scale_in(spec: ScaleInSpec, pool: EnginePool, *, initial_count: int) -> ScaleInPlan | Noop | Rejection:
    """Decide what a scale-in request means against the pool now. Pure: reads the pool, changes nothing.

    * ``num_replicas`` is the absolute total wanted. Below ``initial_count`` → rejected: initial engines sit
      on the stable node group and are never removed by scale-in. At or above the current count → NOOP.
      Victims are the newest ACTIVE elastic engines (LIFO: the last capacity added is the first the
      provisioner can reclaim); if there are not enough of them (external engines are not picked by
      count) → rejected, saying to name the external engines by URL.
    * ``engine_urls`` names the victims: each must be attached, not initial, and ACTIVE; otherwise rejected
      naming every bad URL. An engine already DRAINING is skipped (it is leaving anyway), so a retry is a
      NOOP.
    * ``dry_run`` returns the same plan marked dry; the registry never registers it.
    """
    _require(spec, ScaleInSpec)
    _check_count(initial_count, "initial_count")
    rejection = _model_rejection(spec.model_name)
    if rejection is not None:
        return rejection
    current = current_engine_count(pool)
    urls = _canonical_urls(spec.engine_urls)

    def plan(victims: Iterable[EngineRecord], target: int | None) -> ScaleInPlan:
        return ScaleInPlan(
            spec.model_name,
            current,
            tuple(Victim.from_record(r) for r in victims),
            target=target,
            urls=urls,
            force=spec.force,
            timeout_secs=spec.timeout_secs,
            dry_run=spec.dry_run,
        )

    if urls:
        by_url = _live_by_url(pool)
        problems: list[str] = []
        victims: list[EngineRecord] = []
        for url in urls:
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
            return Rejection("bad_url", "engine_urls", "engine_urls: " + "; ".join(problems))
        if not victims:
            return Noop(Direction.SCALE_IN, spec.model_name, "every engine in engine_urls is already draining", current)
        return plan(sorted(victims, key=lambda r: r.number, reverse=True), None)

    target = spec.num_replicas
    assert target is not None  # the spec guarantees one target
    if target < initial_count:
        return Rejection(
            "below_initial",
            "num_replicas",
            f"num_replicas: {target} is below the initial engine count {initial_count}; initial engines are never "
            f"removed by scale-in, so the smallest target is {initial_count}",
            value=target,
        )
    if target >= current:
        return Noop(
            Direction.SCALE_IN, spec.model_name, f"target {target} already met: {current} engines", current, target
        )
    need = current - target
    victims = pool.elastic_victims(need)
    if len(victims) < need:
        return Rejection(
            "not_enough_victims",
            "num_replicas",
            f"num_replicas: scaling in to {target} needs {need} engine(s) removed but only {len(victims)} ACTIVE "
            "elastic engine(s) can be picked by count; remove external engines by engine_urls",
            value=target,
        )
    return plan(victims, target)


# -- partial outcomes ---------------------------------------------------------------------------------


def decide_partial_outcome(
    results: Mapping[str, bool | EngineState | str],
    policy: PartialSuccessPolicy | str = PartialSuccessPolicy.ROLLBACK_ALL,
    *,
    cancelled: bool = False,
) -> tuple[ScaleOutStatus, list[str]]:
    """How a scale-out ends once every engine came up or gave up (``--scale-out-partial-success-policy``).

    ``results`` maps engine id to whether it came up (``True`` or ``EngineState.ACTIVE``). Returns the final
    status and the engines the shell must tear down, by engine number: everything not kept, failed ones
    included (their placement groups and processes still need cleaning). All up → ACTIVE, nothing to tear
    down. None up → FAILED. Some up: ``rollback_all`` → FAILED and tear down all (a half-done target is
    not what was asked, and the autoscaler will ask again); ``keep_partial`` → PARTIAL, tear down the failed.
    Tearing down an ACTIVE engine goes through a drain like any scale-in. A ``cancelled`` request (the flag is
    sticky) ends CANCELLED whatever the policy: the engines that did not come up go, the ACTIVE ones stay (only a
    scale-in drains a serving engine).
    """
    if not results:
        raise ValueError("decide_partial_outcome needs the result of at least one engine")
    policy = PartialSuccessPolicy(policy)
    up = {engine_id for engine_id, result in results.items() if _came_up(result)}
    down = [e for e in results if e not in up]
    if cancelled:
        return ScaleOutStatus.CANCELLED, sorted(down, key=engine_number)
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
