"""RolloutManager: the rollout as a Ray actor.

The rollout itself is assembled without Ray by ``rollout.assembly.build_rollout`` (engine states, routing,
fleet, weight sync, dispatch, scaling, the generation loop); this actor adds what needs Ray: the engine
launcher (engines as Ray actors in placement groups, an eviction notice calling back here), Ray's drain
notices, and object references for the samples it hands to the trainer ranks (``rollout.dispatch.handoff``). Every
method is a thin relay over one part. Start it with :func:`spawn_rollout_manager`.

Its control API (``engines_view``, ``scale_out``, ``scale_in``, ``events``, ``relax_status``...) returns
plain values and raises the typed errors of ``rollout.scaling``; ``rollout.control.manager_client`` is the one
client for it (docs/architecture.md, "Processes and actors").
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any

from relax.cluster.drain import draining_nodes
from relax.engines.backends import engine_backend
from relax.engines.keys import EngineKeys, engine_keys
from relax.engines.sglang import SGLangOptions
from relax.logs import setup_logging
from relax.rollout.assembly import Rollout, build_rollout
from relax.rollout.dispatch.dispatcher import SampleLostError
from relax.rollout.dispatch.generator import Generation
from relax.rollout.dispatch.handoff import hand_off
from relax.rollout.pool.events import EventKind
from relax.rollout.pool.launcher import RayEngineLauncher, resolve_backend, resolve_engine_host
from relax.rollout.refit.broadcast import RayWeightSource
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec
from relax.rollout.settings import RolloutSettings
from relax.training.sharding import BatchPlan
from relax.weights.publication import WeightManifest

log = logging.getLogger("relax.rollout")

#: Concurrent calls the actor serves: every in-flight control call, partition wait and generation relay.
MAX_CONCURRENCY = 10000


def spawn_rollout_manager(settings: RolloutSettings, *, resources: dict[str, float] | None = None,
                          name: str | None = None) -> Any:
    """Start the rollout manager actor (no CPU of its own: it waits on engines). The one way to start it: the
    driver, tests, benchmarks and scenarios all do."""
    import ray

    return ray.remote(RolloutManager).options(name=name, max_concurrency=MAX_CONCURRENCY, num_cpus=0,
                                              resources=resources or None).remote(settings)


def keep_big_blocks_out_of_the_heap(threshold: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold (``M_MMAP_THRESHOLD``) for this process; False where there is no glibc.

    glibc raises the threshold to the largest block freed so far (up to 32 MB), after which the manager's
    step-sized buffers come from its heap and the space they leave stays resident: measured +3.4-6.5 MB a
    minute, all of it free heap (``malloc_trim`` gave 27 MB back). A fixed threshold keeps blocks above it in
    their own mappings, returned to the system when freed. ``MALLOC_MMAP_THRESHOLD_`` set by the user wins.
    """
    import ctypes
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


class RolloutManager:
    def __init__(self, settings: RolloutSettings) -> None:
        from transformers import AutoTokenizer

        keep_big_blocks_out_of_the_heap()
        setup_logging()
        backend = resolve_backend(settings.launch.backend)
        ranks = engine_backend(backend).broadcast_ranks(settings.fleet.gpus_per_engine)
        broadcast = replace(settings.fleet.broadcast, ranks_per_engine=ranks)
        self.settings = settings = replace(settings, fleet=replace(settings.fleet, broadcast=broadcast))
        self._training: dict[str, Any] = {}  # the driver's latest training-step figures (relax_status)
        self._weight_source: tuple[Any, RayWeightSource] | None = None  # (trainer rank 0 handle, its source)
        self.rollout: Rollout = build_rollout(
            settings, self._launcher(backend), AutoTokenizer.from_pretrained(settings.model_path),
            drain_notices=draining_nodes, run_status=self._run_status)

    def _launcher(self, backend: str) -> RayEngineLauncher:
        """Engine processes as Ray actors; SIGTERM on one of them reaches :meth:`notify_eviction`."""
        import ray

        launch, fleet = self.settings.launch, self.settings.fleet
        options = engine_backend(backend).options(
            gpus_per_engine=fleet.gpus_per_engine, max_running_requests=launch.max_running_requests,
            extra_args=launch.sglang_extra_args, mem_fraction_static=launch.sglang_mem_fraction_static,
            random_seed=self.settings.data.seed, python=launch.sglang_python)
        if isinstance(options, SGLangOptions):
            options = replace(options, cpu_engines_per_node=launch.engines_per_node)
        me = ray.get_runtime_context().current_actor
        return RayEngineLauncher(backend, fleet.model_path, {
            "options": options,
            "host": resolve_engine_host(launch.host),
            "log_dir": launch.log_dir,
            "env": dict(launch.env),
            "on_eviction": (me, "notify_eviction"),
        }, gpus_per_engine=fleet.gpus_per_engine, keys_for=self.fleet_keys)

    def fleet_keys(self, engine_id: str) -> EngineKeys:
        """Engine ``engine_id``'s own keys (the fleet's rule; the launcher hands them to that engine alone)."""
        fleet = self.settings.fleet
        return engine_keys(fleet.engine_api_key, engine_id, generation=fleet.engine_generation_key)

    # ------------------------------------------------------------------ engines
    async def start_initial_engines(self, bundles: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        """Start one engine per (placement group, bundle index), concurrently; all must come up."""
        self.rollout.executor.settings.initial_engines = len(bundles)
        return await self.rollout.fleet.start_initial(bundles)

    async def notify_eviction(self, engine_id: str) -> None:
        """SIGTERM reached an EngineActor (node reclaimed): drain within the grace period, then remove."""
        await self.rollout.fleet.notify_eviction(engine_id)

    # ------------------------------------------------------------------ weights
    async def publish_weights(self, version: int, bucket_refs: list[Any], manifest: WeightManifest,
                              sender: Any = None) -> None:
        """Record version `version` and apply it to every ACTIVE engine in the background.

        ``sender`` (the trainer's rank 0 actor) means the bytes are held there for broadcast and
        ``bucket_refs`` is empty; otherwise the buckets are in the object store. Returns at once: the
        trainer must not wait for engines to load; the staleness gate is what holds rollout back until the
        engines hold recent enough weights (docs/architecture.md, "Weights and staleness").
        """
        source = None
        if sender is not None:
            if self._weight_source is None or self._weight_source[0] != sender:
                self._weight_source = (sender, RayWeightSource(sender))
            source = self._weight_source[1]
        again = version in self.rollout.weights.versions()  # a retried publication: a no-op, or a WeightConflict
        self.rollout.weight_sync.publish(version, list(bucket_refs), manifest, source=source)
        if not again:
            self.rollout.events.append(EventKind.WEIGHTS_PUBLISHED, message=f"v{version}")

    async def verify_engine(self, engine_id: str) -> dict[str, Any]:
        """Check an ACTIVE engine's served weights against its version's publication now (``--verify-weights``
        applies to loads; this is the check on demand). A mismatch reloads the version once; a second one fails
        the engine. Returns the check
        (``rollout.refit.rules.Verification``). Also ``POST /rollout/engines/{id}/verify``."""
        return await self.rollout.control.verify_engine(engine_id)

    async def wait_weights(self, version: int, timeout: float = 120.0) -> bool:
        """Wait until every ACTIVE engine holds at least `version` (tests and the final summary)."""
        deadline = time.monotonic() + timeout
        while self.rollout.fleet.engine_version() < version:
            if time.monotonic() > deadline:
                return False
            await self.rollout.loop.next_state_change()
        return True

    # ------------------------------------------------------------------ dispatch
    async def generate(self, group_key: str, input_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        """One generation on an ACTIVE engine (``rollout.dispatch.dispatcher``); for callers outside the actor."""
        return await self.rollout.dispatcher.generate(group_key, input_ids, sampling_params)

    async def generate_batch(self, requests: list[tuple[str, list[int], dict[str, Any]]],
                             max_concurrency: int = 64) -> list[Generation]:
        """Many generations (group key, input ids, sampling params) with at most ``max_concurrency`` in flight,
        dispatched inside the manager as the rollout loop does: one Ray call for all of them, not one each
        (``benchmarks/scale_latency.py``, evaluation-style scripts)."""
        gate = asyncio.Semaphore(max(1, int(max_concurrency)))

        async def one(key: str, ids: list[int], params: dict[str, Any]) -> Generation:
            async with gate:
                return await self.rollout.dispatcher.generate(key, ids, params)

        return list(await asyncio.gather(*(one(k, list(ids), dict(p)) for k, ids, p in requests)))

    # ------------------------------------------------------------------ the generation loop and the trainer
    async def start_generation(self, start_step: int = 0, cursor: dict[str, int] | None = None) -> None:
        self.rollout.loop.start(start_step, cursor)

    async def take_step(self, step: int, plan: BatchPlan, timeout: float | None = None,
                        report: dict[str, Any] | None = None, record_samples: bool = False) -> dict[str, Any]:
        """The driver's one call per step: record the previous step's training figures (``report``), wait for
        rollout step ``step`` and hand its samples to the trainer ranks as one object reference per rank
        (``rollout.dispatch.handoff``). Answers the references, the step's metrics and records, and the run status."""
        import ray

        if report is not None:
            self._training = dict(report)
        handoff = hand_off(await self.rollout.loop.take(step, timeout), plan, record_samples=record_samples)
        batch = handoff.batch
        return {
            "step": step, "cursor_end": handoff.cursor_end, "metrics": handoff.metrics, "versions": handoff.versions,
            "shards": [ray.put(shard) for shard in batch.shards], "denominator": batch.denominator,
            "num_micro_batches": batch.num_micro_batches, "aggregation": batch.aggregation.value,
            "response_tokens": handoff.response_tokens, "sample_rows": handoff.sample_rows,
            "status": await self.status(),
        }

    async def evaluate(self) -> dict[str, float]:
        return await self.rollout.loop.evaluate()

    async def report_training(self, metrics: dict[str, Any]) -> None:
        """The driver's latest training-step figures, shown by the control plane's /metrics."""
        self._training = dict(metrics)

    # ------------------------------------------------------------------ observation (driver and tests)
    async def engines(self) -> list[dict[str, Any]]:
        pool, router = self.rollout.pool, self.rollout.router
        for r in pool.records():
            pool.set_in_flight(r.engine_id, router.in_flight(r.engine_id))
        return [r.to_dict() for r in pool.records()]

    async def engine_process(self, engine_id: str) -> dict[str, Any]:
        """The EngineActor's launch info (url, node, server pid) for operators and tests."""
        return dict(await self.rollout.fleet.engine_info(engine_id))

    async def status(self) -> dict[str, Any]:
        """The run's snapshot (``rollout.control.run_status``): what ``relax_status`` and ``/metrics`` read too."""
        return self._run_status()

    def _run_status(self) -> dict[str, Any]:
        return self.rollout.run_status(self._training).to_dict()

    # ------------------------------------------------------------------ control API (REST + autoscaler)
    async def engine_urls(self) -> dict[str, str]:
        return await self.rollout.control.engine_urls()

    async def engines_view(self, model_name: str | None = None) -> dict[str, Any]:
        return await self.rollout.control.engines_view(model_name)

    async def engine_view(self, engine_id: str) -> dict[str, Any]:
        return await self.rollout.control.engine_view(engine_id)

    async def events(self, limit: int = 100, kind: str | None = None) -> dict[str, Any]:
        return await self.rollout.control.events(limit, kind)

    async def recent_events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.rollout.events.newest(limit)]

    async def relax_status(self) -> dict[str, Any]:
        return await self.rollout.control.relax_status()

    async def scale_out(self, spec: ScaleOutSpec) -> dict[str, Any]:
        return await self.rollout.control.scale_out(spec)

    async def scale_in(self, spec: ScaleInSpec) -> dict[str, Any]:
        return await self.rollout.control.scale_in(spec)

    async def list_scale_requests(self, direction: str, status: str | None = None,
                                  model_name: str | None = None) -> list[dict[str, Any]]:
        return await self.rollout.control.list_scale_requests(direction, status, model_name)

    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return await self.rollout.control.get_scale_request(direction, request_id)

    async def cancel_scale_out(self, request_id: str) -> dict[str, Any]:
        return await self.rollout.control.cancel_scale_out(request_id)

    async def cancel_scale_out_batch(self, status_filter: list[str] | None = None,
                                     dry_run: bool = False) -> dict[str, Any]:
        return await self.rollout.control.cancel_scale_out_batch(status_filter, dry_run)

    async def shutdown(self) -> None:
        """Stop generation, every engine (process, actor, owned placement group) and background task."""
        await self.rollout.aclose()
        log.info("rollout manager shut down (pid %d)", os.getpid())


__all__ = ["RolloutManager", "SampleLostError", "spawn_rollout_manager"]
