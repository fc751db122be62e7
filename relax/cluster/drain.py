"""Ray's drain notices: which nodes are leaving, and by when (Ray >= 2.57; private APIs, wrapped here only).

A node that is about to be reclaimed is marked DRAINING in the GCS with a deadline: by ``ray start --block``
itself on SIGTERM (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, default 30 s), or by an autoscaler or operator
through the GCS drain API (reason PREEMPTION). A draining node takes no new work and exits as preempted once
its last actor is gone. Ray Serve reads the same set to move replicas ahead of the deadline; the rollout
manager reads it to move engines (``relax.rollout.fleet.eviction``).

Both calls are private in Ray 2.60 (``ray._private.state.state.get_draining_nodes``,
``ray._raylet.GcsClient.drain_node``): this is the one module that touches them. On a Ray without them
:func:`draining_nodes` answers ``None`` (no notices: the SIGTERM hook and failure detection remain), and says
so once in the log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("relax.cluster")

__all__ = ["MIN_RAY", "drain_node", "draining_nodes", "node_departure", "supported"]

MIN_RAY = (2, 57)
_warned = False


def _ray_version() -> tuple[int, ...]:
    import ray

    return tuple(int(p) for p in ray.__version__.split(".")[:2] if p.isdigit())


def supported() -> bool:
    try:
        return _ray_version() >= MIN_RAY
    except Exception:  # noqa: BLE001 - an odd version string: treat as unsupported
        return False


def draining_nodes() -> dict[str, int] | None:
    """Node id (hex) → drain deadline in epoch milliseconds (0: none given); None when Ray cannot say."""
    global _warned
    if not supported():
        if not _warned:
            import ray

            log.warning("Ray %s has no drain notices (needs >= %d.%d): evictions are seen only when engines die",
                        ray.__version__, *MIN_RAY)
            _warned = True
        return None
    try:
        from ray._private import state

        return {str(k): int(v) for k, v in state.state.get_draining_nodes().items()}
    except Exception as exc:  # noqa: BLE001 - the private API moved or the GCS is unreachable right now
        if not _warned:
            log.warning("reading Ray's draining nodes failed (%s); will keep trying", exc)
            _warned = True
        return None


def _gcs(address: str | None) -> Any:
    """A GCS client for ``address``, or for the cluster this process's driver or worker is attached to."""
    import ray

    return ray._raylet.GcsClient(address=address or ray.get_runtime_context().gcs_address)


def drain_node(node_id: str, deadline_s: float | None, *, reason: str = "DRAIN_NODE_REASON_PREEMPTION",
               message: str = "relax", address: str | None = None) -> tuple[bool, str]:
    """Ask the GCS to drain ``node_id`` with a deadline ``deadline_s`` from now (what a provider's notice does).

    Returns ``(accepted, rejection message)``. For operators' hooks and the tests.
    """
    from ray.core.generated import autoscaler_pb2

    gcs = _gcs(address)
    deadline_ms = 0 if deadline_s is None else int(time.time() * 1000 + deadline_s * 1000)
    accepted, rejection = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(reason), message, deadline_ms)
    return bool(accepted), str(rejection or "")


def node_departure(node_id: str, address: str | None = None, timeout: float = 10.0) -> str | None:
    """How a node left, as the GCS recorded it: ``None`` while it is alive (or unknown), else the death
    reason's name, e.g. ``AUTOSCALER_DRAIN_PREEMPTED`` for a node that exited after a preemption drain,
    ``AUTOSCALER_DRAIN_IDLE`` after an idle drain, ``UNEXPECTED_TERMINATION`` for a crash."""
    from ray.core.generated import gcs_pb2

    gcs = _gcs(address)
    for nid, info in gcs.get_all_node_info(timeout=timeout).items():
        if nid.hex() == node_id and info.state == gcs_pb2.GcsNodeInfo.DEAD:
            reason = info.death_info.DESCRIPTOR.fields_by_name["reason"].enum_type
            return str(reason.values_by_number[info.death_info.reason].name)
    return None
