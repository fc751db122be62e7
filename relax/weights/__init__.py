"""The weight wire: the types both ends of a weight update share.

A weight update has a sender (the trainer, ``relax.training``), a coordinator (the rollout manager,
``relax.rollout``) and receivers (the engines, ``relax.engines``). What they must agree on lives here, below all
three, so that none of them imports another for it: the flat-bucket layout of a broadcast (``flat_bucket``),
the object-store buckets and their on-disk copies (``buckets``), the manifest of a version and the registry of
published versions (``publication``), the checksums and digest of what an engine serves (``digest``), the
weight-update process group and its rendezvous store (``group``, ``rendezvous_store``) and how an engine
pauses for an update (``pause_mode``).

This package imports nothing from ``relax.training``, ``relax.rollout``, ``relax.engines`` or
``relax.cluster`` (an import-linter contract holds it to that).
"""
