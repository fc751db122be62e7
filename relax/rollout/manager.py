"""RolloutManager: the Ray actor that owns the engines and fills the sample buffer.

It composes the parts and runs the generation loop; each decision lives elsewhere: engine states in
``rollout.pool``, routing in ``rollout.router``, bring-up/health/drain/eviction in ``rollout.fleet``
(over the Ray launcher of ``rollout.launcher``), scale requests in ``rollout.executor``, the staleness rule
in ``data.staleness``, partitions in ``data.buffer`` and group assembly in ``rollout.generator``
(docs/architecture.md, "Processes and actors").

Its control API (``engines_view``, ``scale_out``, ``scale_in``, ``events``, ``relax_status``...) returns
plain values and raises the typed errors of ``rollout.scaling``; ``rollout.manager_client`` is the one
client for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relax.cluster.drain import draining_nodes
from relax.config.verify_weights import VerifyPolicy
from relax.data.buffer import SampleBuffer
from relax.data.dataset import PromptCursor, PromptStream, load_prompt_data
from relax.data.rewards import get_reward_fn
from relax.data.sample import PromptGroup
from relax.data.staleness import StalenessGate
from relax.engines.backends import engine_backend
from relax.engines.keys import EngineKeys, engine_keys
from relax.engines.sglang import SGLangOptions
from relax.logs import setup_logging
from relax.rollout.broadcast import BroadcastSettings, RayWeightSource
from relax.rollout.control import RolloutControl
from relax.rollout.dispatcher import Dispatcher, DispatchSettings, SampleLostError
from relax.rollout.events import EventKind, EventLog, transition_recorder
from relax.rollout.executor import ScaleExecutor, ScalingSettings
from relax.rollout.fleet import EngineFleet, FleetSettings
from relax.rollout.generator import Generation, SamplingSettings, generate_group
from relax.rollout.launcher import RayEngineLauncher, resolve_backend, resolve_engine_host
from relax.rollout.pool import EnginePool, EngineRecord, EngineState
from relax.rollout.router import RetryPolicy, Router
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec
from relax.training.evaluation import evaluate_datasets
from relax.weights.pause_mode import PauseMode
from relax.weights.publication import WeightManifest, WeightRegistry

log = logging.getLogger("relax.rollout")


@dataclass(frozen=True)
class ManagerConfig:
    model_path: str
    prompt_data: str
    num_rollout: int
    rollout_batch_size: int
    sampling: SamplingSettings
    max_staleness: int = 1
    backend: str = "auto"
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    rm_type: str | None = None
    custom_rm_path: str | None = None
    scale_by_std: bool = True
    eval_datasets: tuple[tuple[str, str], ...] = ()
    eval_sampling: SamplingSettings | None = None
    max_running_requests: int = 64
    request_timeout_s: float = 300.0
    max_attempts: int = 4
    engine_log_dir: str | None = None
    engine_env: dict[str, str] = field(default_factory=dict)
    gpus_per_engine: int = 1
    max_engines: int | None = None  # the autoscaler's ceiling, when configured
    scale_out_timeout_s: float = 300.0
    partial_success_policy: str = "rollback_all"
    scale_in_drain_timeout_s: float = 30.0
    scale_in_shutdown_timeout_s: float = 30.0
    health_timeout_s: float = 120.0
    weight_sync_pause_mode: PauseMode = PauseMode.RETRACT
    # Broadcast weight updates (versions published with a sender): group backend and per-step deadline
    weight_broadcast_backend: str = "gloo"
    weight_broadcast_timeout_s: float = 60.0
    verify_weights: VerifyPolicy = VerifyPolicy.FIRST  # --verify-weights (relax.rollout.refit)
    # A request aborted because its engine left continues on another engine from where it stopped
    # (relax.rollout.migration) instead of starting again; False: start again (the tokens are regenerated)
    migrate_in_flight: bool = True
    # Generate streamed, so the prefix of every generation in flight is held and survives its engine dying
    # without notice (relax.rollout.dispatcher), in chunks of at least `stream_interval` tokens (a crash loses less
    # than one chunk per request; rollout.dispatch.stream_interval widens them for long budgets)
    stream_generations: bool = True
    stream_interval: int = 8
    stream_min_tokens: int = 64  # shorter budgets are sent unstreamed: a crash costs them at most this many tokens
    # The engines' secret (SGLang's --api-key; the built-in engine's RELAX_ENGINE_API_KEY): every engine is
    # started with it and every engine call carries it. The driver always sets one (relax.engines.sglang.engine_secret).
    engine_api_key: str | None = field(default=None, repr=False)  # the run's secret: each engine's keys come from it
    engine_generation_key: str | None = field(default=None, repr=False)  # the user's generation key for all engines
    engines_per_node: int = 1  # how many engines share a node's cores (SGLang on CPU binds each to its share)
    external_engine_api_key: str | None = field(default=None, repr=False)  # for engines attached by URL
    engine_host: str = "auto"
    sglang_mem_fraction_static: float | None = None
    sglang_extra_args: tuple[str, ...] = ()
    sglang_python: str | None = None  # the interpreter that runs SGLang's server (--sglang-python); None = the actor's
    sglang_router_url: str | None = None  # an external SGLang router that mirrors the routable engines
    sglang_router_api_key: str | None = field(default=None, repr=False)  # that router's own --api-key, if any


def _max_context(model_path: str) -> int | None:
    """The engines' context length (one model everywhere): what a migrated prefix must fit."""
    try:
        import json

        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
        return int(value) if value else None
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class _StepStats:
    started: float
    finished: float | None = None
    cursor_end: dict[str, int] | None = None




class RolloutManager:
    def __init__(self, config: ManagerConfig) -> None:
        from transformers import AutoTokenizer

        setup_logging()
        self.cfg = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.dataset = load_prompt_data(
            config.prompt_data,
            config.input_key,
            config.label_key,
            tokenizer=self.tokenizer,
            apply_chat_template=config.apply_chat_template,
        )
        self.eval_data = {
            name: load_prompt_data(
                path,
                config.input_key,
                config.label_key,
                tokenizer=self.tokenizer,
                apply_chat_template=config.apply_chat_template,
            )
            for name, path in config.eval_datasets
        }
        self.reward_fn = get_reward_fn(config.rm_type or "tiny", config.custom_rm_path)
        self.event_log = EventLog(time.time)
        self.weights = WeightRegistry()
        record = transition_recorder(self.event_log, lambda: self.weights.latest_version)

        def on_transition(rec: EngineRecord, src: EngineState, dst: EngineState) -> None:
            record(rec, src, dst)
            self.dispatcher.on_transition(rec, src, dst)

        self.pool = EnginePool(time.time, on_transition=on_transition)
        self.router = Router()
        self.buffer = SampleBuffer()
        self.gate = StalenessGate(config.max_staleness, time.monotonic)
        self._state_changed = asyncio.Event()
        self.fleet = EngineFleet(
            self.pool, self.router, self.event_log, self.weights, self._launcher(),
            FleetSettings(model_path=config.model_path, gpus_per_engine=config.gpus_per_engine,
                          request_timeout_s=config.request_timeout_s, health_timeout_s=config.health_timeout_s,
                          drain_timeout_s=config.scale_in_drain_timeout_s,
                          shutdown_timeout_s=config.scale_in_shutdown_timeout_s,
                          weight_sync_pause_mode=PauseMode(config.weight_sync_pause_mode),
                          verify_weights=VerifyPolicy(config.verify_weights),
                          engine_api_key=config.engine_api_key,
                          engine_generation_key=config.engine_generation_key,
                          external_engine_api_key=config.external_engine_api_key,
                          sglang_router_url=config.sglang_router_url,
                          sglang_router_api_key=config.sglang_router_api_key,
                          broadcast=BroadcastSettings(
                              backend=config.weight_broadcast_backend, timeout_s=config.weight_broadcast_timeout_s,
                              ranks_per_engine=engine_backend(resolve_backend(config.backend)).broadcast_ranks(
                                  config.gpus_per_engine))),
            on_change=self._state_changed.set,
            drain_notices=draining_nodes,
        )
        eos = self.tokenizer.eos_token_id
        self.dispatcher = Dispatcher(
            self.router, self.pool, self.fleet, RetryPolicy(max_attempts=config.max_attempts),
            DispatchSettings(request_timeout_s=config.request_timeout_s, migrate=config.migrate_in_flight,
                             stream=config.stream_generations, stream_interval=config.stream_interval,
                             stream_min_tokens=config.stream_min_tokens,
                             eos_ids=frozenset() if eos is None else frozenset({int(eos)}),
                             max_context=_max_context(config.model_path)))
        self.executor = ScaleExecutor(
            self.pool, self.fleet, self.event_log,
            ScalingSettings(max_engines=config.max_engines, scale_out_timeout_s=config.scale_out_timeout_s,
                            partial_success_policy=config.partial_success_policy,
                            drain_timeout_s=config.scale_in_drain_timeout_s),
            on_change=self._state_changed.set,
        )
        self.control = RolloutControl(self.pool, self.executor, self.event_log, in_flight=self.router.in_flight,
                                      run_status=self._run_status, joins=self.fleet.joins,
                                      verify=self._verify_engine)
        self._generation: asyncio.Task[None] | None = None
        self._steps: dict[int, _StepStats] = {}
        self._error: BaseException | None = None
        self._prompt_ids_cache: dict[int, list[int]] = {}
        self._training: dict[str, Any] = {}
        self._weight_source: tuple[Any, RayWeightSource] | None = None  # (trainer rank 0 handle, its source)

    def _launcher(self) -> RayEngineLauncher:
        """Engine processes as Ray actors; SIGTERM on one of them reaches :meth:`notify_eviction`."""
        import ray

        backend = resolve_backend(self.cfg.backend)
        options = engine_backend(backend).options(
            gpus_per_engine=self.cfg.gpus_per_engine, max_running_requests=self.cfg.max_running_requests,
            extra_args=self.cfg.sglang_extra_args, mem_fraction_static=self.cfg.sglang_mem_fraction_static,
            random_seed=self.cfg.rollout_seed, python=self.cfg.sglang_python)
        if isinstance(options, SGLangOptions):
            options = replace(options, cpu_engines_per_node=self.cfg.engines_per_node)
        me = ray.get_runtime_context().current_actor
        return RayEngineLauncher(backend, self.cfg.model_path, {
            "options": options,
            "host": resolve_engine_host(self.cfg.engine_host),
            "log_dir": self.cfg.engine_log_dir,
            "env": self.cfg.engine_env,
            "on_eviction": (me, "notify_eviction"),
        }, gpus_per_engine=self.cfg.gpus_per_engine, keys_for=self.fleet_keys)

    def fleet_keys(self, engine_id: str) -> EngineKeys:
        """Engine ``engine_id``'s own keys (the fleet's rule; the launcher hands them to that engine alone)."""
        return engine_keys(self.cfg.engine_api_key, engine_id, generation=self.cfg.engine_generation_key)

    # ------------------------------------------------------------------ engines
    async def start_initial_engines(self, bundles: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        """Start one engine per (placement group, bundle index), concurrently; all must come up."""
        self.executor.settings.initial_engines = len(bundles)
        return await self.fleet.start_initial(bundles)

    async def notify_eviction(self, engine_id: str) -> None:
        """SIGTERM reached an EngineActor (node reclaimed): drain within the grace period, then remove."""
        await self.fleet.notify_eviction(engine_id)

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
        again = version in self.weights.versions()  # a retried publication: a no-op, or a WeightConflict
        self.fleet.weight_sync.publish(version, list(bucket_refs), manifest, source=source)
        if not again:
            self.event_log.append(EventKind.WEIGHTS_PUBLISHED, message=f"v{version}")

    async def verify_engine(self, engine_id: str) -> dict[str, Any]:
        """Check an ACTIVE engine's served weights against its version's publication now (``--verify-weights``
        applies to loads; this is the check on demand). A mismatch reloads the version once; a second one fails
        the engine. Returns the check (``rollout.refit.Verification``). Also ``POST /rollout/engines/{id}/verify``."""
        return await self.control.verify_engine(engine_id)

    async def _verify_engine(self, engine_id: str) -> dict[str, Any]:
        return (await self.fleet.verify_engine(engine_id)).to_dict()

    # ------------------------------------------------------------------ dispatch
    async def generate(self, group_key: str, input_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        """One generation on an ACTIVE engine (``rollout.dispatcher``); for callers outside the actor."""
        return await self.dispatcher.generate(group_key, input_ids, sampling_params)

    async def generate_batch(self, requests: list[tuple[str, list[int], dict[str, Any]]],
                             max_concurrency: int = 64) -> list[Generation]:
        """Many generations (group key, input ids, sampling params) with at most ``max_concurrency`` in flight,
        dispatched inside the manager as the rollout loop does: one Ray call for all of them, not one each
        (``benchmarks/scale_latency.py``, evaluation-style scripts)."""
        gate = asyncio.Semaphore(max(1, int(max_concurrency)))

        async def one(key: str, ids: list[int], params: dict[str, Any]) -> Generation:
            async with gate:
                return await self.dispatcher.generate(key, ids, params)

        return list(await asyncio.gather(*(one(k, list(ids), dict(p)) for k, ids, p in requests)))

    # ------------------------------------------------------------------ generation loop
    async def start_generation(self, start_step: int = 0, cursor: dict[str, int] | None = None) -> None:
        stream = PromptStream(
            self.dataset,
            shuffle=self.cfg.rollout_shuffle,
            seed=self.cfg.rollout_seed,
            cursor=PromptCursor.from_dict(cursor) if cursor else None,
        )
        self._generation = asyncio.create_task(self._generation_loop(stream, start_step))

    async def _generation_loop(self, stream: PromptStream, start_step: int) -> None:
        try:
            for step in range(start_step, self.cfg.num_rollout):
                await self._wait_for_gate(step)
                batch = stream.next_batch(self.cfg.rollout_batch_size)
                self._steps[step] = _StepStats(started=time.time(), cursor_end=batch.end.to_dict())
                await self.buffer.open_partition_async(step, expected_groups=len(batch.records))
                await asyncio.gather(*(self._group_into_buffer(step, rec) for rec in batch.records))
                self._steps[step].finished = time.time()
                log.debug(
                    "rollout step %d/%d generated (%d groups, engine weights v%d)",
                    step + 1,
                    self.cfg.num_rollout,
                    len(batch.records),
                    self.fleet.engine_version(),
                )
            self.gate.mark_idle()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the driver through get_partition
            log.exception("generation loop failed")
            self._error = exc
            await self.buffer.close()

    async def _next_state_change(self) -> None:
        """Wait for engines, weights or the buffer to change; the timeout bounds a missed wake-up."""
        self._state_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._state_changed.wait(), timeout=0.5)

    async def _wait_for_gate(self, step: int) -> None:
        while True:
            decision = self.gate.can_start(step, self.fleet.engine_version(), self.buffer.num_waiting_partitions())
            if decision.ok:
                return
            await self._next_state_change()

    def _prompt_ids(self, record_index: int, text: str) -> list[int]:
        ids = self._prompt_ids_cache.get(record_index)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._prompt_ids_cache[record_index] = ids
        return ids

    async def _group_into_buffer(self, step: int, record: Any) -> None:
        group = await generate_group(
            self,
            group_id=f"s{step}-p{record.index}-{uuid.uuid4().hex[:6]}",
            prompt_index=record.index,
            prompt_ids=self._prompt_ids(record.index, record.text),
            label=record.label,
            settings=self.cfg.sampling,
            reward_fn=self.reward_fn,
            rollout_step=step,
            scale_by_std=self.cfg.scale_by_std,
        )
        self.router.end_group(group.group_id)
        await self.buffer.put_group_async(step, group)

    async def get_partition(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        """Wait for rollout step `step`, hand its samples to the trainer, and free the partition."""
        try:
            groups = await self.buffer.wait_for_partition(step, timeout)
        except Exception:
            if self._error is not None:
                raise RuntimeError(f"generation loop failed: {self._error!r}") from self._error
            raise
        await self.buffer.clear_async(step)
        self._state_changed.set()
        stats = self._steps[step]
        samples = [s for g in groups for s in g.samples]
        return {
            "step": step,
            "samples": [s.to_dict() for s in samples],
            "cursor_end": stats.cursor_end,
            "metrics": _rollout_metrics(groups, stats),
        }

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self) -> dict[str, float]:
        settings = self.cfg.eval_sampling or self.cfg.sampling
        results: dict[str, list[PromptGroup]] = {}
        for name, data in self.eval_data.items():
            results[name] = list(
                await asyncio.gather(
                    *(
                        generate_group(
                            self.dispatcher,
                            group_id=f"eval-{name}-{rec.index}-{uuid.uuid4().hex[:6]}",
                            prompt_index=rec.index,
                            prompt_ids=list(self.tokenizer.encode(rec.text, add_special_tokens=False)),
                            label=rec.label,
                            settings=settings,
                            reward_fn=self.reward_fn,
                            rollout_step=0,
                            scale_by_std=self.cfg.scale_by_std,
                        )
                        for rec in data.records
                    )
                )
            )
        reports = evaluate_datasets(results)
        out: dict[str, float] = {}
        for report in reports.values():
            out.update(report.to_metrics())
        return out

    # ------------------------------------------------------------------ observation (driver and tests)
    async def engines(self) -> list[dict[str, Any]]:
        for r in self.pool.records():
            self.pool.set_in_flight(r.engine_id, self.router.in_flight(r.engine_id))
        return [r.to_dict() for r in self.pool.records()]

    async def engine_process(self, engine_id: str) -> dict[str, Any]:
        """The EngineActor's launch info (url, node, server pid) for operators and tests."""
        return dict(await self.fleet.engine_info(engine_id))

    async def engine_urls(self) -> dict[str, str]:
        return await self.control.engine_urls()

    async def status(self) -> dict[str, Any]:
        return {
            "engine_weight_version": self.fleet.engine_version(),
            "active_engines": len(self.pool.active()),
            "waiting_partitions": self.buffer.num_waiting_partitions(),
            "staleness_blocked_fraction": self.gate.blocked_fraction(),
            "tokens_generated": self.dispatcher.tokens_generated,
            "latest_published": self.weights.latest_version or 0,
            "weight_syncs": {eid: dict(t) for eid, t in self.fleet.weight_sync.last_syncs.items()},
            "verify_weights": self.fleet.weight_sync.verify_policy.value,
            "weight_verifications": dict(self.fleet.weight_sync.verifications),
            "last_verifications": {eid: dict(v) for eid, v in self.fleet.weight_sync.last_verifications.items()},
            "migration": self.dispatcher.migration.to_dict(),
            "evictions": {eid: dict(e) for eid, e in self.fleet.last_evictions.items()},
            "joins": self.fleet.joins.to_dict(),
            "sglang_router": self.fleet.sglang_router.status() if self.fleet.sglang_router else None,
        }

    async def report_training(self, metrics: dict[str, Any]) -> None:
        """The driver's latest training-step figures, shown by the control plane's /metrics."""
        self._training = dict(metrics)

    async def wait_weights(self, version: int, timeout: float = 120.0) -> bool:
        """Wait until every ACTIVE engine holds at least `version` (tests and the final summary)."""
        deadline = time.monotonic() + timeout
        while self.fleet.engine_version() < version:
            if time.monotonic() > deadline:
                return False
            await self._next_state_change()
        return True

    # ------------------------------------------------------------------ control API (REST + autoscaler)
    async def engines_view(self, model_name: str | None = None) -> dict[str, Any]:
        return await self.control.engines_view(model_name)

    async def events(self, limit: int = 100, kind: str | None = None) -> dict[str, Any]:
        return await self.control.events(limit, kind)

    async def recent_events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.event_log.newest(limit)]

    async def relax_status(self) -> dict[str, Any]:
        return await self.control.relax_status()

    def _run_status(self) -> dict[str, Any]:
        """The training-side figures of ``relax_status``."""
        return {
            "training_step": self._training.get("step", 0),
            "num_rollout": self.cfg.num_rollout,
            "rollout_tokens_per_s": self._training.get("rollout_tokens_per_s", 0.0),
            "staleness_mean": self._training.get("staleness_mean", 0.0),
            "trainer_wait_fraction": self._training.get("trainer_wait_fraction", 0.0),
            "staleness_blocked_fraction": self.gate.blocked_fraction(),
            "buffer_waiting_partitions": self.buffer.num_waiting_partitions(),
            "migration_tokens_kept": self.dispatcher.migration.tokens_kept,
            "migration_tokens_regenerated": self.dispatcher.migration.tokens_regenerated,
            "migrated_requests": self.dispatcher.migration.migrated_requests,
            "tokens_generated": self.dispatcher.tokens_generated,
            "weight_verifications": dict(self.fleet.weight_sync.verifications),
            **self._last_join_and_eviction(),
        }

    def _last_join_and_eviction(self) -> dict[str, float]:
        """The newest engine join's and eviction's durations, for Relax's /metrics (absent until one happened)."""
        out: dict[str, float] = {}
        join = self.fleet.joins.latest_answered()
        if join is not None and join.decision_to_first_answer_s is not None:
            out["last_join_active_s"] = join.decision_to_active_s
            out["last_join_first_answer_s"] = join.decision_to_first_answer_s
        gone = [e for e in self.fleet.last_evictions.values() if e.get("notice_to_gone_s") is not None]
        if gone:
            out["last_eviction_notice_to_gone_s"] = gone[-1]["notice_to_gone_s"]
        return out

    async def scale_out(self, spec: ScaleOutSpec) -> dict[str, Any]:
        return await self.control.scale_out(spec)

    async def scale_in(self, spec: ScaleInSpec) -> dict[str, Any]:
        return await self.control.scale_in(spec)

    async def list_scale_requests(self, direction: str, status: str | None = None,
                                  model_name: str | None = None) -> list[dict[str, Any]]:
        return await self.control.list_scale_requests(direction, status, model_name)

    async def get_scale_request(self, direction: str, request_id: str) -> dict[str, Any]:
        return await self.control.get_scale_request(direction, request_id)

    async def cancel_scale_out(self, request_id: str) -> dict[str, Any]:
        return await self.control.cancel_scale_out(request_id)

    async def cancel_scale_out_batch(self, status_filter: list[str] | None = None,
                                     dry_run: bool = False) -> dict[str, Any]:
        return await self.control.cancel_scale_out_batch(status_filter, dry_run)

    async def shutdown(self) -> None:
        """Stop generation, every engine (process, actor, owned placement group) and background task."""
        if self._generation is not None:
            self._generation.cancel()
        await self.executor.aclose()
        await self.buffer.close()
        await self.fleet.shutdown()
        log.info("rollout manager shut down (pid %d)", os.getpid())


def _rollout_metrics(groups: list[PromptGroup], stats: _StepStats) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    seconds = (stats.finished or time.time()) - stats.started
    return {
        "rollout/reward_mean": sum(s.reward or 0.0 for s in samples) / len(samples),
        "rollout/response_len_mean": sum(s.response_length for s in samples) / len(samples),
        "rollout/truncated_ratio": sum(1 for s in samples if s.truncated) / len(samples),
        "rollout/samples": float(len(samples)),
        "rollout/seconds": seconds,
        "rollout/min_weight_version": float(min(s.weight_version for s in samples)),
    }


__all__ = ["ManagerConfig", "RolloutManager", "SampleLostError"]
