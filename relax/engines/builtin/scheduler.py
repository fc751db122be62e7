"""Requests and the admission rule of the built-in engine (pure: no torch, no threads).

Admission is FIFO and reservation-based: a request is admitted into the running batch only if
the batch has a free slot (`max_running_requests`) and its worst-case footprint
(prompt + max_new_tokens) fits into the token capacity left (`max_total_tokens`). Everything
else waits in the queue, which is what `sglang:num_queue_reqs` reports. Reserving the worst case
means a running request can never be evicted for lack of capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from relax.engines.builtin.sampling import SamplingParams
from relax.engines.builtin.versions import VersionChange, VersionSpan


class FinishType(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Request:
    """One sequence being generated. Mutable: the engine loop appends tokens to it."""

    rid: str
    parent_rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    on_finish: Callable[[Request], None] | None = None
    #: Called by the engine thread after each step that gave this request a token and did not finish it (the
    #: server's streaming: it decides there, cheaply, whether a chunk is due).
    on_progress: Callable[[Request], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: dict[str, Any] | None = None
    output_text: str = ""
    weight_version: str = ""  # at finish: the newest version that produced a token (SGLang's meta_info)
    version_changes: list[VersionChange] = field(default_factory=list)  # updates seen while generating
    version_spans: list[VersionSpan] = field(default_factory=list)  # at finish: which version made which tokens
    retracted: bool = False  # put back in the queue by a retract pause, not yet running again

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def used_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def matches(self, rid: str) -> bool:
        """A rid addresses a request or, for n > 1 / batched input, all of its children."""
        return rid in (self.rid, self.parent_rid)


@dataclass(frozen=True)
class Capacity:
    max_running_requests: int
    max_total_tokens: int


def admit(waiting: Iterable[Request], running: list[Request], capacity: Capacity) -> list[Request]:
    """Requests to move from the queue into the batch now, in FIFO order.

    Stops at the first request that does not fit, so a large request is not starved by a stream
    of small ones behind it (head-of-line order is the fairness rule).
    """
    slots = capacity.max_running_requests - len(running)
    tokens_left = capacity.max_total_tokens - sum(r.reserved_tokens for r in running)
    chosen: list[Request] = []
    for req in waiting:
        if slots <= 0 or req.reserved_tokens > tokens_left:
            break
        chosen.append(req)
        slots -= 1
        tokens_left -= req.reserved_tokens
    return chosen


class RequestQueue:
    """FIFO of waiting requests with removal by rid (for aborts)."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def push(self, req: Request) -> None:
        self._items.append(req)

    def push_front(self, reqs: list[Request]) -> None:
        """Put retracted requests back at the head so they keep their turn."""
        for req in reversed(reqs):
            self._items.appendleft(req)

    def remove(self, reqs: Iterable[Request]) -> None:
        gone = {id(r) for r in reqs}
        self._items = deque(r for r in self._items if id(r) not in gone)

    def pop_matching(self, rid: str | None) -> list[Request]:
        """Remove and return requests addressed by rid (all when rid is None)."""
        hit = [r for r in self._items if rid is None or r.matches(rid)]
        self.remove(hit)
        return hit


def check_stop(
    req: Request, token_id: int, text: str, eos_token_ids: frozenset[int]
) -> tuple[dict[str, Any] | None, str]:
    """Decide whether `req` finished after emitting `token_id`; returns (finish_reason, text).

    `text` is the decoded output so far; a matched stop string is trimmed from it (SGLang's
    default, unless `no_stop_trim`).
    """
    params = req.params
    if not params.ignore_eos and token_id in eos_token_ids:
        return {"type": FinishType.STOP.value, "matched": token_id}, text
    if token_id in params.stop_token_ids:
        return {"type": FinishType.STOP.value, "matched": token_id}, text
    for stop in params.stop:
        idx = text.find(stop)
        if idx >= 0:
            trimmed = text if params.no_stop_trim else text[:idx]
            return {"type": FinishType.STOP.value, "matched": stop}, trimmed
    if len(req.output_ids) >= params.max_new_tokens:
        return {"type": FinishType.LENGTH.value, "length": len(req.output_ids)}, text
    return None, text
