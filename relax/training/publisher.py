"""Publishing a weight version from the trainer: the one way the driver, the tests and the benchmarks do it.

Two paths (``--weight-sync``), one call (:func:`publish`):

* **broadcast**: every rank gathers the full weights, rank 0 keeps them as flattened buckets
  (``TrainerGroup.hold_weights``, ``relax.training.sender``) and only the manifest goes to the rollout manager,
  with rank 0's actor handle to receive them from;
* **object store**: the gathered state dict is cut into buckets, ``ray.put`` and registered with the manager
  (:func:`publish_state`, which also publishes a state dict that did not come from a trainer).

``dtype`` is what the engines are sent: bf16 halves the bytes where engines serve bf16 (SGLang on GPU; see
:func:`publication_dtype`); ``None`` sends the trainer's fp32.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relax.config.flags import WeightSyncPath

__all__ = ["Publication", "checksum_layout", "publication_dtype", "publish", "publish_state"]


@dataclass(frozen=True)
class Publication:
    """One version on its way: what was published and the manager's registration to ``ray.get`` if you wait."""

    version: int
    manifest: Any  # relax.weights.publication.WeightManifest
    gather_s: float  # trainer time: gathering (and putting the buckets in the object store)
    registered: Any  # ObjectRef of RolloutManager.publish_weights
    bucket_refs: tuple[Any, ...] = ()  # object-store path: the buckets (the manager's registry holds them too)

    @property
    def nbytes(self) -> int:
        return int(self.manifest.total_bytes)


def publication_dtype(engine_backend: str) -> Any:
    """The dtype the engines of ``engine_backend`` serve (``relax.engines.backends``): bf16 for SGLang, on GPU
    and on CPU (half the bytes per publication, and what it serves); None (unchanged) for the built-in engine,
    which runs fp32 on CPU, where the tests compare log-probs to 1e-4."""
    import torch

    from relax.engines.backends import engine_backend as adapter

    name = adapter(engine_backend).publication_dtype
    return None if name is None else getattr(torch, name)


def checksum_layout(engine_backend: str) -> str:
    """How the engines of ``engine_backend`` hold the model: what a version's checksums are of
    (``relax.weights.digest``)."""
    from relax.engines.backends import engine_backend as adapter

    return adapter(engine_backend).checksum_layout


def publish_state(manager: Any, version: int, state: Mapping[str, Any], *, dtype: Any = None,
                  began: float | None = None, layout: str = "hf") -> Publication:
    """Put ``state`` into the object store as buckets and register it with the manager as ``version``, with the
    checksums an engine serving it in ``layout`` reports."""
    import dataclasses

    import ray

    from relax.weights.buckets import make_buckets
    from relax.weights.digest import layout_checksums
    from relax.weights.publication import WeightManifest

    began = time.monotonic() if began is None else began
    buckets = make_buckets(state, dtype=dtype)
    refs = [ray.put(b) for b in buckets]
    manifest = dataclasses.replace(WeightManifest.from_buckets(version, buckets), checksums=layout_checksums(
        {name: t for bucket in buckets for name, t in bucket.items()}, layout))
    gather_s = time.monotonic() - began
    return Publication(version, manifest, gather_s, manager.publish_weights.remote(version, refs, manifest),
                       tuple(refs))


def publish(trainer: Any, manager: Any, version: int, path: WeightSyncPath | str = WeightSyncPath.BROADCAST, *,
            dtype: Any = None, backend: str = "gloo", bucket_bytes: int | None = None,
            layout: str = "hf") -> Publication:
    """Publish the trainer's current weights as ``version`` by ``path``; returns without waiting for engines.

    ``layout``: how the engines hold the model (:func:`checksum_layout`), which the version's checksums follow.
    Publishing a version again is a no-op with the same weights and refused with others (``WeightConflict``).
    """
    began = time.monotonic()
    if WeightSyncPath(path) is WeightSyncPath.BROADCAST:  # the bytes stay in rank 0; engines receive them from it
        manifest = trainer.hold_weights(version, dtype=None if dtype is None else str(dtype).removeprefix("torch."),
                                        backend=backend, bucket_bytes=bucket_bytes, layout=layout)
        gather_s = time.monotonic() - began
        return Publication(version, manifest, gather_s,
                           manager.publish_weights.remote(version, [], manifest, trainer.sender))
    return publish_state(manager, version, trainer.full_state_dict(), dtype=dtype, began=began, layout=layout)
