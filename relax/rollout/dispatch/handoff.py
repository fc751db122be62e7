"""A rollout step handed to the trainer: its samples cut into one shard per trainer rank, and the figures about
them that the driver logs.

The samples go from the rollout manager to the ranks; the driver gets only what it writes: the step's rollout
and staleness metrics, the per-sample version record (``sample_versions.jsonl``) and, with
``--record-samples``, the rows of ``samples.jsonl``. So a sample is not pickled to the driver, rebuilt there and
pickled again to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.data.buffer import staleness_stats
from relax.data.sample import Sample
from relax.rollout.dispatch.generation_loop import Partition
from relax.training.sharding import BatchPlan, ShardedBatch, shard_batch


@dataclass(frozen=True)
class Handoff:
    step: int
    cursor_end: dict[str, int] | None
    metrics: dict[str, float]  # rollout/* and staleness/*
    versions: dict[str, Any]  # the step's line of sample_versions.jsonl
    batch: ShardedBatch
    response_tokens: int
    sample_rows: list[dict[str, Any]] | None = None  # --record-samples: the step's lines of samples.jsonl


def sample_row(step: int, s: Sample) -> dict[str, Any]:
    """What the model wrote, as one line of ``samples.jsonl``."""
    return {
        "step": step, "prompt_index": s.prompt_index, "sample_index": s.sample_index,
        "weight_version": s.weight_version, "weight_version_spans": [list(x) for x in s.weight_version_spans],
        "engine_id": s.engine_id, "finish_reason": s.finish_reason.value, "reward": s.reward, "label": s.label,
        "response_text": s.response_text, "response_token_ids": list(s.response_token_ids),
    }


def hand_off(partition: Partition, plan: BatchPlan, *, record_samples: bool = False) -> Handoff:
    """The step's hand-off; the trainer trains on step ``k`` holding weight version ``k`` (its staleness base)."""
    samples = partition.samples
    stale = staleness_stats(samples, partition.step)
    versions = {
        "step": partition.step,
        "trainer_version": partition.step,
        "sample_versions": [s.weight_version for s in samples],  # the oldest version behind any token
        "sample_version_spans": [[list(span) for span in s.weight_version_spans] for s in samples],
        "prompt_indices": sorted({s.prompt_index for s in samples}),
    }
    return Handoff(
        step=partition.step, cursor_end=partition.cursor_end, metrics={**partition.metrics, **stale.to_metrics()},
        versions=versions, batch=shard_batch([s.to_dict() for s in samples], plan),
        response_tokens=sum(s.response_length for s in samples),
        sample_rows=[sample_row(partition.step, s) for s in samples] if record_samples else None,
    )
