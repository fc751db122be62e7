"""RolloutManager: the Ray actor that owns the engines and fills the sample buffer (DESIGN 2, 3, 8).

It is a thin shell: engine states live in `rollout.pool`, routing in `rollout.router`, the staleness
rule in `data.staleness`, partitions in `data.buffer`, and group assembly in `rollout.generator`. This
actor wires them to Ray (EngineActors) and HTTP (EngineClient) and runs the generation loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from relax.data.buffer import SampleBuffer, staleness_stats
from relax.data.dataset import PromptCursor, PromptStream, load_prompt_data
from relax.data.rewards import get_reward_fn
from relax.data.sample import PromptGroup
from relax.data.staleness import StalenessGate
from relax.engines.client import EngineClient, EngineError, EngineUnavailable
from relax.engines.launcher import BuiltinOptions
from relax.logs import setup_logging
from relax.rollout.events import EventKind, EventLog
from relax.rollout.generator import Generation, SamplingSettings, generate_group
from relax.rollout.pool import EngineKind, EnginePool, EngineState
from relax.rollout.router import NoEngineAvailable, Router
from relax.training.evaluation import evaluate_datasets
from relax.training.weights import WeightManifest, WeightRegistry

log = logging.getLogger("relax.rollout")


class SampleLostError(RuntimeError):
    """A request failed on every engine it was tried on; raised instead of silently dropping it."""


@dataclass(frozen=True)
class ManagerConfig:
    model_path: str
    prompt_data: str
    num_rollout: int
    rollout_batch_size: int
    sampling: SamplingSettings
    max_staleness: int = 1
    backend: str = "builtin"
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
        self.pool = EnginePool(time.time)
        self.router = Router()
        self.events = EventLog(time.time)
        self.registry = WeightRegistry()
        self.buffer = SampleBuffer()
        self.gate = StalenessGate(config.max_staleness, time.monotonic)
        self._actors: dict[str, Any] = {}
        self._clients: dict[str, EngineClient] = {}
        self._routable = asyncio.Event()
        self._state_changed = asyncio.Event()
        self._generation: asyncio.Task[None] | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._steps: dict[int, _StepStats] = {}
        self._error: BaseException | None = None
        self._tokens_generated = 0
        self._prompt_ids_cache: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ engines
    async def start_initial_engines(self, bundles: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        """Start one EngineActor per (placement group, bundle index), concurrently; all must come up."""
        records = [self.pool.add(EngineKind.INITIAL, bundle=f"initial-{i}") for i in range(len(bundles))]
        results = await asyncio.gather(
            *(self._bring_up(rec.engine_id, pg, index) for rec, (pg, index) in zip(records, bundles, strict=True)),
            return_exceptions=True,
        )
        failures = [
            (r.engine_id, res) for r, res in zip(records, results, strict=True) if isinstance(res, BaseException)
        ]
        if failures:
            raise RuntimeError(
                "initial engines failed to start: " + "; ".join(f"{eid}: {err}" for eid, err in failures)
            )
        return [self.pool.get(r.engine_id).to_dict() for r in records]

    async def _bring_up(self, engine_id: str, placement_group: Any, bundle_index: int) -> None:
        from relax.engines.actor import spawn_engine_actor

        self.pool.transition(engine_id, EngineState.STARTING)
        me = ray.get_runtime_context().current_actor
        actor = spawn_engine_actor(
            engine_id,
            self.cfg.backend,
            self.cfg.model_path,
            placement_group=placement_group,
            bundle_index=bundle_index,
            num_gpus=1,
            num_cpus=1,
            weight_version=0,
            options=BuiltinOptions(max_running_requests=self.cfg.max_running_requests, num_threads=1),
            log_dir=self.cfg.engine_log_dir,
            env=self.cfg.engine_env,
            on_eviction=(me, "notify_eviction"),
        )
        self._actors[engine_id] = actor
        try:
            info = await actor.start.remote()
            self.pool.set_url(engine_id, info["url"])
            self.pool.set_node_id(engine_id, info.get("node_id"))
            self.pool.transition(engine_id, EngineState.HEALTH_CHECKING)
            client = EngineClient(info["url"], timeout=self.cfg.request_timeout_s)
            self._clients[engine_id] = client
            await client.health_generate()
            self.pool.set_weight_version(engine_id, 0)
            self.pool.transition(engine_id, EngineState.WEIGHT_SYNCING)
            await self._sync_engine_to_latest(engine_id)
            self.pool.transition(engine_id, EngineState.ACTIVE)
        except BaseException as exc:
            self.pool.transition(engine_id, EngineState.FAILED, error=str(exc))
            self.events.append(EventKind.ENGINE_FAILED, engine_ids=engine_id, message=str(exc)[:500])
            raise
        self.router.add(engine_id)
        self._routable.set()
        self._state_changed.set()
        self.events.append(EventKind.ENGINE_STATE, engine_ids=engine_id, message=f"ACTIVE at {info['url']}")
        log.info("%s ACTIVE at %s (weights v%s)", engine_id, info["url"], self.pool.get(engine_id).weight_version)

    async def _sync_engine_to_latest(self, engine_id: str) -> None:
        latest = self.registry.latest()
        record = self.pool.get(engine_id)
        if latest is None or (record.weight_version or 0) >= latest.version:
            return
        await self._actors[engine_id].sync_weights.remote(latest.version, list(latest.bucket_refs))
        self.pool.set_weight_version(engine_id, latest.version)

    async def _on_engine_failure(self, engine_id: str, exc: BaseException) -> None:
        record = self.pool.get(engine_id)
        if record.state is not EngineState.ACTIVE:
            return
        self.router.remove(engine_id)
        self.pool.transition(engine_id, EngineState.FAILED, error=str(exc))
        self.events.append(EventKind.ENGINE_FAILED, engine_ids=engine_id, message=str(exc)[:500])
        log.warning("%s failed (%s); taken out of routing, its requests are retried elsewhere", engine_id, exc)
        if not self.router.routable():
            self._routable.clear()

    async def notify_eviction(self, engine_id: str) -> None:
        """SIGTERM reached an EngineActor: stop routing to it at once (full drain: elastic scaling issue)."""
        self.events.append(EventKind.ENGINE_EVICTED, engine_ids=engine_id, message="SIGTERM received")
        if engine_id in self.pool and self.pool.get(engine_id).state is EngineState.ACTIVE:
            self.router.remove(engine_id)
            self.pool.transition(engine_id, EngineState.DRAINING)
            log.warning("%s evicted: DRAINING", engine_id)

    # ------------------------------------------------------------------ weights
    async def publish_weights(self, version: int, bucket_refs: list[Any], manifest: WeightManifest) -> None:
        """Record version `version` and apply it to every ACTIVE engine in the background.

        Returns at once: the trainer must not wait for engines to load (DESIGN 7); the staleness gate
        is what holds rollout back until the engines hold recent enough weights.
        """
        self.registry.publish(version, list(bucket_refs), manifest)
        self.events.append(EventKind.WEIGHTS_PUBLISHED, message=f"v{version}")
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        """Bring every ACTIVE engine to the latest version; newer versions published meanwhile win."""
        while True:
            latest = self.registry.latest()
            behind = [
                r.engine_id for r in self.pool.active() if (r.weight_version or 0) < (latest.version if latest else 0)
            ]
            if latest is None or not behind:
                return
            began = time.monotonic()
            results = await asyncio.gather(*(self._sync_one(eid) for eid in behind), return_exceptions=True)
            for eid, res in zip(behind, results, strict=True):
                if isinstance(res, BaseException):
                    await self._on_engine_failure(eid, res)
            log.info("weights v%d on %d engine(s) in %.2fs", latest.version, len(behind), time.monotonic() - began)
            self._state_changed.set()

    async def _sync_one(self, engine_id: str) -> None:
        await self._sync_engine_to_latest(engine_id)

    def _engine_version(self) -> int:
        version = self.pool.min_active_weight_version()
        return -1 if version is None else version

    # ------------------------------------------------------------------ dispatch (router + retry)
    async def generate(self, group_key: str, input_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        last_error: BaseException | None = None
        for _attempt in range(self.cfg.max_attempts):
            engine_id = await self._acquire(group_key)
            version = self.pool.get(engine_id).weight_version or 0
            self.pool.set_in_flight(engine_id, self.router.in_flight(engine_id))
            try:
                out = await self._clients[engine_id].generate(
                    input_ids=input_ids,
                    sampling_params=sampling_params,
                    return_logprob=True,
                    rid=uuid.uuid4().hex,
                    timeout=self.cfg.request_timeout_s,
                )
            except EngineUnavailable as exc:
                last_error = exc
                await self._on_engine_failure(engine_id, exc)
                continue
            finally:
                self.router.release(engine_id)
                self.pool.set_in_flight(engine_id, self.router.in_flight(engine_id))
            assert isinstance(out, dict)
            if (out["meta_info"].get("finish_reason") or {}).get("type") == "abort":
                last_error = RuntimeError(f"aborted on {engine_id}")
                continue  # drained or evicted engine: retried on another one, never dropped
            self._tokens_generated += int(out["meta_info"].get("completion_tokens", 0))
            return Generation(engine_id=engine_id, output=out, dispatch_version=version)
        raise SampleLostError(f"request failed on {self.cfg.max_attempts} attempts: {last_error}")

    async def _acquire(self, group_key: str) -> str:
        while True:
            try:
                return self.router.acquire(group_key)
            except NoEngineAvailable:
                self._routable.clear()
                await self._routable.wait()

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
                log.info(
                    "rollout step %d/%d generated (%d groups, engine weights v%d)",
                    step + 1,
                    self.cfg.num_rollout,
                    len(batch.records),
                    self._engine_version(),
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
            decision = self.gate.can_start(step, self._engine_version(), self.buffer.num_waiting_partitions())
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
                            self,
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

    # ------------------------------------------------------------------ observation
    async def engines(self) -> list[dict[str, Any]]:
        for r in self.pool.records():
            self.pool.set_in_flight(r.engine_id, self.router.in_flight(r.engine_id))
        return [r.to_dict() for r in self.pool.records()]

    async def engine_process(self, engine_id: str) -> dict[str, Any]:
        """The EngineActor's launch info (url, node, server pid) for operators and tests."""
        return await self._actors[engine_id].info.remote()

    async def engine_urls(self) -> dict[str, str]:
        return {r.engine_id: r.url for r in self.pool.active() if r.url}

    async def status(self) -> dict[str, Any]:
        return {
            "engine_weight_version": self._engine_version(),
            "active_engines": len(self.pool.active()),
            "waiting_partitions": self.buffer.num_waiting_partitions(),
            "staleness_blocked_fraction": self.gate.blocked_fraction(),
            "tokens_generated": self._tokens_generated,
            "latest_published": (self.registry.latest().version if self.registry.latest() else 0),
        }

    async def recent_events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events.newest(limit)]

    async def wait_weights(self, version: int, timeout: float = 120.0) -> bool:
        """Wait until every ACTIVE engine holds at least `version` (tests and the final summary)."""
        deadline = time.monotonic() + timeout
        while self._engine_version() < version:
            if time.monotonic() > deadline:
                return False
            await self._next_state_change()
        return True

    async def shutdown(self) -> None:
        if self._generation is not None:
            self._generation.cancel()
        if self._sync_task is not None:
            self._sync_task.cancel()
        await self.buffer.close()
        stops = [actor.shutdown.remote(5.0) for actor in self._actors.values()]
        for ref in stops:
            try:
                await ref
            except Exception as exc:  # an already-dead engine is fine here
                log.info("engine shutdown: %s", exc)
        for client in self._clients.values():
            await client.aclose()
        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
        self._actors.clear()
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


__all__ = ["EngineError", "ManagerConfig", "RolloutManager", "SampleLostError", "staleness_stats"]
