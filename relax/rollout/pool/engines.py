"""The engine pool: who exists, in which lifecycle state, since when (docs/architecture.md, "Engine lifecycle").

This is the pure bookkeeping core the RolloutManager actor drives. It knows nothing about Ray, HTTP or
asyncio; the shell tells it what happened (``transition``, ``set_url``, ``set_weight_version``...) and
asks it questions (``routable``, ``elastic_victims``, ``counts``...). Keeping the state machine here makes
every lifecycle rule testable in milliseconds and makes illegal moves loud instead of silent.

Lifecycle::

    PENDING ─► STARTING ─► HEALTH_CHECKING ─► WEIGHT_SYNCING ─► ACTIVE ─► DRAINING ─► REMOVED
       │           │              │                 │              │          │
       └───────────┴──────────────┴─────────────────┴──────────────┴──────────┴─► FAILED

plus ``PENDING | STARTING | HEALTH_CHECKING | WEIGHT_SYNCING ─► REMOVED`` for the rollback of a cancelled
scale-out (an engine that never served has nothing to drain). ``ACTIVE`` never jumps to ``REMOVED``: the
only way out of service is through ``DRAINING``, which is what makes a drain real. ``REMOVED`` and
``FAILED`` are terminal; an initial engine that dies is restarted as a *new* record (new id, same bundle).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise
from typing import Any

Clock = Callable[[], float]

__all__ = [
    "ENGINE_ID_PREFIX",
    "EngineKind",
    "EnginePool",
    "EngineRecord",
    "EngineState",
    "IllegalTransition",
    "TransitionListener",
    "UnknownEngine",
    "engine_can_join",
    "engine_number",
    "format_engine_id",
]

ENGINE_ID_PREFIX = "engine_"
_ENGINE_ID_RE = re.compile(r"^engine_(\d+)$")


class EngineState(str, Enum):
    """Lifecycle state of one engine; the value is the name ``GET /rollout/engines`` shows as ``status``."""

    PENDING = "PENDING"  # placement group requested, not ready: the demand the cluster provisioner sees
    STARTING = "STARTING"  # server process starting (or, for an external engine, being attached)
    HEALTH_CHECKING = "HEALTH_CHECKING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"  # pulling the current weight version; not routable yet
    ACTIVE = "ACTIVE"  # the only state that receives requests
    DRAINING = "DRAINING"  # out of the router, waiting for in-flight requests to finish
    REMOVED = "REMOVED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def live(self) -> bool:
        """Counts toward the pool size: everything that is not terminal (pending engines included)."""
        return self not in _TERMINAL

    def can_transition_to(self, target: EngineState) -> bool:
        return target in _LEGAL[self]


_TERMINAL = frozenset({EngineState.REMOVED, EngineState.FAILED})
_CHAIN = (
    EngineState.PENDING,
    EngineState.STARTING,
    EngineState.HEALTH_CHECKING,
    EngineState.WEIGHT_SYNCING,
    EngineState.ACTIVE,
    EngineState.DRAINING,
    EngineState.REMOVED,
)
_ROLLBACK_SOURCES = frozenset(
    {EngineState.PENDING, EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING}
)


def _legal_transitions() -> dict[EngineState, frozenset[EngineState]]:
    legal: dict[EngineState, set[EngineState]] = {state: set() for state in EngineState}
    for src, dst in pairwise(_CHAIN):
        legal[src].add(dst)
    for state in EngineState:
        if not state.terminal:
            legal[state].add(EngineState.FAILED)
    for state in _ROLLBACK_SOURCES:
        legal[state].add(EngineState.REMOVED)
    return {state: frozenset(targets) for state, targets in legal.items()}


_LEGAL = _legal_transitions()


class EngineKind(str, Enum):
    """Why an engine exists; the value is what ``GET /rollout/engines`` shows as ``kind``."""

    INITIAL = "initial"  # the fixed baseline; never a scale-in victim
    ELASTIC = "elastic"  # added by scale-out on provisioner capacity; removed newest first
    EXTERNAL = "external"  # a running server attached by URL; Relax did not start it


class IllegalTransition(ValueError):
    """A lifecycle move the state machine forbids; names the engine and both states for the log."""

    def __init__(self, engine_id: str, src: EngineState, dst: EngineState) -> None:
        allowed = ", ".join(sorted(s.value for s in _LEGAL[src])) or "none (terminal)"
        super().__init__(f"{engine_id}: illegal transition {src.value} -> {dst.value} (allowed: {allowed})")
        self.engine_id = engine_id
        self.src = src
        self.dst = dst

    def __reduce__(self):  # keep the fields across a Ray / pickle boundary
        return (type(self), (self.engine_id, self.src, self.dst))


class UnknownEngine(LookupError):
    """No engine with this id is known to the pool (never existed, or its record was garbage-collected)."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(f"unknown engine {engine_id!r}")
        self.engine_id = engine_id

    def __reduce__(self):
        return (type(self), (self.engine_id,))


def format_engine_id(number: int) -> str:
    return f"{ENGINE_ID_PREFIX}{number}"


def engine_number(engine_id: str) -> int:
    """The ``n`` of ``engine_<n>``; raises ``ValueError`` for any other shape.

    Ordering by this number (not by string) is what keeps ``engine_10`` after ``engine_9`` in LIFO victim
    choice and in the router's deterministic tie-break.
    """
    match = _ENGINE_ID_RE.match(engine_id) if isinstance(engine_id, str) else None
    if match is None:
        raise ValueError(f"not an engine id: {engine_id!r} (expected '{ENGINE_ID_PREFIX}<n>')")
    return int(match.group(1))


def _check_version(version: int | None, what: str) -> None:
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {version!r}")


@dataclass
class EngineRecord:
    """Everything the pool knows about one engine. Mutate only through :class:`EnginePool`.

    ``transitions`` holds ``(state, timestamp)`` for every state entered, the first one included; the
    scale-out latency benchmark and the REST view read phase durations from it.
    """

    engine_id: str
    kind: EngineKind
    state: EngineState
    created_at: float
    url: str | None = None
    node_id: str | None = None
    weight_version: int | None = None
    weight_digest: str | None = None  # the digest of the weights it holds, when known (relax.rollout.refit.rules)
    weights_verified: bool = False  # its served weights were checked against weight_version's publication
    in_flight: int = 0
    bundle: str | None = None  # opaque placement-group / bundle id the shell uses to clean up
    last_error: str | None = None
    transitions: list[tuple[EngineState, float]] = field(default_factory=list)

    @property
    def number(self) -> int:
        return engine_number(self.engine_id)

    @property
    def state_since(self) -> float:
        """When the current state was entered."""
        return self.transitions[-1][1] if self.transitions else self.created_at

    def entered_at(self, state: EngineState) -> float | None:
        """When ``state`` was (last) entered, or ``None`` if never."""
        for seen, at in reversed(self.transitions):
            if seen is state:
                return at
        return None

    def to_dict(self) -> dict[str, Any]:
        """The REST shape of ``GET /rollout/engines`` (``status`` is the lifecycle name), plus details."""
        return {
            "engine_id": self.engine_id,
            "url": self.url,
            "kind": self.kind.value,
            "status": self.state.value,
            "weight_version": self.weight_version,
            "weight_digest": self.weight_digest,
            "weights_verified": self.weights_verified,
            "in_flight": self.in_flight,
            "node_id": self.node_id,
            "bundle": self.bundle,
            "created_at": self.created_at,
            "last_error": self.last_error,
            "transitions": [{"state": state.value, "at": at} for state, at in self.transitions],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineRecord:
        engine_number(data["engine_id"])  # validate the id shape
        return cls(
            engine_id=data["engine_id"],
            kind=EngineKind(data["kind"]),
            state=EngineState(data["status"]),
            created_at=float(data["created_at"]),
            url=data.get("url"),
            node_id=data.get("node_id"),
            weight_version=data.get("weight_version"),
            weight_digest=data.get("weight_digest"),
            weights_verified=bool(data.get("weights_verified", False)),
            in_flight=int(data.get("in_flight", 0)),
            bundle=data.get("bundle"),
            last_error=data.get("last_error"),
            transitions=[(EngineState(t["state"]), float(t["at"])) for t in data.get("transitions", [])],
        )


def engine_can_join(record: EngineRecord, current_version: int) -> bool:
    """Whether ``record`` may (still) receive requests under weight version ``current_version``.

    An engine joins the router only after it holds the current weight version, so a sample
    is never generated by an engine that missed a publication while it was starting. The engine must be
    at the end of its start-up (``WEIGHT_SYNCING``) or already ``ACTIVE``; a version newer than
    ``current_version`` counts as holding it (the publication raced ahead of the caller's view).
    """
    _check_version(current_version, "current_version")
    if record.state not in (EngineState.WEIGHT_SYNCING, EngineState.ACTIVE):
        return False
    return record.weight_version is not None and record.weight_version >= current_version


TransitionListener = Callable[[EngineRecord, EngineState, EngineState], None]
"""Called as ``listener(record, from_state, to_state)`` after each transition (e.g. to feed the event log)."""


class EnginePool:
    """The set of engine records, the id allocator, and the lifecycle state machine.

    Ids are ``engine_<n>`` with ``n`` allocated monotonically and never reused, even after a record is
    removed or the pool is restored from a snapshot: logs, events and metrics that name an engine must
    never become ambiguous.
    """

    def __init__(
        self,
        clock: Clock = time.time,
        *,
        next_number: int = 0,
        on_transition: TransitionListener | None = None,
    ) -> None:
        if isinstance(next_number, bool) or not isinstance(next_number, int) or next_number < 0:
            raise ValueError(f"next_number must be an integer >= 0, got {next_number!r}")
        self._clock = clock
        self._next_number = next_number
        self._records: dict[str, EngineRecord] = {}
        self._on_transition = on_transition

    # -- ids and membership -------------------------------------------------------------------------

    @property
    def next_number(self) -> int:
        """The ``n`` the next :meth:`add` will use."""
        return self._next_number

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._records

    def add(
        self,
        kind: EngineKind,
        *,
        url: str | None = None,
        node_id: str | None = None,
        bundle: str | None = None,
    ) -> EngineRecord:
        """Create a new engine record in ``PENDING`` with a fresh, never-used id."""
        kind = EngineKind(kind)
        engine_id = format_engine_id(self._next_number)
        self._next_number += 1
        now = self._clock()
        record = EngineRecord(
            engine_id=engine_id,
            kind=kind,
            state=EngineState.PENDING,
            created_at=now,
            url=url,
            node_id=node_id,
            bundle=bundle,
            transitions=[(EngineState.PENDING, now)],
        )
        self._records[engine_id] = record
        return record

    def get(self, engine_id: str) -> EngineRecord:
        try:
            return self._records[engine_id]
        except KeyError:
            raise UnknownEngine(engine_id) from None

    # -- lifecycle ----------------------------------------------------------------------------------

    def transition(self, engine_id: str, state: EngineState, error: str | None = None) -> EngineRecord:
        """Move an engine to ``state``; raises :class:`IllegalTransition` for a move the lifecycle forbids.

        Entering ``ACTIVE`` also needs a known weight version: an engine that holds no weights cannot
        serve samples anyone can attribute (use :func:`engine_can_join` to check against the current
        version first). ``error`` is kept as ``last_error`` (typically with ``FAILED``).
        """
        record = self.get(engine_id)
        state = EngineState(state)
        src = record.state
        if not src.can_transition_to(state):
            raise IllegalTransition(engine_id, src, state)
        if state is EngineState.ACTIVE and record.weight_version is None:
            raise ValueError(f"{engine_id}: cannot become ACTIVE before its weight version is known")
        record.state = state
        record.transitions.append((state, self._clock()))
        if error is not None:
            record.last_error = error
        if self._on_transition is not None:
            self._on_transition(record, src, state)
        return record

    def set_url(self, engine_id: str, url: str | None) -> EngineRecord:
        record = self.get(engine_id)
        record.url = url
        return record

    def set_node_id(self, engine_id: str, node_id: str | None) -> EngineRecord:
        record = self.get(engine_id)
        record.node_id = node_id
        return record

    def set_weight_version(self, engine_id: str, version: int | None, digest: str | None = None,
                           verified: bool = False) -> EngineRecord:
        """What the engine holds now: a new version forgets the old one's digest and check."""
        _check_version(version, "weight_version")
        if verified and digest is None:
            raise ValueError("a verified version has a digest")
        record = self.get(engine_id)
        record.weight_version, record.weight_digest, record.weights_verified = version, digest, verified
        return record

    def set_weight_digest(self, engine_id: str, version: int, digest: str) -> bool:
        """Learn the digest of ``version`` for an engine still holding it (unverified); False when it moved on."""
        record = self.get(engine_id)
        if record.weight_version != version or record.weights_verified:
            return False
        record.weight_digest = digest
        return True

    def set_in_flight(self, engine_id: str, in_flight: int) -> EngineRecord:
        """Mirror the router's exact count into the record, for the REST view."""
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
            raise ValueError(f"in_flight must be an integer >= 0, got {in_flight!r}")
        record = self.get(engine_id)
        record.in_flight = in_flight
        return record

    # -- queries ------------------------------------------------------------------------------------

    @staticmethod
    def _sorted(records: Iterable[EngineRecord]) -> list[EngineRecord]:
        return sorted(records, key=lambda r: r.number)

    def records(
        self,
        states: Iterable[EngineState] | None = None,
        kinds: Iterable[EngineKind] | None = None,
    ) -> list[EngineRecord]:
        """Records filtered by state and kind (``None`` = any), ordered by engine number."""
        state_set = None if states is None else {EngineState(s) for s in states}
        kind_set = None if kinds is None else {EngineKind(k) for k in kinds}
        return self._sorted(
            r
            for r in self._records.values()
            if (state_set is None or r.state in state_set) and (kind_set is None or r.kind in kind_set)
        )

    def active(self) -> list[EngineRecord]:
        return self.records(states=[EngineState.ACTIVE])

    def routable(self) -> list[str]:
        """Ids of the engines that may receive requests: ``ACTIVE`` only, by engine number."""
        return [r.engine_id for r in self.active()]

    def live(self) -> list[EngineRecord]:
        return [r for r in self._sorted(self._records.values()) if r.state.live]

    def counts(self) -> dict[EngineState, int]:
        """Number of known records per state; every state is present (zero when none)."""
        counts = dict.fromkeys(EngineState, 0)
        for record in self._records.values():
            counts[record.state] += 1
        return counts

    def elastic_victims(self, n: int, *, include_external: bool = False) -> list[EngineRecord]:
        """The ``n`` newest ``ACTIVE`` elastic engines, newest first (LIFO by engine number).

        Initial engines are never victims (the baseline stays on the stable node group); external engines
        only when ``include_external``. Returns fewer than ``n`` when fewer are eligible.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        kinds = [EngineKind.ELASTIC, EngineKind.EXTERNAL] if include_external else [EngineKind.ELASTIC]
        eligible = self.records(states=[EngineState.ACTIVE], kinds=kinds)
        return list(reversed(eligible))[:n]

    def min_active_weight_version(self) -> int | None:
        """The oldest weight version any ``ACTIVE`` engine holds (``None`` with no active engine).

        The staleness gate reads this: rollout may run ahead only as far as the laggiest serving engine.
        """
        versions = [r.weight_version for r in self.active() if r.weight_version is not None]
        return min(versions) if versions else None

    # -- snapshot / restore ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able snapshot; restoring it keeps the id counter so ids stay unique across restarts."""
        return {
            "next_number": self._next_number,
            "engines": [r.to_dict() for r in self._sorted(self._records.values())],
        }

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        clock: Clock = time.time,
        *,
        on_transition: TransitionListener | None = None,
    ) -> EnginePool:
        records = [EngineRecord.from_dict(item) for item in data.get("engines", [])]
        # Never hand out an id at or below one already seen, even if the snapshot's counter is behind.
        highest = max((r.number for r in records), default=-1)
        pool = cls(clock, next_number=max(int(data.get("next_number", 0)), highest + 1), on_transition=on_transition)
        for record in records:
            if record.engine_id in pool._records:
                raise ValueError(f"duplicate engine id in snapshot: {record.engine_id}")
            pool._records[record.engine_id] = record
        return pool
