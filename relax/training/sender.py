"""The trainer side of broadcast weight updates: rank 0 holds the latest versions and sends them.

After a training step every rank gathers the full weights (a collective); rank 0 flattens them into
buckets (``flat_bucket``) and keeps them here, on the device its groups send from. The rollout manager then
drives each engine's update: it opens a group with the engine (``open`` + the engine's
``/init_weights_update_group``), and for every bucket calls ``broadcast`` here at the same time as the
engine's ``/update_weights_from_distributed``. These calls run on threads of their own in the trainer's
actor (a Ray concurrency group), so a training step never waits for an engine and an engine never waits for
a training step; the held buckets are copies, so the next step cannot change a version being sent.

Two versions are held: an engine still receiving version k when k+1 arrives finishes k (the manager then
brings it to k+1); anything older has been superseded and is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.weights.buckets import make_buckets
from relax.weights.digest import ChecksumAlgorithm, ChecksumLayout, layout_checksums, version_digest
from relax.weights.flat_bucket import BucketSpec, flatten, unflatten
from relax.weights.group import WeightGroup, host_rendezvous, init_weight_group
from relax.weights.publication import WeightConflict, WeightManifest

__all__ = ["BROADCAST_BUCKET_BYTES", "HeldVersion", "WeightConflict", "WeightSender"]

log = logging.getLogger(__name__)

#: Default bucket of a broadcast (``--update-weight-buffer-size``): each bucket costs a round trip on both sides
#: (an HTTP call, an actor call, a collective), so fewer and larger ones are faster; the engine keeps one
#: receive buffer of this size. 512 MiB is slime's default for the same setting.
BROADCAST_BUCKET_BYTES = 512 * 2**20
#: How long a broadcast waits for its bucket to be copied in (a copy runs at memory speed: minutes mean trouble).
COPY_TIMEOUT_S = 300.0

@dataclass
class HeldVersion:
    """One version on rank 0: its buckets' buffers, each filled in the background (``ready``), and its checksums.

    The hold returns once the buffers are chosen; a background thread copies the weights in bucket by bucket, so
    the first bucket is on the wire while the next is copied. ``broadcast`` waits for its own bucket only.
    """

    version: int
    specs: tuple[BucketSpec, ...]
    buffers: tuple[torch.Tensor, ...]
    layout: str = ChecksumLayout.HF.value
    ready: tuple[Future[None], ...] = ()
    checksums: dict[str, Future[dict[str, str]]] = field(default_factory=dict)  # per algorithm, on first request

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def wait_ready(self, index: int | None = None, timeout_s: float | None = None) -> None:
        """Until bucket ``index`` (every bucket: None) is copied in; raises the copy's error."""
        for future in self.ready if index is None else self.ready[index:index + 1]:
            future.result(timeout=timeout_s)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version, as views of the held buffers (after ``wait_ready``)."""
        out: dict[str, torch.Tensor] = {}
        for buffer, spec in zip(self.buffers, self.specs, strict=True):
            out.update(unflatten(buffer, spec))
        return out


class WeightSender:
    """Rank 0's held versions and its open weight groups (one per engine)."""

    def __init__(self, address: str, *, keep: int = 2, device: torch.device | None = None) -> None:
        self.address = address
        self.device = device or torch.device("cpu")
        self._keep = keep
        self._versions: dict[int, HeldVersion] = {}
        self._groups: dict[str, WeightGroup] = {}
        self._sending: dict[int, int] = {}  # version -> broadcasts reading its buffers now
        self._leases: dict[int, tuple[int, float]] = {}  # version -> (sends that pinned it, when the pin lapses)
        self._pending: dict[str, Future[WeightGroup]] = {}
        self._lock = threading.Lock()
        self._joiner = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relax-weight-group")
        # one copier: versions are copied in in the order they were held
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-weight-copy")

    # ------------------------------------------------------------------ versions
    def hold(self, version: int, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None,
             bucket_bytes: int = BROADCAST_BUCKET_BYTES, layout: ChecksumLayout | str = ChecksumLayout.HF
             ) -> WeightManifest:
        """Keep ``state`` as version ``version``; returns its manifest in wire order at once, while the copies are
        made in the background (``state`` must not change until :meth:`wait_copied`: the trainer's next optimizer
        step waits for it).

        Holding a version that is already held is a no-op when the weights are the same (a retried publication)
        and a :class:`WeightConflict` when they are not; a version older than the newest is refused.
        """
        t0 = time.perf_counter()
        layout = ChecksumLayout(layout).value
        buckets = make_buckets(state, bucket_bytes, dtype=dtype)
        with self._lock:
            latest = max(self._versions, default=None)
            again = self._versions.get(version)
        if again is not None:
            return self._hold_again(again, buckets, layout)
        if latest is not None and version <= latest:
            raise ValueError(f"weight versions must strictly increase: got {version} after {latest}")
        specs = [BucketSpec.of(bucket) for bucket in buckets]
        spare = self._spare_buffers([spec.nbytes for spec in specs])
        buffers = tuple(out if out is not None else torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device)
                        for spec, out in zip(specs, spare, strict=True))
        held = HeldVersion(version, tuple(specs), buffers, layout, tuple(Future() for _ in specs))
        ordered = [{name: bucket[name] for name in spec.names} for bucket, spec in zip(buckets, specs, strict=True)]
        manifest = WeightManifest.from_buckets(version, ordered)
        with self._lock:
            latest = max(self._versions, default=None)
            if latest is not None and version <= latest:
                raise ValueError(f"weight versions must strictly increase: got {version} after {latest}")
            self._versions[version] = held
            self._trim()
        self._copier.submit(self._copy_in, held, ordered, t0)
        return manifest

    def _copy_in(self, held: HeldVersion, buckets: list[dict[str, torch.Tensor]], t0: float) -> None:
        """The background half of a hold: each bucket flattened into its buffer, in wire order."""
        for bucket, spec, buffer, ready in zip(buckets, held.specs, held.buffers, held.ready, strict=True):
            try:
                flatten(bucket, spec, out=buffer)
            except BaseException as exc:  # noqa: BLE001 - every waiter of this bucket and the later ones learns why
                for future in held.ready:
                    if not future.done():
                        future.set_exception(exc)
                log.error("weights v%d: copying bucket %s failed: %s", held.version, spec.names[:1], exc)
                return
            ready.set_result(None)
        log.debug("weights v%d held for broadcast: %d buckets, %.1f MiB, copied in %.3fs after the hold began",
                  held.version, len(held.specs), held.nbytes / 2**20, time.perf_counter() - t0)

    def _hold_again(self, held: HeldVersion, buckets: list[dict[str, torch.Tensor]], layout: str) -> WeightManifest:
        """A version held again: the same weights are a no-op (its manifest again), any others a conflict."""
        new = {name: t for bucket in buckets for name, t in bucket.items()}
        names = [n for spec in held.specs for n in spec.names]
        same_shape = sorted(new) == sorted(names) and all(
            (tuple(new[n].shape), str(new[n].dtype).removeprefix("torch.")) == (shape, dtype)
            for spec in held.specs for n, shape, dtype in zip(spec.names, spec.shapes, spec.dtypes, strict=True))
        if not same_shape or layout != held.layout:
            raise WeightConflict(f"weight version {held.version} is already held with other tensors (names, shapes or "
                                 "dtypes): a version number names one set of weights (publish a new version)")
        theirs = version_digest(self.checksums(held.version))  # SHA-256: whatever the engines use, it is the same
        ours = version_digest(layout_checksums(new, layout))
        if ours != theirs:
            raise WeightConflict(f"weight version {held.version} is already held with digest {theirs[:12]}; this "
                                 f"publication's weights have digest {ours[:12]}: a version number names one set "
                                 "of weights (publish them as a new version)")
        log.info("weights v%d held again with the same weights (digest %s): nothing to do", held.version, ours[:12])
        return WeightManifest.from_buckets(held.version, [
            {n: new[n] for n in spec.names} for spec in held.specs])

    def wait_copied(self, timeout_s: float | None = None) -> None:
        """Until every held version is copied in: after this the trainer may change the weights it held."""
        with self._lock:
            held = list(self._versions.values())
        for version in held:
            with contextlib.suppress(Exception):  # a failed copy is the broadcast's error, not the step's
                version.wait_ready(timeout_s=timeout_s)

    def checksums(self, version: int, timeout_s: float | None = None,
                  algorithm: ChecksumAlgorithm | str = ChecksumAlgorithm.SHA256) -> dict[str, str]:
        """Per served tensor, what an engine holding ``version`` reports on ``/weights_checker`` (in the layout the
        version was held for, hashed as the engine hashes); computed once per algorithm, on the first request, from
        the held buffers."""
        algorithm = ChecksumAlgorithm(algorithm).value
        held = self._held(version)
        with self._lock:
            future = held.checksums.get(algorithm)
            compute = future is None
            if future is None:
                future = held.checksums[algorithm] = Future()
        if compute:
            try:
                held.wait_ready(timeout_s=timeout_s)
                t0 = time.perf_counter()
                future.set_result(layout_checksums(held.tensors(), held.layout, algorithm=algorithm))
                log.debug("weights v%d: %d %s checksums in %.3fs", version, len(future.result()), algorithm,
                          time.perf_counter() - t0)
            except BaseException as exc:
                future.set_exception(exc)
                with self._lock:
                    held.checksums.pop(algorithm, None)  # the next request tries again
        return dict(future.result(timeout=timeout_s))

    def _spare_buffers(self, sizes: list[int]) -> list[torch.Tensor | None]:
        """The buffers of the version this hold will drop, when nothing is sending them and the layout matches.

        Every version has the same layout, so after the first few publications a hold copies into memory
        that is already mapped instead of faulting in the model's size again (measured on SmolLM2-135M:
        the copy into fresh pages took 1.2-1.9 s, into mapped ones about 0.1 s).
        """
        with self._lock:
            if len(self._versions) < self._keep:
                return [None] * len(sizes)
            oldest = min(self._versions)
            held = self._versions[oldest]
            hashing = any(not f.done() for f in held.checksums.values())
            if (self._sending.get(oldest, 0) or self._pinned(oldest) or hashing
                    or [b.numel() for b in held.buffers] != sizes):
                return [None] * len(sizes)
            del self._versions[oldest]  # dropped now rather than after the copy: no send can start on it
            return list(held.buffers)

    def acquire(self, version: int, lease_s: float) -> bool:
        """Pin ``version`` for a send about to start; False when it is no longer held.

        Without the pin, a trainer that steps faster than an engine syncs (or joins: opening its group takes
        a while) drops the version between the manager choosing it and the send's first or next bucket, and
        the engine, already paused and receiving, has to be failed. Pinned, it stays until ``release``, or
        until the lease lapses should the manager die mid-send. Refused, nothing on the engine has been
        touched: the manager moves on to the newest version.
        """
        with self._lock:
            if version not in self._versions:
                return False
            count, until = self._leases.get(version, (0, 0.0))
            self._leases[version] = (count + 1, max(until, time.monotonic() + lease_s))
            return True

    def release(self, version: int) -> None:
        """The send that pinned ``version`` is over; an unpinned version past the newest ``keep`` goes."""
        with self._lock:
            count, until = self._leases.pop(version, (0, 0.0))
            if count > 1:
                self._leases[version] = (count - 1, until)
            self._trim()

    def _pinned(self, version: int) -> bool:
        """Under the lock: a send holds a lease on ``version`` that has not lapsed."""
        lease = self._leases.get(version)
        if lease is not None and lease[1] <= time.monotonic():
            log.warning("weights v%d: a send's pin lapsed without a release (the manager stopped mid-send?)",
                        version)
            del self._leases[version]
            return False
        return lease is not None

    def _trim(self) -> None:
        """Under the lock: keep the newest ``keep`` versions, and older ones only while a send has them pinned."""
        for old in sorted(self._versions)[: -self._keep]:
            if not self._pinned(old):
                del self._versions[old]

    def _held(self, version: int) -> HeldVersion:
        with self._lock:
            held = self._versions.get(version)
            if held is None:
                raise KeyError(f"weight version {version} is no longer held for broadcast (held: "
                               f"{sorted(self._versions)}); the manager moves on to the newest")
            return held

    # ------------------------------------------------------------------ groups
    def open(self, name: str, world_size: int, backend: str, timeout_s: float) -> dict[str, Any]:
        """Host group ``name``'s rendezvous and start joining it; the engine joins with the address returned.

        Returns at once (the join completes when the engine's ranks arrive): ``wait_open`` waits for it.
        """
        with self._lock:
            if name in self._groups or name in self._pending:
                raise ValueError(f"weight group {name!r} is already open")
        store, port = host_rendezvous(self.address, world_size, timeout_s)
        future = self._joiner.submit(init_weight_group, name, self.address, port, 0, world_size, backend, timeout_s,
                                     store=store, device=self.device)
        with self._lock:
            self._pending[name] = future
        return {"master_address": self.address, "master_port": port, "world_size": world_size, "backend": backend}

    def wait_open(self, name: str, timeout_s: float) -> None:
        with self._lock:
            future = self._pending.get(name)
        if future is None:
            if name in self._groups:
                return
            raise KeyError(f"weight group {name!r} was never opened")
        try:
            group = future.result(timeout=timeout_s)
        finally:
            with self._lock:
                self._pending.pop(name, None)
        with self._lock:
            self._groups[name] = group

    def broadcast(self, name: str, version: int, index: int) -> int:
        """Send bucket ``index`` of ``version`` to group ``name``; returns the bytes sent."""
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise KeyError(f"weight group {name!r} is not open")
        held = self._held(version)
        if not 0 <= index < len(held.buffers):
            raise IndexError(f"version {version} has {len(held.buffers)} buckets, no bucket {index}")
        held.wait_ready(index, timeout_s=COPY_TIMEOUT_S)  # copied in while earlier buckets were on the wire
        buffer = held.buffers[index]
        with self._lock:
            if version not in self._versions:  # dropped between _held and here: its buffers may be reused
                raise KeyError(f"weight version {version} is no longer held for broadcast")
            self._sending[version] = self._sending.get(version, 0) + 1
        try:
            group.broadcast(buffer, src=0)
        finally:
            with self._lock:
                self._sending[version] -= 1
                if not self._sending[version]:
                    del self._sending[version]
        return int(buffer.numel())

    def close(self, name: str) -> bool:
        """Forget group ``name`` (the engine left or failed); True when it was open."""
        with self._lock:
            group = self._groups.pop(name, None)
            future = self._pending.pop(name, None)
        if future is not None:
            future.cancel()
        if group is not None:
            group.close()
        return group is not None or future is not None

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def shutdown(self) -> None:
        for name in [*self.groups(), *list(self._pending)]:
            self.close(name)
        self._joiner.shutdown(wait=False, cancel_futures=True)
        self._copier.shutdown(wait=False, cancel_futures=True)
