"""The trainer group: N ``TrainerActor`` ranks in one placement group, driven as one trainer.

(docs/architecture.md, "Training".)

The driver sees a single object: ``train_step(samples)`` splits the global batch contiguously over the
ranks, hands every rank the global loss denominator and the common number of micro-batches (FSDP's
collectives need every rank to run the same number of passes), and reduces the ranks' metrics. Every
call waits on all ranks with ``ray.wait`` and fails fast: the first rank that raises surfaces as a
``TrainerRankError`` naming the rank, the method and the cause, instead of the driver hanging on ranks
that are stuck in a collective with the dead one. After such an error the group is unusable (its
process group is broken); ``shutdown()`` it and build a new one (from a checkpoint).

The group does not own the placement group: the caller creates it (one ``{GPU: 1, CPU: 1}`` bundle per
rank) and removes it after ``shutdown()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from relax.logs import failure_cause
from relax.training.actor import SUM_METRICS, TrainerActor, TrainerConfig
from relax.training.sharding import (
    BatchPlan,
    LossAggregation,
    check_samples,
    micro_batch_count,
    shard_batch,
    split_evenly,
)
from relax.weights.publication import WEIGHTS_CONCURRENCY_GROUP

__all__ = ["TrainerGroup", "TrainerRankError", "TrainerTimeoutError", "reduce_rank_metrics"]

logger = logging.getLogger(__name__)

#: Metrics every rank reports identically; the group takes rank 0's.
_SHARED_METRICS = frozenset({"grad_norm", "skipped", "step", "lr"})


#: How often a waiting driver checks that every trainer rank still exists (:meth:`TrainerGroup.raise_if_lost`).
PING_INTERVAL_S = 2.0


class TrainerRankError(RuntimeError):
    """A trainer rank raised (or died) during ``method``; ``cause`` is the rank's own exception."""

    def __init__(self, rank: int, method: str, cause: BaseException) -> None:
        self.rank, self.method, self.cause = rank, method, cause
        super().__init__(f"trainer rank {rank} failed in {method}: {failure_cause(cause)}")


class TrainerTimeoutError(TimeoutError):
    """Some ranks did not answer ``method`` within the timeout (a hung collective or a lost node)."""


def _unwrap(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _as_dict(sample: Any) -> dict[str, Any]:
    if isinstance(sample, Mapping):
        return dict(sample)
    if hasattr(sample, "to_dict"):
        return sample.to_dict()
    raise TypeError(f"expected a Sample or its dict, got {type(sample).__name__}")


def reduce_rank_metrics(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Ranks' ``train_step`` metrics -> global ones.

    Partial sums (``loss``, ``pg_loss``, counts) are added; metrics every rank shares (``grad_norm``)
    come from rank 0; ``step_time_s`` and ``peak_memory_mb`` are the largest rank's; all others are token
    means on each rank and are combined weighted by each rank's loss tokens.
    """
    if not per_rank:
        return {}
    out: dict[str, float] = {}
    tokens = [float(m.get("num_tokens", 0.0)) for m in per_rank]
    total_tokens = sum(tokens)
    keys = {k for m in per_rank for k in m}
    for key in sorted(keys):
        values = [float(m[key]) for m in per_rank if key in m]
        if key in SUM_METRICS:
            out[key] = sum(values)
        elif key in _SHARED_METRICS:
            out[key] = float(per_rank[0].get(key, values[0]))
        elif key in ("step_time_s", "peak_memory_mb"):
            out[key] = max(values)
        else:
            weighted = sum(float(m[key]) * t for m, t in zip(per_rank, tokens, strict=True) if key in m)
            out[key] = weighted / total_tokens if total_tokens > 0 else sum(values) / len(values)
    return out


class TrainerGroup:
    """``world_size`` trainer ranks, one per placement-group bundle, joined into one FSDP2 job."""

    def __init__(
        self,
        config: TrainerConfig,
        placement_group: Any,
        *,
        bundle_indices: Sequence[int] | None = None,
        init_timeout_s: float = 600.0,
        call_timeout_s: float | None = 1800.0,
        while_starting: Callable[[], None] | None = None,
    ) -> None:
        """``while_starting`` is called about twice a second while the ranks initialise; an exception it raises
        (the driver's stop on SIGTERM) abandons the start: the ranks are shut down and it propagates."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.call_timeout_s = call_timeout_s
        specs = list(placement_group.bundle_specs)
        indices = list(range(len(specs))) if bundle_indices is None else list(bundle_indices)
        if not indices:
            raise ValueError("a trainer group needs at least one bundle")
        # "weights": rank 0's broadcast sends (relax.training.sender) run on threads of their own, beside a step.
        remote_cls = ray.remote(concurrency_groups={WEIGHTS_CONCURRENCY_GROUP: 16})(TrainerActor)
        self._actors: list[Any] = []
        t0 = time.perf_counter()
        try:
            for idx in indices:
                bundle = specs[idx]
                self._actors.append(remote_cls.options(
                    num_cpus=min(1.0, float(bundle.get("CPU", 0.0))),
                    num_gpus=1 if bundle.get("GPU", 0) >= 1 else 0,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=placement_group, placement_group_bundle_index=idx),
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
                ).remote())
            def gather(refs: list[Any], method: str) -> list[Any]:
                return self._gather(refs, method, init_timeout_s, while_waiting=while_starting)

            addr = gather([self._actors[0].node_ip.remote()], "node_ip")[0]
            port = gather([self._actors[0].free_port.remote()], "free_port")[0]
            n = len(self._actors)
            self.ranks_info = gather([a.init.remote(r, n, addr, port, config) for r, a in enumerate(self._actors)],
                                     "init")
        except BaseException:
            self.shutdown()
            raise
        logger.info("trainer group: %d ranks ready (master %s:%d) in %.1fs", n, addr, port,
                    time.perf_counter() - t0)
        self._pings: dict[int, tuple[Any, float]] = {}  # rank -> (its liveness check in flight, when sent)

    def raise_if_lost(self) -> None:
        """Raise :class:`TrainerRankError` once a rank's process is gone (Ray's memory monitor, the OOM killer, a
        lost node), without waiting: a driver that waits for the rollout must not wait on, for the whole partition
        timeout, a trainer that no longer exists (the engines can get no newer weights from it).

        Each rank has at most one small call in flight (``node_ip``, on its weights threads so it never queues
        behind a step), renewed every :data:`PING_INTERVAL_S`; a dead actor fails it at once."""
        import ray

        now = time.monotonic()
        for rank, actor in enumerate(self._actors):
            ping = self._pings.get(rank)
            if ping is not None:
                if not ray.wait([ping[0]], timeout=0)[0]:
                    continue
                try:
                    ray.get(ping[0])
                except Exception as exc:  # noqa: BLE001 - re-raised with the rank attached; the caller says it
                    raise TrainerRankError(rank, "its liveness check", _unwrap(exc)) from exc
                if now - ping[1] < PING_INTERVAL_S:
                    continue
            self._pings[rank] = (actor.node_ip.options(concurrency_group=WEIGHTS_CONCURRENCY_GROUP).remote(), now)

    # ---- plumbing

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def _gather(self, refs: Sequence[Any], method: str, timeout_s: float | None,
                while_waiting: Callable[[], None] | None = None) -> list[Any]:
        """Results in rank order; the first failing rank raises at once (no waiting on the others).

        ``while_waiting`` is called between polls of half a second; whatever it raises ends the wait."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            poll = remaining if while_waiting is None else min(0.5, 0.5 if remaining is None else remaining)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll)
            if not ready and while_waiting is not None and (deadline is None or time.monotonic() < deadline):
                while_waiting()
                continue
            if not ready:
                ranks = sorted(pending.values())
                raise TrainerTimeoutError(f"trainer ranks {ranks} did not finish {method} within {timeout_s}s")
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - re-raised with the rank attached
                    err = TrainerRankError(rank, method, _unwrap(exc))
                    logger.error("trainer group: %s", err)
                    raise err from exc
        return results

    def _call_all(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        if not self._actors:
            raise RuntimeError("the trainer group has been shut down")
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self._actors]
        return self._gather(refs, method, timeout_s if timeout_s is not None else self.call_timeout_s)

    def _call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        if not self._actors:
            raise RuntimeError("the trainer group has been shut down")
        refs = [getattr(a, method).remote(shard, *args, **kwargs)
                for a, shard in zip(self._actors, shards, strict=True)]
        return self._gather(refs, method, self.call_timeout_s)

    # ---- training

    def train_step(
        self, samples: Sequence[Any], *, aggregation: LossAggregation | str | None = None
    ) -> dict[str, float]:
        """One optimizer step on a global batch of ``Sample``s (or their dicts); returns global metrics.

        ``loss``/``pg_loss`` are the global batch's loss, ``num_tokens``/``num_samples`` its sizes,
        ``grad_norm`` the norm before clipping, the rest token means over the batch; ``wall_time_s`` is the
        driver-side time of the step. ``aggregation`` overrides the configured token/sample mean.
        """
        t0 = time.perf_counter()
        batch = shard_batch([_as_dict(s) for s in samples], self.batch_plan(),
                            LossAggregation(aggregation) if aggregation is not None else None)
        return self.train_sharded(batch.shards, batch.denominator, batch.num_micro_batches, batch.aggregation,
                                  began=t0)

    def batch_plan(self) -> BatchPlan:
        """What whoever shards a global batch for this group must know (``batching.shard_batch``)."""
        return BatchPlan(world_size=self.world_size, micro_batch_size=self.config.micro_batch_size,
                         aggregation=self.config.aggregation, need_rollout_log_probs=self.config.use_tis,
                         max_tokens=self.config.token_budget, balance_tokens=self.config.balance_data)

    def train_sharded(self, shards: Sequence[Any], denominator: float, num_micro_batches: int,
                      aggregation: LossAggregation | str, *, began: float | None = None) -> dict[str, float]:
        """One optimizer step on a batch already cut by ``batching.shard_batch``: one shard per rank, each a list
        of sample dicts or a Ray object reference to one (the rank fetches it; the driver never holds it)."""
        t0 = time.perf_counter() if began is None else began
        per_rank = self._call_sharded("train_step", shards, denominator, num_micro_batches=num_micro_batches,
                                      aggregation=LossAggregation(aggregation).value)
        metrics = reduce_rank_metrics(per_rank)
        metrics["wall_time_s"] = time.perf_counter() - t0
        logger.debug("trainer group: step %d, %d samples, loss %.5f, grad_norm %.4f, %.3fs",
                     int(metrics.get("step", 0)), int(metrics.get("num_samples", 0)), metrics.get("loss", 0.0),
                     metrics.get("grad_norm", 0.0), metrics["wall_time_s"])
        return metrics

    def compute_log_probs(self, samples: Sequence[Any]) -> list[list[float]]:
        """Trainer log-probs of each response token (rollout temperature), in the order of ``samples``."""
        dicts = [_as_dict(s) for s in samples]
        check_samples(dicts, need_advantages=False)
        shards = split_evenly(dicts, self.world_size)
        per_rank = self._call_sharded("compute_log_probs", shards,
                                      num_micro_batches=micro_batch_count(shards, self.batch_plan()))
        return [lp for rank_lps in per_rank for lp in rank_lps]

    # ---- weights and checkpoints

    def full_state_dict(self) -> dict[str, Any]:
        """Full CPU float32 weights with HF names (gathered by all ranks, returned by rank 0)."""
        t0 = time.perf_counter()
        state = self._call_all("full_state_dict")[0]
        logger.info("trainer group: full state dict (%d tensors) in %.3fs", len(state), time.perf_counter() - t0)
        return state

    def hold_weights(self, version: int, *, dtype: str | None = None, backend: str = "gloo",
                     bucket_bytes: int | None = None, layout: str = "hf") -> Any:
        """Gather the full weights and keep them on rank 0 for broadcast as ``version``; returns the manifest.

        The bytes stay in rank 0 (``sender``); the rollout manager asks it for each bucket per engine.
        """
        t0 = time.perf_counter()
        extra = {"layout": layout} if bucket_bytes is None else {"bucket_bytes": bucket_bytes, "layout": layout}
        manifest = self._call_all("hold_weights", version, dtype, backend, **extra)[0]
        logger.debug("trainer group: v%d held for broadcast (%d tensors, %.1f MiB) in %.3fs", version,
                    manifest.num_tensors, manifest.total_bytes / 2**20, time.perf_counter() - t0)
        return manifest

    @property
    def sender(self) -> Any:
        """Rank 0's actor handle: the sender of broadcast weight updates."""
        if not self._actors:
            raise RuntimeError("the trainer group has been shut down")
        return self._actors[0]

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        """Checkpoint to ``path`` (HF weights + optimizer + ``extra`` JSON); see ``relax.training.checkpoint``."""
        self._call_all("save_checkpoint", str(path), dict(extra or {}))
        return Path(path)

    def load(self, path: str | Path) -> dict:
        """Restore weights, optimizer state and step from ``path``; returns the saved ``extra``."""
        return self._call_all("load_checkpoint", str(path))[0]

    def info(self) -> list[dict[str, Any]]:
        return self._call_all("info", timeout_s=60.0)

    # ---- lifecycle

    def shutdown(self) -> None:
        """Kill every rank (idempotent). Killing, not a graceful collective, so a broken group cannot hang it."""
        import ray

        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - best effort: the actor may already be gone
                logger.warning("trainer group: killing a rank failed: %s", exc)
        if actors:
            logger.info("trainer group: %d ranks shut down", len(actors))

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
