"""What a published weight version is, and the registry of the versions the trainer published.

(docs/architecture.md, "Weights and staleness".) The rollout manager keeps the registry and reads the
manifests; it never touches a tensor, so nothing here imports torch (``from_buckets`` and ``verify`` read only
``shape``, ``dtype``, ``numel()`` and ``element_size()`` of what they are given). A process that imports
torch pays ~3 CPU-seconds and ~200 MB before its first request. No Ray import either: the registry stores
whatever "refs" it is given (Ray ``ObjectRef`` objects in production).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WEIGHTS_CONCURRENCY_GROUP", "PublishedWeights", "WeightConflict", "WeightManifest", "WeightRegistry"]

logger = logging.getLogger(__name__)

#: The trainer actor's Ray concurrency group of the ``weights_*`` methods (calls name it per call): rank 0's
#: broadcast sends run on threads of their own, beside a step.
WEIGHTS_CONCURRENCY_GROUP = "weights"


class WeightConflict(ValueError):
    """A version number published again with other weights: a version names one set of weights, everywhere."""


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


@dataclass(frozen=True)
class WeightManifest:
    """What one published version contains, so a receiver can check it got everything.

    ``bucket_sizes`` is the number of tensors in each bucket, in order: with ``names`` it says which
    bucket holds which tensor without shipping the tensors.
    """

    version: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    total_bytes: int
    bucket_sizes: tuple[int, ...] = ()
    #: Per served tensor, what an engine holding this version reports on ``/weights_checker``, when the publisher
    #: computed them (the object-store path); a broadcast version's are asked of the trainer's rank 0.
    checksums: Mapping[str, str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError("names, shapes and dtypes must have the same length")
        if len(set(self.names)) != len(self.names):
            raise ValueError("manifest names must be unique")
        if self.bucket_sizes and sum(self.bucket_sizes) != len(self.names):
            raise ValueError(f"bucket_sizes sum to {sum(self.bucket_sizes)}, expected {len(self.names)}")

    @classmethod
    def from_buckets(cls, version: int, buckets: Sequence[Mapping[str, Any]]) -> WeightManifest:
        names: list[str] = []
        shapes: list[tuple[int, ...]] = []
        dtypes: list[str] = []
        total = 0
        for bucket in buckets:
            for name, t in bucket.items():
                names.append(name)
                shapes.append(tuple(t.shape))
                dtypes.append(str(t.dtype).removeprefix("torch."))
                total += _nbytes(t)
        return cls(version, tuple(names), tuple(shapes), tuple(dtypes), total, tuple(len(b) for b in buckets))

    @property
    def num_tensors(self) -> int:
        return len(self.names)

    def verify(self, buckets: Sequence[Mapping[str, Any]]) -> None:
        """Raise ``ValueError`` unless ``buckets`` hold exactly the manifest's tensors (names, shapes, dtypes)."""
        got = WeightManifest.from_buckets(self.version, buckets)
        expected = dict(zip(self.names, zip(self.shapes, self.dtypes, strict=True), strict=True))
        actual = dict(zip(got.names, zip(got.shapes, got.dtypes, strict=True), strict=True))
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        if missing or extra:
            raise ValueError(f"version {self.version}: missing tensors {missing[:3]}, unexpected {extra[:3]}")
        wrong = [n for n in expected if expected[n] != actual[n]]
        if wrong:
            n = wrong[0]
            raise ValueError(f"version {self.version}: tensor {n!r} is {actual[n]}, manifest says {expected[n]}")


# --------------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class PublishedWeights:
    """One version as the registry holds it: object refs of its buckets and its manifest.

    A version published for broadcast has no refs: its bytes stay in the trainer's rank 0, and ``sender``
    is the handle engines receive them through (``relax.training.sender``).
    """

    version: int
    bucket_refs: tuple[Any, ...]
    manifest: WeightManifest
    published_at: float = field(compare=False)
    sender: Any = field(default=None, compare=False)

    @property
    def broadcast(self) -> bool:
        return self.sender is not None


class WeightRegistry:
    """Versions the trainer published, newest last; keeps only the last ``keep`` versions.

    Dropping a version drops the registry's refs to its buckets, which lets Ray free the bytes once no
    engine is still pulling them (an engine mid-pull holds its own refs). Versions must strictly
    increase: a publication that goes backwards means two trainers or a replayed step, and silently
    accepting it would let engines load older weights under a newer number. Thread-safe, because the
    RolloutManager may serve HTTP and the trainer's publication concurrently.
    """

    def __init__(self, keep: int = 2, *, clock: Callable[[], float] = time.time) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._keep = keep
        self._clock = clock
        self._versions: dict[int, PublishedWeights] = {}
        self._lock = threading.Lock()

    def publish(self, version: int, bucket_refs: Sequence[Any], manifest: WeightManifest, *,
                sender: Any = None) -> PublishedWeights:
        if manifest.version != version:
            raise ValueError(f"manifest is for version {manifest.version}, published as {version}")
        if sender is None and manifest.bucket_sizes and len(manifest.bucket_sizes) != len(bucket_refs):
            raise ValueError(f"{len(bucket_refs)} bucket refs for a manifest of {len(manifest.bucket_sizes)} buckets")
        with self._lock:
            held = self._versions.get(version)
            if held is not None:
                return self._again(held, manifest, sender)
            latest = max(self._versions, default=None)
            if latest is not None and version <= latest:
                raise ValueError(f"weight versions must strictly increase: got {version} after {latest}")
            entry = PublishedWeights(version, tuple(bucket_refs), manifest, self._clock(), sender)
            self._versions[version] = entry
            for old in sorted(self._versions)[: -self._keep]:
                del self._versions[old]
        logger.debug("weights: published version %d (%d tensors, %d buckets, %.1f MiB, %s)", version,
                    manifest.num_tensors, len(manifest.bucket_sizes) or len(bucket_refs),
                    manifest.total_bytes / 2**20, "broadcast" if sender is not None else "object store")
        return entry

    @staticmethod
    def _again(held: PublishedWeights, manifest: WeightManifest, sender: Any) -> PublishedWeights:
        """A version registered again: the same publication is a no-op (a retried call), any other a conflict.

        A broadcast version's weights were compared by the sender that holds them before it got here; an
        object-store version's are compared here, by their checksums.
        """
        same = (held.manifest == manifest and (held.sender is None) == (sender is None)
                and (sender is None or held.sender == sender)
                and held.manifest.checksums == manifest.checksums)
        if not same:
            raise WeightConflict(f"weight version {held.version} is already published with other weights or from "
                                 "another sender: a version number names one set of weights (publish a new version)")
        logger.info("weights: version %d published again, the same: nothing to do", held.version)
        return held

    def latest(self) -> PublishedWeights | None:
        with self._lock:
            return self._versions[max(self._versions)] if self._versions else None

    @property
    def latest_version(self) -> int | None:
        entry = self.latest()
        return None if entry is None else entry.version

    def get(self, version: int) -> PublishedWeights:
        with self._lock:
            try:
                return self._versions[version]
            except KeyError:
                raise KeyError(f"weight version {version} is not held (held: {sorted(self._versions)})") from None

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def __len__(self) -> int:
        with self._lock:
            return len(self._versions)
