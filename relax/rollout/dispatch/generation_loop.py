"""The generation loop: prompts in, one buffer partition of prompt groups per rollout step out.

It runs ahead of the trainer as far as the staleness gate allows (``data.staleness``), sends each group's
generations through the dispatcher, scores them and fills ``data.buffer``; the trainer takes a step's
partition with :meth:`GenerationLoop.take`. Evaluation uses the same dispatcher. No Ray here: the loop is an
asyncio task of whoever built the rollout (``rollout.assembly``), the Ray actor or a unit test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax.data.buffer import SampleBuffer
from relax.data.dataset import PromptCursor, PromptStream, load_prompt_data
from relax.data.prompt_fit import fit_prompts
from relax.data.rewards import get_reward_fn
from relax.data.sample import PromptGroup, Sample
from relax.data.staleness import StalenessGate
from relax.rollout.dispatch.dispatcher import SampleLostError
from relax.rollout.dispatch.generator import Dispatcher, generate_group
from relax.rollout.settings import DataSettings
from relax.training.evaluation import evaluate_datasets

log = logging.getLogger("relax.rollout")


@dataclass
class StepTimes:
    """When a rollout step's first request left and its last group came back, and where its prompts ended."""

    started: float
    finished: float | None = None
    cursor_end: dict[str, int] | None = None


@dataclass(frozen=True)
class Partition:
    """A rollout step's samples as the trainer takes them."""

    step: int
    samples: list[Sample]
    cursor_end: dict[str, int] | None
    metrics: dict[str, float]


class GenerationLoop:
    def __init__(self, settings: DataSettings, tokenizer: Any, dispatcher: Dispatcher, *,
                 end_group: Callable[[str], None], engine_version: Callable[[], int],
                 state_changed: asyncio.Event, context_len: int | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self._end_group = end_group
        self._engine_version = engine_version
        self._prompt_ids_cache: dict[int, list[int]] = {}
        loaded = load_prompt_data(settings.prompt_data, settings.input_key, settings.label_key,
                                  tokenizer=tokenizer, apply_chat_template=settings.apply_chat_template)
        lengths = [len(self._prompt_ids(r.index, r.text)) for r in loaded.records]
        self.dataset, self.dropped = fit_prompts(loaded, lengths, max_prompt_len=settings.max_prompt_len,
                                                 context_len=context_len,
                                                 max_new_tokens=settings.sampling.max_new_tokens)
        if self.dropped.count:
            log.warning("%s", self.dropped.describe(loaded.path, settings.max_prompt_len, context_len,
                                                    settings.sampling.max_new_tokens))
        self.refused_groups = 0  # groups an engine refused (a client error): dropped, counted
        self.eval_data = {
            name: load_prompt_data(path, settings.input_key, settings.label_key, tokenizer=tokenizer,
                                   apply_chat_template=settings.apply_chat_template)
            for name, path in settings.eval_datasets
        }
        self.reward_fn = get_reward_fn(settings.rm_type or "tiny", settings.custom_rm_path, settings.reward_key)
        self.buffer = SampleBuffer()
        self.gate = StalenessGate(settings.max_staleness, time.monotonic)
        self.state_changed = state_changed  # engines, weights or the buffer changed: the gate may open
        self._task: asyncio.Task[None] | None = None
        self._steps: dict[int, StepTimes] = {}
        self._error: BaseException | None = None

    def start(self, start_step: int = 0, cursor: dict[str, int] | None = None) -> None:
        stream = PromptStream(self.dataset, shuffle=self.settings.shuffle, seed=self.settings.seed,
                              cursor=PromptCursor.from_dict(cursor) if cursor else None)
        self._task = asyncio.create_task(self._run(stream, start_step))

    async def _run(self, stream: PromptStream, start_step: int) -> None:
        try:
            for step in range(start_step, self.settings.num_rollout):
                await self._wait_for_gate(step)
                batch = stream.next_batch(self.settings.rollout_batch_size)
                times = self._steps[step] = StepTimes(started=time.time(), cursor_end=batch.end.to_dict())
                await self.buffer.open_partition_async(step, expected_groups=len(batch.records))
                results = await asyncio.gather(*(self._group_into_buffer(step, rec) for rec in batch.records),
                                               return_exceptions=True)
                await self._after_refusals(step, batch.records, results)
                times.finished = time.time()  # the step may have been taken already
                log.debug("rollout step %d/%d generated (%d groups, engine weights v%d)", step + 1,
                          self.settings.num_rollout, len(batch.records), self._engine_version())
            self.gate.mark_idle()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the trainer through take()
            log.exception("generation loop failed")
            self._error = exc
            await self.buffer.close()

    async def _after_refusals(self, step: int, records: Any, results: list[Any]) -> None:
        """Groups an engine refused are dropped and counted (the step trains on the rest); any other failure
        ends the loop, as before."""
        refused = [(rec, r) for rec, r in zip(records, results, strict=True)
                   if isinstance(r, SampleLostError) and r.refused]
        failed = [r for r in results if isinstance(r, BaseException) and all(r is not e for _, e in refused)]
        if failed:
            raise failed[0]
        if not refused:
            return
        self.refused_groups += len(refused)
        rec, error = refused[0]
        log.warning("rollout step %d: %d group(s) refused by the engines and dropped (line %d of the data: %s)",
                    step + 1, len(refused), rec.line, error)
        if len(refused) == len(records):
            raise RuntimeError(f"rollout step {step + 1}: every group was refused by the engines ({error})")
        await self.buffer.mark_complete_async(step, allow_partial=True)

    async def next_state_change(self) -> None:
        """Wait for engines, weights or the buffer to change; the timeout bounds a missed wake-up."""
        self.state_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.state_changed.wait(), timeout=0.5)

    async def _wait_for_gate(self, step: int) -> None:
        while not self.gate.can_start(step, self._engine_version(), self.buffer.num_waiting_partitions()).ok:
            await self.next_state_change()

    def _prompt_ids(self, record_index: int, text: str) -> list[int]:
        ids = self._prompt_ids_cache.get(record_index)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._prompt_ids_cache[record_index] = ids
        return ids

    async def _group_into_buffer(self, step: int, record: Any) -> None:
        group = await generate_group(
            self.dispatcher, group_id=f"s{step}-p{record.index}-{uuid.uuid4().hex[:6]}", prompt_index=record.index,
            prompt_ids=self._prompt_ids(record.index, record.text), label=record.label,
            settings=self.settings.sampling, reward_fn=self.reward_fn, rollout_step=step,
            scale_by_std=self.settings.scale_by_std,
        )
        self._end_group(group.group_id)
        await self.buffer.put_group_async(step, group)

    async def take(self, step: int, timeout: float | None = None) -> Partition:
        """Wait for rollout step ``step``, free its partition (the gate may open) and return its samples."""
        try:
            groups = await self.buffer.wait_for_partition(step, timeout)
        except Exception:
            if self._error is not None:
                raise RuntimeError(f"generation loop failed: {self._error!r}") from self._error
            raise
        await self.buffer.clear_async(step)
        self.state_changed.set()
        times = self._steps.pop(step)  # taken once: a run of days keeps no record per step
        return Partition(step=step, samples=[s for g in groups for s in g.samples], cursor_end=times.cursor_end,
                         metrics=rollout_metrics(groups, times))

    async def evaluate(self) -> dict[str, float]:
        """Every eval dataset once, through the same dispatcher; the metrics of ``training.evaluation``."""
        settings = self.settings.eval_sampling or self.settings.sampling
        results: dict[str, list[PromptGroup]] = {}
        for name, data in self.eval_data.items():
            results[name] = list(await asyncio.gather(*(
                generate_group(
                    self.dispatcher, group_id=f"eval-{name}-{rec.index}-{uuid.uuid4().hex[:6]}",
                    prompt_index=rec.index, prompt_ids=list(self.tokenizer.encode(rec.text, add_special_tokens=False)),
                    label=rec.label, settings=settings, reward_fn=self.reward_fn, rollout_step=0,
                    scale_by_std=self.settings.scale_by_std,
                )
                for rec in data.records
            )))
        out: dict[str, float] = {}
        for report in evaluate_datasets(results).values():
            out.update(report.to_metrics())
        return out

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.buffer.close()


def rollout_metrics(groups: list[PromptGroup], times: StepTimes) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    seconds = (times.finished or time.time()) - times.started
    return {
        "rollout/reward_mean": sum(s.reward or 0.0 for s in samples) / len(samples),
        "rollout/response_len_mean": sum(s.response_length for s in samples) / len(samples),
        "rollout/truncated_ratio": sum(1 for s in samples if s.truncated) / len(samples),
        "rollout/samples": float(len(samples)),
        "rollout/seconds": seconds,
        "rollout/min_weight_version": float(min(s.weight_version for s in samples)),
    }
