"""A refit as a transaction: the rules of verifying, repeating and refusing a weight load (pure).

``WeightSync`` (``rollout.refit.weight_sync``) carries them out; everything that decides is here, tested in
milliseconds (docs/architecture.md, "Weights and staleness"):

* **Verified.** After a load, the engine's served weights are compared with the trainer's publication, tensor by
  tensor, through the engine's ``/weights_checker`` (:func:`should_verify` says when, by ``--verify-weights``).
  The check runs before the engine continues, so it never generates on weights that failed it.
* **Repaired once, then given up.** An engine that fails the check is loaded again in full, the same version,
  and checked again; failing twice it is failed (and replaced, as any failed engine): :func:`load_verified`.
* **Idempotent.** A load is keyed by (version, digest): an engine that holds the version already is left alone,
  and one that holds the same version number with other weights is a conflict, refused loudly
  (:func:`plan_refit`). The registry and the trainer's rank 0 refuse a version published again with other weights.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from relax.config.verify_weights import VerifyPolicy

__all__ = ["EngineWeights", "RefitStep", "VerifyPolicy", "Verification", "VerifyResult", "WeightMismatch",
           "load_verified", "plan_refit", "should_verify"]

T = TypeVar("T")


def should_verify(policy: VerifyPolicy | str, *, verified_before: bool) -> bool:
    """Whether this load of an engine is checked (``verified_before``: one of its loads passed a check)."""
    policy = VerifyPolicy(policy)
    return policy is VerifyPolicy.EVERY or (policy is VerifyPolicy.FIRST and not verified_before)


class RefitStep(str, Enum):
    NOTHING = "nothing"  # the engine holds this version (or a newer one) already
    SEND = "send"
    REFUSE = "refuse"  # the engine holds this version number with other weights


@dataclass(frozen=True)
class EngineWeights:
    """What the manager knows an engine holds: the version, and the digest a check found (None: not checked)."""

    version: int | None
    digest: str | None = None


def plan_refit(held: EngineWeights, version: int, digest: str | None = None) -> RefitStep:
    """What bringing an engine that holds ``held`` to (``version``, ``digest``) takes (``digest`` None: unknown)."""
    if held.version is None or held.version < version:
        return RefitStep.SEND
    if held.version == version and held.digest is not None and digest is not None and held.digest != digest:
        return RefitStep.REFUSE
    return RefitStep.NOTHING


class VerifyResult(str, Enum):
    VERIFIED = "verified"
    MISMATCH = "mismatch"
    UNCHECKABLE = "uncheckable"  # the engine cannot report its weights (no /weights_checker, TP > 1)


@dataclass(frozen=True)
class Verification:
    """One check of one engine against one version."""

    engine_id: str
    version: int
    result: VerifyResult
    expected_digest: str
    served_digest: str | None = None
    mismatched: tuple[str, ...] = ()  # tensor names whose checksum differs, or that one side lacks
    seconds: float = 0.0
    attempt: int = 0  # 0: the load's own check; 1: the check after the one full reload
    detail: str = ""

    @property
    def passed(self) -> bool:
        """Not a mismatch: an engine that cannot be checked is not failed for it (it stays unverified)."""
        return self.result is not VerifyResult.MISMATCH

    def describe(self) -> str:
        if self.result is VerifyResult.MISMATCH:
            names = ", ".join(self.mismatched[:3]) + (f" and {len(self.mismatched) - 3} more"
                                                     if len(self.mismatched) > 3 else "")
            return (f"{self.engine_id} serves other weights than v{self.version} (digest "
                    f"{(self.served_digest or '?')[:12]}, published {self.expected_digest[:12]}): "
                    f"{len(self.mismatched)} tensor(s) differ ({names})")
        if self.result is VerifyResult.UNCHECKABLE:
            return f"{self.engine_id}: weights v{self.version} not verified: {self.detail}"
        return f"{self.engine_id}: weights v{self.version} verified (digest {self.expected_digest[:12]})"

    def to_dict(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "version": self.version, "result": self.result.value,
                "expected_digest": self.expected_digest, "served_digest": self.served_digest,
                "mismatched": list(self.mismatched[:20]), "seconds": self.seconds, "attempt": self.attempt}


class WeightMismatch(RuntimeError):
    """An engine still serves other weights than the version it was sent, after one full reload of it."""

    def __init__(self, verifications: Sequence[Verification]) -> None:
        super().__init__(f"{verifications[-1].describe()}; still after one full reload"
                         if len(verifications) > 1 else verifications[-1].describe())
        self.verifications = tuple(verifications)


async def load_verified(load: Callable[[], Awaitable[T]], check: Callable[[int], Awaitable[Verification]] | None,
                        *, loaded: bool = False) -> tuple[T | None, list[Verification]]:
    """Load, check; on a mismatch load everything again and check again; a second mismatch raises.

    ``check(attempt)`` runs while the engine is still paused after the load, so a failed check never serves.
    ``loaded``: the engine holds the version already (a check on demand): check first, load only to repair.
    Returns what the last load returned (None when nothing was loaded) and the checks made.
    """
    result = None if loaded else await load()
    if check is None:
        return result, []
    first = await check(0)
    if first.passed:
        return result, [first]
    result = await load()
    second = await check(1)
    if not second.passed:
        raise WeightMismatch([first, second])
    return result, [first, second]
