"""Prompt → group of scored samples: the unit of work of the generation loop.

(docs/architecture.md, "The data path of a sample".)

A group's n samples are generated as n requests that the dispatcher keeps on one engine (shared
prefix → prefix-cache hits) and retries elsewhere when an engine fails, so a group always comes
back complete. Rewards are computed here and advantages are normalised within the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from relax.data.sample import FinishReason, PromptGroup, Sample
from relax.rollout.settings import SamplingSettings
from relax.training.advantages import assign_group_advantages


@dataclass(frozen=True)
class Generation:
    """One finished engine answer, with where and under which weights it was produced."""

    engine_id: str
    output: dict[str, Any]
    dispatch_version: int


class Dispatcher(Protocol):
    async def generate(self, group_key: str, input_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        """Run one generation on some ACTIVE engine, retrying elsewhere on engine failure."""
        ...


RewardFn = Callable[[str, str], float]


def sample_version(meta: Mapping[str, Any], dispatch_version: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """The version a sample counts as for staleness, and its spans (docs/training.md, "Weights and staleness").

    SGLang reports ``weight_version`` = the *newest* version that produced a token and, per finished
    request, ``weight_versions`` spans. A sample is only as fresh as its oldest token, so the oldest span
    wins. Without spans (older builds) the answer is ``min(reported, dispatch version)``: an update may
    have landed mid-request, and the version known when it was sent is the honest bound.
    """
    spans = _parse_spans(meta.get("weight_versions"))
    if spans:
        return min(v for v, _start, _end in spans), spans
    try:
        reported = int(meta.get("weight_version", dispatch_version))
    except (TypeError, ValueError):
        reported = dispatch_version
    return min(reported, dispatch_version), ()


def _parse_spans(raw: Any) -> tuple[tuple[int, int, int], ...]:
    """``[{"version": "3", "start": 0, "end": 7}, ...]`` as int triples; anything malformed counts as none."""
    if not isinstance(raw, list):
        return ()
    try:
        return tuple((int(s["version"]), int(s["start"]), int(s["end"])) for s in raw)
    except (TypeError, ValueError, KeyError):
        return ()


def sample_from_output(
    gen: Generation,
    *,
    prompt_index: int,
    group_id: str,
    sample_index: int,
    prompt_ids: list[int],
    label: str,
    rollout_step: int,
    reward: float,
) -> Sample:
    meta = gen.output["meta_info"]
    logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs") or []]
    version, spans = sample_version(meta, gen.dispatch_version)
    return Sample(
        prompt_index=prompt_index,
        group_id=group_id,
        sample_index=sample_index,
        prompt_token_ids=tuple(prompt_ids),
        response_token_ids=tuple(gen.output["output_ids"]),
        response_text=gen.output.get("text", ""),
        label=label,
        weight_version=max(0, version),
        weight_version_spans=spans,
        rollout_step=rollout_step,
        rollout_log_probs=tuple(logprobs),
        finish_reason=FinishReason.parse(meta.get("finish_reason")),
        engine_id=gen.engine_id,
        reward=reward,
    )


async def generate_group(
    dispatcher: Dispatcher,
    *,
    group_id: str,
    prompt_index: int,
    prompt_ids: list[int],
    label: str,
    settings: SamplingSettings,
    reward_fn: RewardFn,
    rollout_step: int,
    scale_by_std: bool = True,
) -> PromptGroup:
    params = settings.to_params()
    gens = await asyncio.gather(*(dispatcher.generate(group_id, prompt_ids, params) for _ in range(settings.n_samples)))
    samples = [
        sample_from_output(
            g,
            prompt_index=prompt_index,
            group_id=group_id,
            sample_index=i,
            prompt_ids=prompt_ids,
            label=label,
            rollout_step=rollout_step,
            reward=float(reward_fn(g.output.get("text", ""), label)),
        )
        for i, g in enumerate(gens)
    ]
    return assign_group_advantages([PromptGroup.from_samples(samples)], scale_by_std=scale_by_std)[0]
