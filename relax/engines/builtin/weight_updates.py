"""Broadcast weight updates on the built-in engine, as SGLang 0.5.23 runs them.

``/init_weights_update_group`` joins a process group with the trainer, built exactly as SGLang builds it
(``relax.weights.group``); ``/begin_weight_update`` opens an update session, each
``/update_weights_from_distributed`` receives one bucket by broadcast from rank 0 (one collective per tensor,
or one for the whole bucket with ``load_format: "flattened_bucket"``) and copies it into the served model in
place; ``/end_weight_update`` closes the session; ``/destroy_weights_update_group`` leaves the group. The
rules the manager depends on are SGLang's: an update outside a session is refused, an update on an unpaused
engine waits for the writer lock (in-flight generations finish first), ``weight_version`` is applied when a
call succeeds.

A ``flattened_bucket`` whose layout matches the served tensors (dtype, shape, one tensor per name) is received
straight into them: the model's tensors of that layout live in one buffer (``weight_arena``), so no copy
follows the broadcast. Any other bucket is received into a staging buffer and copied.

A bucket that fails (a dead trainer, a timeout, a bad name) is reported as a 400 naming the cause. Names and
shapes are checked before anything is written, but a broadcast that breaks in the middle leaves part of the
version loaded (earlier buckets, and with an arena part of this one): the manager treats a failed update as
a failed engine, never as a served version, and never resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from relax.engines.builtin.protocol import InitWeightsUpdateGroupBody, UpdateWeightsFromDistributedBody
from relax.engines.builtin.weight_arena import WeightArena, build_arena
from relax.logs import failure_cause
from relax.weights.flat_bucket import BucketSpec, dtype_from_name, unflatten
from relax.weights.group import WeightGroup, init_weight_group

if TYPE_CHECKING:
    from relax.engines.builtin.engine import Engine
    from relax.engines.builtin.rwlock import WriterPreferringLock

log = logging.getLogger("relax.engine")

#: How long a join or one bucket's broadcast may take before the engine gives up on it.
GROUP_TIMEOUT_S = 120.0


class WeightUpdateError(Exception):
    """A broadcast update that cannot be carried out; the message names the cause (answered as a 400)."""


class DistributedUpdates:
    """The engine's weight groups and its update session."""

    def __init__(self, engine: Engine, update_lock: WriterPreferringLock, device: torch.device,
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.engine = engine
        self.update_lock = update_lock
        self.device = device
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self.session_open = False
        self.buckets_loaded = 0  # successful /update_weights_from_distributed calls since start
        # One receive buffer, reused: buckets arrive one after another and are copied into the model before
        # the next, and a fresh 64 MiB buffer per bucket costs its page faults every time (measured: ~40% of a
        # 513 MiB update on this machine).
        self._staging: torch.Tensor | None = None
        self._receiving = threading.Lock()
        # per bucket layout: the model's tensors living in the layout's buffer, received into without a copy
        self._arenas: dict[BucketSpec, WeightArena] = {}

    async def init_group(self, body: InitWeightsUpdateGroupBody) -> dict[str, Any]:
        if body.group_name in self.groups:
            raise WeightUpdateError(f"weight update group {body.group_name!r} already exists on this engine; "
                                    "destroy it first")
        if body.backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError(f"backend 'nccl' needs a CUDA engine; this one runs on {self.device} "
                                    "(use backend 'gloo')")
        try:
            group = await asyncio.to_thread(
                init_weight_group, body.group_name, body.master_address, body.master_port, body.rank_offset,
                body.world_size, body.backend, self.timeout_s, device=self.device)
        except Exception as exc:  # noqa: BLE001 - reported to the caller with the cause
            raise WeightUpdateError(f"could not join weight update group {body.group_name!r} at "
                                    f"{body.master_address}:{body.master_port}: {failure_cause(exc, 300)}") from exc
        self.groups[body.group_name] = group
        log.info("joined weight update group %s (rank %d of %d, %s)", body.group_name, body.rank_offset,
                 body.world_size, body.backend)
        return {"success": True, "message": f"joined weight update group {body.group_name}"}

    def destroy_group(self, name: str) -> dict[str, Any]:
        group = self.groups.pop(name, None)
        if group is None:
            raise WeightUpdateError(f"no weight update group {name!r} on this engine")
        group.close()
        log.info("left weight update group %s", name)
        return {"success": True, "message": f"destroyed weight update group {name}"}

    def begin(self) -> dict[str, Any]:
        self.session_open = True
        return {"success": True, "message": "weight update session open"}

    def end(self) -> dict[str, Any]:
        self.session_open = False
        return {"success": True, "message": "weight update session closed"}

    async def update(self, body: UpdateWeightsFromDistributedBody) -> dict[str, Any]:
        if not self.session_open:
            raise WeightUpdateError("update_weights_from_distributed must run between begin_weight_update() and "
                                    "end_weight_update()")
        group = self.groups.get(body.group_name)
        if group is None:
            raise WeightUpdateError(f"no weight update group {body.group_name!r} on this engine; call "
                                    "/init_weights_update_group first")
        try:
            spec = BucketSpec(tuple(body.names), tuple(body.dtypes), tuple(tuple(s) for s in body.shapes))
            for d in spec.dtypes:
                dtype_from_name(d)
            if body.load_format == "flattened_bucket":
                spec.offsets()  # misaligned layouts are refused before anything is received
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from exc
        lock = self.update_lock.writer() if not self.engine.paused else contextlib.nullcontext()
        async with lock:
            if body.abort_all_requests:
                await asyncio.to_thread(self.engine.abort, None, "aborted by update_weights_from_distributed")
            version = None if body.weight_version is None else str(body.weight_version)
            await asyncio.to_thread(self._receive_and_load, group, spec, body.load_format, version, body.group_name)
        self.buckets_loaded += 1
        return {"success": True, "message": f"loaded {len(spec.names)} tensors", "weight_version":
                self.engine.weight_version}

    def _receive_and_load(self, group: WeightGroup, spec: BucketSpec, load_format: str | None, version: str | None,
                          name: str) -> None:
        with self._receiving:  # the staging buffer holds one bucket at a time
            arena = self._arena(spec) if load_format == "flattened_bucket" else None
            if arena is not None:
                try:  # straight into the served weights, between two steps
                    self.engine.write_weights(lambda: group.broadcast(arena.buffer, src=0), version)
                except Exception as exc:  # noqa: BLE001 - a dead trainer or a timeout: reported with its cause
                    raise WeightUpdateError(f"broadcast on group {name!r} failed: {failure_cause(exc, 300)}") from exc
                return
            try:
                named = self._receive(group, spec, load_format)
            except Exception as exc:  # noqa: BLE001 - a dead trainer or a timeout: reported with its cause
                raise WeightUpdateError(f"broadcast on group {name!r} failed: {failure_cause(exc, 300)}") from exc
            try:
                self.engine.update_tensors(named, version)
            except ValueError as exc:
                raise WeightUpdateError(f"received tensors do not match the served model: {exc}") from exc

    def _arena(self, spec: BucketSpec) -> WeightArena | None:
        """The arena of this layout (built on its first update), or None when the model cannot live in one."""
        arena = self._arenas.get(spec)
        if arena is None or not arena.intact():
            self._arenas.pop(spec, None)
            arena = self.engine.between_steps(lambda: build_arena(self.engine.runner.model, spec, self.device))
            if arena is None:
                return None
            self._arenas[spec] = arena
            self._staging = None  # not needed while every layout has its arena
        return arena

    def _receive(self, group: WeightGroup, spec: BucketSpec, load_format: str | None) -> dict[str, torch.Tensor]:
        if load_format == "flattened_bucket":
            if self._staging is None or self._staging.numel() < spec.nbytes:
                self._staging = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device)
            buffer = self._staging[: spec.nbytes]
            group.broadcast(buffer, src=0)
            return unflatten(buffer, spec)
        out = {}
        for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype_from_name(dtype), device=self.device)
            group.broadcast(tensor, src=0)
            out[name] = tensor
        return out

    def close(self) -> None:
        for name in list(self.groups):
            with contextlib.suppress(Exception):
                self.destroy_group(name)
