"""How a published version travels to one engine: the port, its three paths, and the rule that picks one.

``WeightSync`` (``rollout.refit.weight_sync``) decides *when* an engine loads which version; a transport is *how*
the bytes get there. One class per path, each behind the same two calls:

* ``broadcast`` (``rollout.refit.broadcast.BroadcastTransport``): SGLang's distributed update from the trainer's rank
  0 over a weight-update group of the engine's own (``--weight-sync broadcast``, the default);
* ``object_store`` (``rollout.refit.disk_transports.ObjectStoreTransport``): the engine's actor pulls the buckets
  from Ray's object store, writes them to its node's shared memory and loads them from there;
* ``disk`` (``rollout.refit.disk_transports.ExternalDiskTransport``): for an external engine (no actor of ours on its
  node), the manager writes the version to a directory the engine must be able to read.

:func:`choose_transport` is the whole rule, pure, so it is tested without an engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, Protocol

from relax.rollout.pool.engines import EngineKind
from relax.rollout.refit.rules import Verification

__all__ = ["Check", "TransportKind", "VersionSuperseded", "WeightTransport", "choose_transport"]

#: The check of a load (``rollout.refit.rules.load_verified``): ``check(attempt)`` compares the engine's served weights
#: with the version's publication.
Check = Callable[[int], Awaitable[Verification]]


class TransportKind(str, Enum):
    BROADCAST = "broadcast"
    OBJECT_STORE = "object_store"
    DISK = "disk"


class VersionSuperseded(Exception):
    """The version is no longer held where it would come from: newer ones replaced it before this send began.

    Raised before the engine is paused or sent anything, so the caller moves on to the newest version with
    the engine (and its weight group) as they were.
    """


class WeightTransport(Protocol):
    """Brings one engine to one published version (``PublishedWeights``), paused as the run's pause mode says."""

    async def send(self, engine_id: str, client: Any, latest: Any, check: Check | None = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        """Load ``latest`` into the engine, verified by ``check`` when given (``rollout.refit.rules.load_verified``);
        returns the phase timings, and the checks made under ``"verifications"``. Raises on failure (the engine
        is then failed by the caller, never resumed on part of a version) or :class:`VersionSuperseded`.
        ``verify_only``: the engine holds ``latest`` already; check it, and load only to repair a mismatch."""
        ...

    async def forget(self, engine_id: str, client: Any | None) -> None:
        """The engine leaves: release what this path keeps for it (a weight group). Never raises."""
        ...


def choose_transport(broadcast: bool, kind: EngineKind) -> TransportKind:
    """The path of one version to one engine.

    A version published for broadcast exists only in the trainer's rank 0, so every engine receives it that
    way. Otherwise the bytes are in the object store: an engine with an actor of ours pulls them on its node;
    an external engine has none, so the manager writes them to disk for it.
    """
    if broadcast:
        return TransportKind.BROADCAST
    return TransportKind.DISK if kind is EngineKind.EXTERNAL else TransportKind.OBJECT_STORE
