"""Migration of in-flight generations: continue an aborted request elsewhere instead of starting it again.

When an engine leaves (scale-in past its drain budget, an eviction notice), its unfinished requests are
aborted, and an SGLang abort answers with what was generated so far: token ids, per-token log-probs and the
weight-version spans. Thrown away, that work is regenerated from scratch, on the scarcest capacity and at
the worst moment. Kept, the request continues on a surviving engine: prompt + generated prefix as its input
ids, the remaining token budget, the same stop conditions. The sample is the concatenation of its segments,
with every token's rollout log-prob (what truncated importance sampling uses) and every segment's weight
versions (its version for the staleness rule is the oldest).

Pure: the dispatcher (``RolloutManager.generate``) carries the decisions out. The rules:

* budget spent (``max_new_tokens`` reached at the boundary): the sample is complete, finish reason ``length``;
* the prefix ends in a stop token (EOS exactly at the boundary, not ignored): complete, finish reason ``stop``;
* the prefix does not fit the next engine's context with one more token: start again from scratch (the
  only case where tokens are lost, counted as regenerated);
* otherwise continue: ``max_new_tokens`` and ``min_new_tokens`` shrink by what was generated.

Stop *strings* are matched by the engine on the text it generates, so one spanning the boundary is not seen
(tokens are; the manager's samples use tokens). Seeded sampling does not reproduce across a migration.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Decision", "Next", "Segment", "continue_after", "stitch"]


@dataclass(frozen=True)
class Segment:
    """What one engine generated for a request before it finished or was aborted."""

    engine_id: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    spans: tuple[Mapping[str, Any], ...]  # [{version, start, end}] over this segment's tokens
    text: str = ""
    dispatch_version: int = 0

    @classmethod
    def from_output(cls, engine_id: str, output: Mapping[str, Any], dispatch_version: int = 0) -> Segment:
        meta = output.get("meta_info", {})
        ids = tuple(int(t) for t in output.get("output_ids", ()))
        lps = tuple(float(x[0]) for x in meta.get("output_token_logprobs", ()) or ())
        if lps and len(lps) != len(ids):
            raise ValueError(f"{engine_id}: {len(lps)} log-probs for {len(ids)} tokens")
        spans = tuple(meta.get("weight_versions") or ())
        if not spans and ids:  # an engine without spans: the whole segment is its reported version
            spans = ({"version": str(meta.get("weight_version", dispatch_version)), "start": 0, "end": len(ids)},)
        return cls(engine_id, ids, lps, spans, str(output.get("text", "")), dispatch_version)

    def __len__(self) -> int:
        return len(self.output_ids)


class Next(str, Enum):
    CONTINUE = "continue"  # send the continuation request to another engine
    COMPLETE = "complete"  # the segments are the whole sample
    RESTART = "restart"  # cannot continue: generate again from the prompt (the tokens are regenerated)


@dataclass(frozen=True)
class Decision:
    next: Next
    input_ids: tuple[int, ...] = ()
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: Mapping[str, Any] | None = None  # for COMPLETE
    reason: str = ""


def continue_after(prompt_ids: Sequence[int], sampling_params: Mapping[str, Any], segments: Sequence[Segment], *,
                   eos_ids: Collection[int] = (), max_context: int | None = None) -> Decision:
    """What to do with a request whose last segment was aborted (see the module's rules)."""
    generated = [t for s in segments for t in s.output_ids]
    budget = int(sampling_params.get("max_new_tokens", 128))
    remaining = budget - len(generated)
    if generated and remaining <= 0:
        return Decision(Next.COMPLETE, finish_reason={"type": "length", "length": budget}, reason="budget spent")
    stops = set(eos_ids) | set(sampling_params.get("stop_token_ids") or ())
    if generated and not sampling_params.get("ignore_eos", False) and generated[-1] in stops:
        return Decision(Next.COMPLETE, finish_reason={"type": "stop", "matched": generated[-1]},
                        reason="stop token at the boundary")
    if not generated:
        return Decision(Next.RESTART, input_ids=tuple(prompt_ids), sampling_params=dict(sampling_params),
                        reason="nothing generated yet")
    input_ids = (*prompt_ids, *generated)
    if max_context is not None and len(input_ids) + 1 > max_context:
        return Decision(Next.RESTART, input_ids=tuple(prompt_ids), sampling_params=dict(sampling_params),
                        reason=f"prompt + {len(generated)} generated tokens exceed the next engine's context "
                               f"({max_context})")
    params = dict(sampling_params)
    params["max_new_tokens"] = remaining
    if params.get("min_new_tokens"):
        params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - len(generated))
    return Decision(Next.CONTINUE, input_ids=input_ids, sampling_params=params,
                    reason=f"{len(generated)} tokens kept, {remaining} to go")


def _merged_spans(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    offset = 0
    for seg in segments:
        for span in seg.spans:
            start, end = int(span["start"]) + offset, int(span["end"]) + offset
            if end <= start:
                continue
            version = str(span["version"])
            if spans and spans[-1]["version"] == version and spans[-1]["end"] == start:
                spans[-1]["end"] = end
            else:
                spans.append({"version": version, "start": start, "end": end})
        offset += len(seg)
    return spans


def _newest(versions: Sequence[str]) -> str:
    """SGLang's ``weight_version``: the newest version that produced a token (numeric when they all are)."""
    if all(v.lstrip("-").isdigit() for v in versions):
        return str(max(int(v) for v in versions))
    return versions[-1]


def stitch(segments: Sequence[Segment], prompt_tokens: int, finish_reason: Mapping[str, Any]) -> dict[str, Any]:
    """One SGLang-shaped answer from the segments of a migrated request (ids, log-probs, spans concatenated)."""
    if not segments:
        raise ValueError("nothing to stitch")
    ids = [t for s in segments for t in s.output_ids]
    logprobs = [[lp, tok, None] for s in segments for lp, tok in zip(s.logprobs, s.output_ids, strict=True)]
    spans = _merged_spans(segments)
    newest = _newest([s["version"] for s in spans]) if spans else str(segments[-1].dispatch_version)
    meta: dict[str, Any] = {
        "finish_reason": dict(finish_reason),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "weight_version": str(newest),
        "weight_versions": spans,
        "segments": [{"engine_id": s.engine_id, "tokens": len(s)} for s in segments],
    }
    if all(len(s.logprobs) == len(s) for s in segments):
        meta["output_token_logprobs"] = logprobs
    return {"text": "".join(s.text for s in segments), "output_ids": ids, "meta_info": meta}
