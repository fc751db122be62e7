"""The dispatcher's rules for one request (pure): where it goes next after an answer or a failure.

The async shell (``rollout.dispatch.dispatcher``) sends, streams and waits; every decision is made here, from what the
attempt ended with, so each rule is a millisecond test (tests/unit/test_dispatch.py):

1. **An answer is a sample** unless it was aborted; a sample made of several segments (migrated) is stitched
   (``rollout.dispatch.migration.stitch``): per-token log-probs, per-segment versions, the oldest dispatch version.
2. **An aborted answer or a lost engine keeps its prefix.** An abort (drain, forced scale-in, eviction) answers
   with what was generated; an engine that died without notice left the last complete chunk of its stream. In
   both cases, with migration on, the request continues elsewhere from prompt + prefix with the remaining
   budget (``rollout.dispatch.migration.continue_after``), or is complete when the prefix already ends it.
3. **What a crashed engine's prefix is trusted with**: the last complete chunk only (a chunk cut off mid-way
   is never parsed, ``relax.engines.event_stream``), and only when it is consistent — as many log-probs as
   tokens; anything else is thrown away and counted as regenerated. Tokens generated after that chunk are lost
   with the engine (at most the stream interval per request).
4. **Retries** follow ``RetryPolicy`` (which failures, how many attempts, which engines to avoid); a request
   that runs out is LOST — raised to the caller, never dropped silently.
5. **Accounting**: tokens carried into the next attempt are *kept*, tokens thrown away are *regenerated*.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from relax.rollout.dispatch.migration import Next, Segment, continue_after, stitch
from relax.rollout.routing.router import FailureKind, RetryPolicy, failure_from_finish_reason

__all__ = ["MAX_CHUNKS", "Action", "RequestJourney", "Step", "stream_interval"]

#: At most this many chunks per streamed request: chunks are cumulative (SGLang sends the whole output so far each
#: time), so the bytes a request streams grow with chunks x length; bounding the chunks keeps them linear in the
#: length, and what a crash can lose to 1/MAX_CHUNKS of the budget.
MAX_CHUNKS = 64


def stream_interval(max_new_tokens: int, floor: int, min_tokens: int = 0) -> int | None:
    """Tokens per chunk for one request, or None: send it unstreamed.

    ``floor`` tokens at least (few tokens lost to a crash), wider for long budgets: 200 tokens at floor 8 are
    streamed every 8 (a crash loses at most 7 per request); 16 384 tokens every 256 (at most 255, 1.6 % of the
    budget, in 64 chunks instead of 2 048). A budget of at most ``min_tokens`` is not streamed: a crash then
    costs at most that many tokens generated again, less than what its chunks cost a busy engine.
    """
    if int(max_new_tokens) <= min_tokens:
        return None
    return max(1, floor, -(-int(max_new_tokens) // MAX_CHUNKS))


class Action(str, Enum):
    SEND = "send"  # (again) to an engine: input ids, sampling params, engines to avoid
    DONE = "done"  # the sample is complete: ``output``
    LOST = "lost"  # no attempt left: the caller raises


@dataclass(frozen=True)
class Step:
    action: Action
    input_ids: tuple[int, ...] = ()
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()
    output: dict[str, Any] | None = None  # DONE: the answer (stitched when migrated)
    dispatch_version: int = 0  # DONE: the version the sample counts as at dispatch (the oldest segment's)
    kept: int = 0  # tokens of the ended attempt carried into the next one
    regenerated: int = 0  # tokens thrown away (to be generated again)
    generated: int = 0  # tokens the ended attempt produced, as far as the caller knows
    segments: int = 1  # DONE: how many engines produced the sample
    reason: str = ""


class RequestJourney:
    """One request from its first send to its sample: attempts, excluded engines, kept segments."""

    def __init__(self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any], *, policy: RetryPolicy,
                 migrate: bool = True, eos_ids: Collection[int] = (), max_context: int | None = None) -> None:
        self.prompt_ids = tuple(int(t) for t in prompt_ids)
        self.sampling_params = dict(sampling_params)
        self.policy = policy
        self.migrate = migrate
        self.eos_ids = frozenset(eos_ids)
        self.max_context = max_context
        self.attempts = 0
        self.excluded: frozenset[str] = frozenset()
        self.segments: list[Segment] = []
        self._next = Step(Action.SEND, self.prompt_ids, dict(self.sampling_params), reason="first attempt")

    def send(self) -> Step:
        """The request to send now (counts one attempt)."""
        if self._next.action is not Action.SEND:
            raise RuntimeError(f"nothing to send: the request is {self._next.action.value}")
        self.attempts += 1
        return self._next

    # -- outcomes of an attempt ---------------------------------------------------------------------

    def answered(self, engine_id: str, output: Mapping[str, Any], version: int) -> Step:
        """The engine answered: a sample, or (aborted) a prefix to continue from."""
        meta = output.get("meta_info", {})
        generated = int(meta.get("completion_tokens", len(output.get("output_ids", ()))))
        if failure_from_finish_reason(meta.get("finish_reason")) is None:
            if not self.segments:
                return self._end(Step(Action.DONE, output=dict(output), dispatch_version=version,
                                      generated=generated, reason="answered"))
            final = Segment.from_output(engine_id, output, version)
            return self._stitched([*self.segments, final], meta["finish_reason"], generated)
        return self._after_failure(engine_id, FailureKind.ABORTED, output, version)

    def failed(self, engine_id: str, failure: FailureKind, prefix: Mapping[str, Any] | None, version: int) -> Step:
        """The attempt raised (engine unreachable, crashed, refused); ``prefix``: its last complete chunk."""
        return self._after_failure(engine_id, failure, prefix, version)

    # -- rules --------------------------------------------------------------------------------------

    def _after_failure(self, engine_id: str, failure: FailureKind, prefix: Mapping[str, Any] | None,
                       version: int) -> Step:
        part, why_not = _trusted(engine_id, prefix, version)
        generated = len(part) if part is not None else 0
        kept = regenerated = 0
        if not self.migrate:
            regenerated = generated
        else:
            if part is not None and len(part):
                self.segments.append(part)
            elif why_not:
                regenerated = _claimed_tokens(prefix)
            decision = continue_after(self.prompt_ids, self.sampling_params, self.segments, eos_ids=self.eos_ids,
                                      max_context=self.max_context)
            if decision.next is Next.COMPLETE:
                assert decision.finish_reason is not None
                return self._stitched(self.segments, decision.finish_reason, generated, kept=generated)
            if decision.next is Next.CONTINUE:
                kept = generated
                self._next = Step(Action.SEND, tuple(decision.input_ids), dict(decision.sampling_params))
            else:
                regenerated += sum(len(s) for s in self.segments)
                self.segments = []
                self._next = Step(Action.SEND, self.prompt_ids, dict(self.sampling_params))
            why_not = why_not or (decision.reason if decision.next is Next.RESTART else "")
        retry = self.policy.decide(failure, attempt=self.attempts, engine_id=engine_id, excluded=self.excluded)
        self.excluded = retry.exclude
        if not retry:
            lost = regenerated + sum(len(seg) for seg in self.segments)
            return self._end(Step(Action.LOST, generated=generated, regenerated=lost,
                                  reason=f"request failed on {engine_id}: {retry.reason}"))
        nxt = self._next
        reason = retry.reason + (f" ({why_not})" if why_not else f" ({kept} token(s) kept)" if kept else "")
        self._next = Step(Action.SEND, nxt.input_ids, nxt.sampling_params, exclude=self.excluded, kept=kept,
                          regenerated=regenerated, generated=generated, reason=reason)
        return self._next

    def _stitched(self, segments: list[Segment], finish_reason: Mapping[str, Any], generated: int, *,
                  kept: int = 0) -> Step:
        output = stitch(segments, len(self.prompt_ids), finish_reason)
        return self._end(Step(Action.DONE, output=output, dispatch_version=min(s.dispatch_version for s in segments),
                              generated=generated, kept=kept, segments=len(segments), reason="stitched"))

    def _end(self, step: Step) -> Step:
        self._next = step
        return step


def _trusted(engine_id: str, prefix: Mapping[str, Any] | None, version: int) -> tuple[Segment | None, str]:
    """The prefix as a segment when it is consistent; else None and why it was not trusted."""
    if not prefix:
        return None, ""
    try:
        return Segment.from_output(engine_id, prefix, version), ""
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return None, f"prefix from {engine_id} not trusted: {exc}"


def _claimed_tokens(prefix: Mapping[str, Any] | None) -> int:
    """How many tokens an untrusted prefix claimed (they count as regenerated)."""
    try:
        return len(prefix.get("output_ids", ())) if prefix else 0
    except TypeError:
        return 0
