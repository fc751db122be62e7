"""SampleBuffer bookkeeping (synchronous) and its asyncio waiting, plus per-sample staleness."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from relax.data.buffer import (
    BufferClosedError,
    PartitionState,
    SampleBuffer,
    SampleBufferError,
    staleness_stats,
)
from relax.data.sample import PromptGroup, Sample


def make_group(step: int, prompt: int, n: int = 2, version: int = 0) -> PromptGroup:
    gid = f"s{step}-p{prompt}"
    return PromptGroup.from_samples(
        [
            Sample(
                prompt_index=prompt,
                group_id=gid,
                sample_index=i,
                prompt_token_ids=[1, 2],
                response_token_ids=[3, 4, 5],
                response_text="abc",
                label="1",
                weight_version=version,
                rollout_step=step,
            )
            for i in range(n)
        ]
    )


def test_partition_lifecycle() -> None:
    buf = SampleBuffer()
    buf.open_partition(0, expected_groups=2)
    assert buf.put_group(0, make_group(0, 0, n=3)) is PartitionState.FILLING
    info = buf.info(0)
    assert (info.num_groups, info.num_samples, info.fill) == (1, 3, 0.5)
    assert buf.num_waiting_partitions() == 1
    with pytest.raises(SampleBufferError, match="not complete"):
        buf.take_partition(0)
    assert buf.put_group(0, make_group(0, 1, n=3)) is PartitionState.COMPLETE  # filled up
    buf.mark_complete(0)  # idempotent
    groups = buf.take_partition(0)
    assert [g.group_id for g in groups] == ["s0-p0", "s0-p1"]
    assert buf.info(0).state is PartitionState.TAKEN and buf.num_waiting_partitions() == 0
    with pytest.raises(SampleBufferError, match="taken"):
        buf.take_partition(0)
    buf.clear(0)
    assert 0 not in buf and buf.num_samples() == 0


def test_several_partitions_sizes() -> None:
    buf = SampleBuffer()
    for step in (2, 1):
        buf.open_partition(step)
        buf.put_group(step, make_group(step, 0, n=4))
    assert buf.steps == [1, 2]
    assert buf.num_samples() == 8 and buf.num_groups() == 2 and buf.num_samples(1) == 4
    assert buf.fill(1) is None  # size not known
    buf.mark_complete(1)
    assert [buf.info(s).state for s in buf.steps] == [PartitionState.COMPLETE, PartitionState.FILLING]


def test_misuse_is_named() -> None:
    buf = SampleBuffer()
    with pytest.raises(SampleBufferError, match="no partition for rollout step 3"):
        buf.put_group(3, make_group(3, 0))
    buf.open_partition(0, expected_groups=3)
    with pytest.raises(SampleBufferError, match="already open"):
        buf.open_partition(0)
    with pytest.raises(SampleBufferError, match="belongs to rollout step 1"):
        buf.put_group(0, make_group(1, 0))
    buf.put_group(0, make_group(0, 0))
    with pytest.raises(SampleBufferError, match="already in partition"):
        buf.put_group(0, make_group(0, 0))
    with pytest.raises(SampleBufferError, match="1 of 3 expected"):
        buf.mark_complete(0)
    buf.mark_complete(0, allow_partial=True)
    with pytest.raises(SampleBufferError, match="complete; cannot add"):
        buf.put_group(0, make_group(0, 1))
    buf.open_partition(1)
    with pytest.raises(SampleBufferError, match="empty"):
        buf.mark_complete(1)
    with pytest.raises(SampleBufferError):
        buf.open_partition(2, expected_groups=0)


def test_staleness_stats() -> None:
    groups = [make_group(0, 0, n=2, version=3), make_group(0, 1, n=1, version=5)]
    st = staleness_stats(groups, trainer_version=5)
    assert (st.count, st.min, st.max, st.histogram) == (3, 0, 2, {0: 1, 2: 2})
    assert st.mean == pytest.approx(4 / 3)
    assert st.to_metrics()["staleness/max"] == 2.0
    assert staleness_stats(list(groups[0].samples), 4).histogram == {1: 2}
    assert staleness_stats([], 0).count == 0


async def test_wait_for_partition_wakes_on_completion() -> None:
    buf = SampleBuffer()
    await buf.open_partition_async(0, expected_groups=2)
    waiter = asyncio.create_task(buf.wait_for_partition(0))
    await asyncio.sleep(0)
    await buf.put_group_async(0, make_group(0, 0))
    await asyncio.sleep(0)
    assert not waiter.done()
    await buf.put_group_async(0, make_group(0, 1))
    groups = await asyncio.wait_for(waiter, 1.0)
    assert len(groups) == 2 and buf.info(0).state is PartitionState.TAKEN


async def test_wait_without_take_and_explicit_complete() -> None:
    buf = SampleBuffer()
    await buf.open_partition_async(4)
    waiter = asyncio.create_task(buf.wait_for_partition(4, take=False))
    await buf.put_group_async(4, make_group(4, 0))
    await buf.mark_complete_async(4)
    assert len(await asyncio.wait_for(waiter, 1.0)) == 1
    assert buf.info(4).state is PartitionState.COMPLETE


async def test_wait_for_predicate_timeout_and_close() -> None:
    buf = SampleBuffer()
    await buf.open_partition_async(0)
    await buf.put_group_async(0, make_group(0, 0))
    await buf.mark_complete_async(0)
    # the rollout side waits for the trainer to take partitions (gate's waiting count going down)
    drained = asyncio.create_task(buf.wait_for(lambda b: b.num_waiting_partitions() == 0))
    await asyncio.sleep(0)
    await buf.take_partition_async(0)
    await asyncio.wait_for(drained, 1.0)
    await buf.clear_async(0)

    with pytest.raises(asyncio.TimeoutError):
        await buf.wait_for_partition(1, timeout=0.01)
    waiter = asyncio.create_task(buf.wait_for_partition(1))
    await asyncio.sleep(0)
    await buf.close()
    with pytest.raises(BufferClosedError):
        await asyncio.wait_for(waiter, 1.0)
    with pytest.raises(BufferClosedError):
        buf.open_partition(5)


# ---- the records the buffer holds ----------------------------------------------------------------


def test_sample_normalises_and_validates() -> None:
    s = Sample(
        0,
        "g",
        0,
        [1],
        [2, 3],
        "ab",
        "1",
        weight_version=2,
        rollout_step=1,
        rollout_log_probs=[-0.5, -1],
        finish_reason={"type": "length", "length": 2},
    )
    assert s.loss_mask == (1, 1) and s.rollout_log_probs == (-0.5, -1.0)
    assert s.truncated and s.response_length == 2 and s.num_loss_tokens == 2 and s.staleness(5) == 3
    assert Sample.from_dict(s.to_dict()) == s
    assert s.with_advantage(1).advantage == 1.0 and s.advantage is None  # frozen: derive, never mutate
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2"):
        Sample(0, "g", 0, [1], [2, 3], "ab", "1", weight_version=0, rollout_step=0, loss_mask=[1])
    with pytest.raises(ValueError, match="rollout_log_probs has 1"):
        Sample(0, "g", 0, [1], [2, 3], "ab", "1", weight_version=0, rollout_step=0, rollout_log_probs=[0.0])
    with pytest.raises(TypeError, match="ints"):
        Sample(0, "g", 0, [1.5], [2], "ab", "1", weight_version=0, rollout_step=0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="unknown finish reason"):
        Sample(0, "g", 0, [1], [2], "ab", "1", weight_version=0, rollout_step=0, finish_reason="eos")  # type: ignore[arg-type]


def test_prompt_group_consistency() -> None:
    g = make_group(0, 0, n=3)
    assert len(g) == 3 and g.num_tokens == 9
    rewarded = [dataclasses.replace(s, reward=r) for s, r in zip(g, (1.0, 0.0, 1.0), strict=True)]
    scored = PromptGroup.from_samples(rewarded)
    assert scored.rewards == [1.0, 0.0, 1.0]
    assert [s.advantage for s in scored.with_advantages([0.5, -1, 0.5])] == [0.5, -1.0, 0.5]
    with pytest.raises(ValueError, match="does not belong"):
        PromptGroup("other", 0, 0, g.samples)
    with pytest.raises(ValueError):
        PromptGroup.from_samples([])
    with pytest.raises(ValueError, match="2 advantages for 3"):
        scored.with_advantages([1, 0])
