"""Request routing over the ACTIVE engines, with exact in-flight accounting (docs/architecture.md, "Router").

The router lives inside the RolloutManager process and is pure: the async shell calls ``acquire`` before
sending a request and ``release`` when the answer (or the error) is back. Three rules:

1. **Least in flight.** A request goes to the routable engine with the fewest requests in flight; ties go
   to the lowest engine number, so routing is deterministic and testable.
2. **Group stickiness.** The samples of one prompt group share a long prefix; keeping them on one engine
   turns that prefix into prefix-cache hits. A ``group_key`` stays on its engine while that engine is
   routable, and is re-picked by rule 1 once the engine left the router.
3. **Exact counts survive removal.** ``remove`` takes an engine out of routing but keeps its in-flight
   count until the releases bring it to zero. ``drained`` is true only then: that is what makes a drain
   real rather than a sleep.

:class:`RetryPolicy` decides what happens to a request whose engine failed: a sample is never silently
lost, so anything that is the engine's fault (unreachable, died, evicted, aborted by a drain) is retried
on another engine up to ``max_attempts``; a request the engine rejected as malformed (4xx) is not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from relax.rollout.pool.engines import engine_number

__all__ = [
    "FailureKind",
    "NoEngineAvailable",
    "RetryDecision",
    "RetryPolicy",
    "Router",
    "failure_from_finish_reason",
]


class NoEngineAvailable(RuntimeError):
    """No engine is routable right now; the async shell waits for one to join instead of failing."""


class Router:
    """Picks an engine per request and counts in-flight requests per engine exactly.

    ``max_groups`` bounds the sticky-group table (least recently used groups are forgotten first) so a
    long run that never calls :meth:`end_group` does not grow without limit.
    """

    def __init__(self, *, max_groups: int = 100_000) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups!r}")
        self._routable: set[str] = set()
        self._in_flight: dict[str, int] = {}  # routable engines, plus removed ones until they drain
        self._groups: OrderedDict[Hashable, str] = OrderedDict()
        self._max_groups = max_groups

    # -- membership ---------------------------------------------------------------------------------

    def add(self, engine_id: str) -> None:
        """Make an engine routable (idempotent). Call only once it is ACTIVE with the current weights."""
        engine_number(engine_id)  # reject ids that would break the deterministic tie-break
        self._routable.add(engine_id)
        self._in_flight.setdefault(engine_id, 0)

    def remove(self, engine_id: str) -> int:
        """Stop routing to an engine (idempotent); returns how many of its requests are still in flight.

        Its count stays visible until releases bring it to zero; groups pinned to it are re-picked on
        their next request.
        """
        self._routable.discard(engine_id)
        for key in [k for k, e in self._groups.items() if e == engine_id]:
            del self._groups[key]
        left = self._in_flight.get(engine_id, 0)
        if left == 0:
            self._in_flight.pop(engine_id, None)
        return left

    def routable(self) -> list[str]:
        """Routable engine ids by engine number."""
        return sorted(self._routable, key=engine_number)

    def __len__(self) -> int:
        return len(self._routable)

    # -- requests -----------------------------------------------------------------------------------

    def acquire(self, group_key: Hashable | None = None, *, exclude: Collection[str] = ()) -> str:
        """Choose an engine for one request and count it in flight there.

        ``exclude`` names engines that already failed this request (see :class:`RetryPolicy`). It is a
        preference, not a ban: when every routable engine is excluded, the least loaded of them is used
        anyway, because in a one-engine pool waiting for a second engine that may never come would lose
        the sample, and an engine that was briefly unavailable may well have recovered.

        Raises :class:`NoEngineAvailable` when no engine is routable at all.
        """
        if not self._routable:
            raise NoEngineAvailable("no ACTIVE engine is routable")
        engine_id = None
        if group_key is not None:
            pinned = self._groups.get(group_key)
            if pinned is not None and pinned in self._routable and pinned not in exclude:
                engine_id = pinned
                self._groups.move_to_end(group_key)
        if engine_id is None:
            candidates = [e for e in self._routable if e not in exclude] or list(self._routable)
            engine_id = min(candidates, key=lambda e: (self._in_flight.get(e, 0), engine_number(e)))
            if group_key is not None:
                self._pin(group_key, engine_id)
        self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + 1
        return engine_id

    def _pin(self, group_key: Hashable, engine_id: str) -> None:
        self._groups[group_key] = engine_id
        self._groups.move_to_end(group_key)
        while len(self._groups) > self._max_groups:
            self._groups.popitem(last=False)

    def release(self, engine_id: str) -> int:
        """Count one request on ``engine_id`` as finished (answered, failed or aborted); returns what is left.

        A release without a matching acquire is a bookkeeping bug that would make drains end early, so it
        raises ``ValueError`` instead of clamping at zero.
        """
        count = self._in_flight.get(engine_id, 0)
        if count <= 0:
            raise ValueError(f"release of {engine_id!r} without a request in flight there")
        count -= 1
        if count == 0 and engine_id not in self._routable:
            del self._in_flight[engine_id]
        else:
            self._in_flight[engine_id] = count
        return count

    def in_flight(self, engine_id: str) -> int:
        return self._in_flight.get(engine_id, 0)

    def drained(self, engine_id: str) -> bool:
        """True once the engine is out of routing and none of its requests is still in flight."""
        return engine_id not in self._routable and self._in_flight.get(engine_id, 0) == 0

    # -- groups -------------------------------------------------------------------------------------

    def end_group(self, group_key: Hashable) -> None:
        """Forget a finished group's pin (idempotent)."""
        self._groups.pop(group_key, None)


# -- retries ------------------------------------------------------------------------------------------


class FailureKind(str, Enum):
    """Why a request did not produce a sample; decides whether and where it is retried."""

    ENGINE_UNAVAILABLE = "engine_unavailable"  # unreachable, timed out, 502/503/504, 408/429
    ENGINE_FAILED = "engine_failed"  # the engine (or its actor) died
    EVICTED = "evicted"  # the platform reclaimed the engine's node
    ABORTED = "aborted"  # aborted by a drain timeout, a forced scale-in or a weight-update pause
    SERVER_ERROR = "server_error"  # the engine answered 5xx or a malformed body
    CLIENT_ERROR = "client_error"  # the engine rejected the request itself (4xx): retrying cannot help
    OTHER = "other"  # an exception of our own making: surface it rather than retry a bug


_RETRYABLE = frozenset(
    {
        FailureKind.ENGINE_UNAVAILABLE,
        FailureKind.ENGINE_FAILED,
        FailureKind.EVICTED,
        FailureKind.ABORTED,
        FailureKind.SERVER_ERROR,
    }
)
# An abort is something Relax did to a healthy engine (drain, weight-update pause): no reason to avoid it.
# A drained engine has left the router anyway.
_EXCLUDE_ENGINE = _RETRYABLE - {FailureKind.ABORTED}


@dataclass(frozen=True)
class RetryDecision:
    """The answer of :meth:`RetryPolicy.decide`; truthy when the request should be sent again."""

    retry: bool
    failure: FailureKind
    exclude: frozenset[str]  # engines to avoid on the next attempt (pass back in as ``excluded``)
    reason: str

    def __bool__(self) -> bool:
        return self.retry


@dataclass(frozen=True)
class RetryPolicy:
    """Whether a failed request is retried, and which engines the next attempt should avoid.

    ``attempt`` is the number of attempts already made, the failed one included (1 after the first
    failure). Every failure counts toward ``max_attempts`` so a request that fails everywhere ends with a
    loud error instead of looping; ``retry_server_errors=False`` treats 5xx like 4xx.
    """

    max_attempts: int = 4
    retry_server_errors: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")

    def decide(
        self,
        failure: FailureKind,
        *,
        attempt: int,
        engine_id: str | None,
        excluded: Iterable[str] = (),
    ) -> RetryDecision:
        failure = FailureKind(failure)
        if attempt < 1:
            raise ValueError(f"attempt counts the failed attempt too and must be >= 1, got {attempt!r}")
        exclude = set(excluded)
        if engine_id is not None and failure in _EXCLUDE_ENGINE:
            exclude.add(engine_id)
        frozen = frozenset(exclude)
        retryable = failure in _RETRYABLE and (self.retry_server_errors or failure is not FailureKind.SERVER_ERROR)
        if not retryable:
            reason = f"{failure.value} is not retried: another engine would fail the same way"
            return RetryDecision(False, failure, frozen, reason)
        if attempt >= self.max_attempts:
            return RetryDecision(False, failure, frozen, f"{failure.value}: gave up after {attempt} attempt(s)")
        where = f"an engine other than {engine_id}" if engine_id in frozen else "any engine"
        reason = f"{failure.value}: retry {attempt + 1}/{self.max_attempts} on {where}"
        return RetryDecision(True, failure, frozen, reason)


def failure_from_finish_reason(finish_reason: Any) -> FailureKind | None:
    """``ABORTED`` when a generate answer says the request was aborted (SGLang ``{"type": "abort"}``).

    An aborted request comes back as a normal answer, not an error; without this check its truncated
    text would be taken for a sample.
    """
    kind = finish_reason.get("type") if isinstance(finish_reason, dict) else finish_reason
    return FailureKind.ABORTED if kind == "abort" else None
