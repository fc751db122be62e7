"""The sample buffer between rollout and trainer: one partition per rollout step.

Rollout step ``k`` opens partition ``k``, puts finished prompt groups into it and completes it; trainer
step ``k`` waits for partition ``k``, takes it, and clears it after publishing the next weights.
Partitions are independent so that several steps can be in flight (bounded by the staleness gate) and
the trainer always trains on exactly the step it expects.

All bookkeeping lives in plain synchronous methods (testable without an event loop). The buffer is used
inside an asyncio actor, so there are ``*_async`` twins of the mutators that also wake waiters, and
``wait_for_partition`` / ``wait_for`` built on an ``asyncio.Condition``. Inside the actor, mutate through
the ``*_async`` methods; a plain mutator call wakes no one.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from relax.data.sample import PromptGroup, Sample

__all__ = [
    "BufferClosedError",
    "PartitionInfo",
    "PartitionState",
    "SampleBuffer",
    "SampleBufferError",
    "StalenessStats",
    "sample_staleness",
    "staleness_stats",
]


class SampleBufferError(RuntimeError):
    """A buffer operation does not fit the partition's state (a bug in the caller, named clearly)."""


class BufferClosedError(SampleBufferError):
    """The buffer was closed (shutdown) while someone waited on it."""


class PartitionState(str, Enum):
    FILLING = "filling"  # rollout is still adding groups
    COMPLETE = "complete"  # every group is in; the trainer may take it
    TAKEN = "taken"  # the trainer is training on it; cleared once the next weights are published


@dataclass
class _Partition:
    step: int
    expected_groups: int | None
    state: PartitionState = PartitionState.FILLING
    groups: list[PromptGroup] = field(default_factory=list)
    group_ids: set[str] = field(default_factory=set)
    num_samples: int = 0


@dataclass(frozen=True)
class PartitionInfo:
    step: int
    state: PartitionState
    num_groups: int
    num_samples: int
    expected_groups: int | None

    @property
    def fill(self) -> float | None:
        """Share of the expected groups present (None when the size is not known in advance)."""
        if not self.expected_groups:
            return None
        return self.num_groups / self.expected_groups


class SampleBuffer:
    def __init__(self) -> None:
        self._parts: dict[int, _Partition] = {}
        self._closed = False
        self._cond: asyncio.Condition | None = None  # created lazily inside the running loop

    # ---- plain bookkeeping -------------------------------------------------------------------------

    def _get(self, step: int) -> _Partition:
        try:
            return self._parts[step]
        except KeyError:
            raise SampleBufferError(f"no partition for rollout step {step}") from None

    def open_partition(self, step: int, expected_groups: int | None = None) -> None:
        """Start partition ``step``. With ``expected_groups`` it completes itself when that many arrive."""
        if self._closed:
            raise BufferClosedError("the sample buffer is closed")
        if step < 0:
            raise SampleBufferError(f"rollout step must be >= 0, got {step}")
        if expected_groups is not None and expected_groups <= 0:
            raise SampleBufferError(f"expected_groups must be > 0, got {expected_groups}")
        if step in self._parts:
            raise SampleBufferError(f"partition {step} is already open")
        self._parts[step] = _Partition(step, expected_groups)

    def put_group(self, step: int, group: PromptGroup) -> PartitionState:
        """Add a finished group; returns the partition's state afterwards (COMPLETE when it filled up)."""
        part = self._get(step)
        if part.state is not PartitionState.FILLING:
            raise SampleBufferError(f"partition {step} is {part.state.value}; cannot add group {group.group_id!r}")
        if group.rollout_step != step:
            raise SampleBufferError(
                f"group {group.group_id!r} belongs to rollout step {group.rollout_step}, not {step}"
            )
        if group.group_id in part.group_ids:
            raise SampleBufferError(f"group {group.group_id!r} is already in partition {step}")
        part.groups.append(group)
        part.group_ids.add(group.group_id)
        part.num_samples += len(group)
        if part.expected_groups is not None and len(part.groups) >= part.expected_groups:
            part.state = PartitionState.COMPLETE
        return part.state

    def mark_complete(self, step: int, *, allow_partial: bool = False) -> None:
        """Declare partition ``step`` finished (idempotent once complete).

        Completing before the expected number of groups arrived needs ``allow_partial``: losing groups
        silently would shrink the batch the trainer normalises over.
        """
        part = self._get(step)
        if part.state is PartitionState.COMPLETE:
            return
        if part.state is not PartitionState.FILLING:
            raise SampleBufferError(f"partition {step} is {part.state.value}; cannot complete it")
        if part.expected_groups is not None and len(part.groups) < part.expected_groups and not allow_partial:
            raise SampleBufferError(
                f"partition {step} holds {len(part.groups)} of {part.expected_groups} expected groups; "
                "pass allow_partial=True to complete it anyway"
            )
        if not part.groups:
            raise SampleBufferError(f"partition {step} is empty; nothing to complete")
        part.state = PartitionState.COMPLETE

    def is_complete(self, step: int) -> bool:
        part = self._parts.get(step)
        return part is not None and part.state is PartitionState.COMPLETE

    def take_partition(self, step: int) -> list[PromptGroup]:
        """Hand partition ``step`` to the trainer (it stays, as TAKEN, until ``clear``)."""
        part = self._get(step)
        if part.state is not PartitionState.COMPLETE:
            raise SampleBufferError(f"partition {step} is {part.state.value}, not complete; cannot take it")
        part.state = PartitionState.TAKEN
        return list(part.groups)

    def clear(self, step: int) -> None:
        """Drop partition ``step`` (after the trainer published the weights it produced, or to abandon it)."""
        self._get(step)
        del self._parts[step]

    def groups(self, step: int) -> list[PromptGroup]:
        """The groups in partition ``step`` so far, in arrival order (read-only view for streaming)."""
        return list(self._get(step).groups)

    # ---- sizes -------------------------------------------------------------------------------------

    def __contains__(self, step: object) -> bool:
        return step in self._parts

    @property
    def steps(self) -> list[int]:
        return sorted(self._parts)

    def info(self, step: int) -> PartitionInfo:
        p = self._get(step)
        return PartitionInfo(p.step, p.state, len(p.groups), p.num_samples, p.expected_groups)

    def num_waiting_partitions(self) -> int:
        """Partitions rollout started that the trainer has not taken: what the staleness gate bounds."""
        return sum(p.state is not PartitionState.TAKEN for p in self._parts.values())

    def num_samples(self, step: int | None = None) -> int:
        if step is not None:
            return self._get(step).num_samples
        return sum(p.num_samples for p in self._parts.values())

    def num_groups(self, step: int | None = None) -> int:
        if step is not None:
            return len(self._get(step).groups)
        return sum(len(p.groups) for p in self._parts.values())

    def fill(self, step: int) -> float | None:
        return self.info(step).fill

    # ---- asyncio side ------------------------------------------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _mutate(self, fn: Callable[[], object]) -> object:
        cond = self._condition()
        async with cond:
            result = fn()
            cond.notify_all()
            return result

    async def open_partition_async(self, step: int, expected_groups: int | None = None) -> None:
        await self._mutate(lambda: self.open_partition(step, expected_groups))

    async def put_group_async(self, step: int, group: PromptGroup) -> PartitionState:
        return await self._mutate(lambda: self.put_group(step, group))  # type: ignore[return-value]

    async def mark_complete_async(self, step: int, *, allow_partial: bool = False) -> None:
        await self._mutate(lambda: self.mark_complete(step, allow_partial=allow_partial))

    async def take_partition_async(self, step: int) -> list[PromptGroup]:
        return await self._mutate(lambda: self.take_partition(step))  # type: ignore[return-value]

    async def clear_async(self, step: int) -> None:
        await self._mutate(lambda: self.clear(step))

    async def close(self) -> None:
        """Shut down: every current and future waiter gets ``BufferClosedError``."""

        def _close() -> None:
            self._closed = True

        await self._mutate(_close)

    async def wait_for(self, predicate: Callable[[SampleBuffer], bool], timeout: float | None = None) -> None:
        """Wait until ``predicate(buffer)`` holds (re-checked after every async mutation)."""
        cond = self._condition()

        def ready() -> bool:
            return self._closed or predicate(self)

        async def _wait() -> None:
            async with cond:
                await cond.wait_for(ready)

        await asyncio.wait_for(_wait(), timeout)
        if self._closed and not predicate(self):
            raise BufferClosedError("the sample buffer was closed while waiting")

    async def wait_for_partition(
        self, step: int, timeout: float | None = None, *, take: bool = True
    ) -> list[PromptGroup]:
        """Wait until partition ``step`` is complete, then take it for the trainer (or, with
        ``take=False``, only return its groups).

        Raises ``asyncio.TimeoutError`` after ``timeout`` seconds and ``BufferClosedError`` on close.
        """
        await self.wait_for(lambda b: b.is_complete(step), timeout)
        if not take:
            return self.groups(step)
        return await self.take_partition_async(step)


# ---- staleness of samples ------------------------------------------------------------------------


def sample_staleness(sample: Sample, trainer_version: int) -> int:
    """Trainer version minus the version that generated the sample (0 = on-policy)."""
    return sample.staleness(trainer_version)


@dataclass(frozen=True)
class StalenessStats:
    count: int
    mean: float
    min: int
    max: int
    histogram: dict[int, int]  # staleness -> number of samples

    def to_metrics(self, prefix: str = "staleness/") -> dict[str, float]:
        return {
            f"{prefix}mean": self.mean,
            f"{prefix}min": float(self.min),
            f"{prefix}max": float(self.max),
        }


def staleness_stats(samples: Iterable[Sample] | Sequence[PromptGroup], trainer_version: int) -> StalenessStats:
    """Summarise per-sample staleness over samples (or over the samples of prompt groups)."""
    values: list[int] = []
    for item in samples:
        if isinstance(item, PromptGroup):
            values.extend(s.staleness(trainer_version) for s in item.samples)
        else:
            values.append(item.staleness(trainer_version))
    if not values:
        return StalenessStats(0, 0.0, 0, 0, {})
    hist: dict[int, int] = {}
    for v in values:
        hist[v] = hist.get(v, 0) + 1
    return StalenessStats(len(values), statistics.fmean(values), min(values), max(values), dict(sorted(hist.items())))
