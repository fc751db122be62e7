"""Ray's fixed wait for a starting node, and how a start that ran past it is recognised.

Ray gives a starting node a fixed 30 s to register with its GCS (``ray._private.node``: ``raylet_start_wait_time_s``,
not configurable) and then raises a bare ``Exception`` ("The current node timed out during startup"). On a
machine short of CPU that can pass (seen: two test runs and a three-node local cluster on two cores; a
`ray start --head` of the local elastic cluster beside a training test), and a run then fails before it began
although nothing is wrong. Both of our starts (the embedded cluster, the local elastic cluster's head) try once
more after stopping what the first try started. Standard library only: the local elastic cluster imports no Ray.
"""

from __future__ import annotations

START_ATTEMPTS = 2
"""Tries of a Ray start that timed out in Ray's own registration wait (any other failure is not retried)."""

TIMED_OUT_MARKER = "timed out during startup"


def start_timed_out(error: BaseException) -> bool:
    """Whether a Ray start failed because the new node did not register in Ray's fixed 30 s: the exception
    ``ray.init`` raised, or an error quoting the log tail of a ``ray start`` that exited."""
    return TIMED_OUT_MARKER in str(error)
