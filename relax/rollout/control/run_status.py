"""The run as the rollout sees it, in one snapshot: one shape for every reader.

The driver's step row, ``RolloutManager.status()``, ``relax_status`` (the REST status, the autoscaler's
signals) and Relax's ``/metrics`` all read this record, so a figure has one name wherever it is read. The
training-side figures (step, staleness, the trainer's wait) are what the driver last reported; the rest is the
rollout's own, read when the snapshot is taken (``rollout.assembly.Rollout.run_status``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunStatus:
    # reported by the driver after each step
    training_step: int = 0
    num_rollout: int = 0
    rollout_tokens_per_s: float = 0.0
    staleness_mean: float = 0.0
    trainer_wait_fraction: float = 0.0
    # the rollout's own
    staleness_blocked_fraction: float = 0.0
    buffer_waiting_partitions: int = 0
    engine_weight_version: int = -1  # the oldest version an ACTIVE engine holds (-1: none ACTIVE)
    active_engines: int = 0
    latest_published: int = 0
    tokens_generated: int = 0
    #: requests continued on another engine and their tokens kept / regenerated (``dispatcher.MigrationStats``)
    migration: Mapping[str, Any] = field(default_factory=dict)
    dropped_prompts: int = 0  # prompts the engines could not serve, dropped at load (rollout.generation_loop)
    refused_groups: int = 0  # groups an engine refused mid-run (a client error), dropped
    verify_weights: str = "first"
    weight_verifications: Mapping[str, int] = field(default_factory=dict)
    weight_syncs: Mapping[str, Any] = field(default_factory=dict)
    last_verifications: Mapping[str, Any] = field(default_factory=dict)
    evictions: Mapping[str, Any] = field(default_factory=dict)
    joins: Mapping[str, Any] = field(default_factory=dict)
    #: per bring-up phase, its histogram over every engine brought up (``rollout.fleet.bringup.PhaseHistogram``)
    bring_up_phases: Mapping[str, Any] = field(default_factory=dict)
    sglang_router: Mapping[str, Any] | None = None
    # the newest join's and eviction's durations (absent until one happened)
    last_join_active_s: float | None = None
    last_join_first_answer_s: float | None = None
    last_eviction_notice_to_gone_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values; a duration that has not happened yet is left out (``/metrics`` shows nothing, not 0)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "sglang_router"}
