"""Bringing engines to the trainer's newest weights, and proving they serve them.

Owns the refit as a transaction: the pure rules of verifying, repairing once and refusing a conflicting load
(``rules``), the ``WeightTransport`` port and its choice per engine (``transport``), the transports themselves
(a broadcast over a process group of its own, object-store buckets, a directory on disk) and
:class:`~relax.rollout.refit.weight_sync.WeightSync`, which brings every ACTIVE engine to the newest version in
the background. It may use the pool (records, versions, the launcher's weight calls) and the weight wire
(``relax.weights``); it never decides who serves (routing) or when an engine comes or goes (the fleet).
"""
