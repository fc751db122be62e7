"""Which prompts an engine can serve (pure): a prompt longer than ``--rollout-max-prompt-len``, or one that leaves
no room in the engine's context for the response budget, is dropped when the data is loaded.

Why at load: an engine refuses such a request with a client error, which no retry can fix; found mid-run it
would end the run at that line of the file, hours or days in. Dropped prompts are counted and the first one's
line named, once, so a data problem is seen without stopping anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from relax.data.dataset import DataError, PromptDataset

__all__ = ["DroppedPrompts", "fit_prompts"]


@dataclass(frozen=True)
class DroppedPrompts:
    too_long: int = 0  # over --rollout-max-prompt-len
    no_room: int = 0  # prompt + response budget over the engine's context
    first_line: int | None = None  # the file's line of the first dropped prompt

    @property
    def count(self) -> int:
        return self.too_long + self.no_room

    def describe(self, path: str, max_prompt_len: int | None, context_len: int | None, max_new_tokens: int) -> str:
        parts = []
        if self.too_long:
            parts.append(f"{self.too_long} longer than --rollout-max-prompt-len {max_prompt_len}")
        if self.no_room:
            parts.append(f"{self.no_room} leaving no room for {max_new_tokens} response tokens in the engine's "
                         f"context of {context_len}")
        return (f"{path}: dropped {self.count} prompt(s) the engines cannot serve ({'; '.join(parts)}); the first "
                f"is on line {self.first_line}")


def fit_prompts(dataset: PromptDataset, prompt_lengths: Sequence[int], *, max_prompt_len: int | None,
                context_len: int | None, max_new_tokens: int) -> tuple[PromptDataset, DroppedPrompts]:
    """The prompts the engines can serve, and what was dropped. ``prompt_lengths[i]`` is record ``i``'s tokens.
    A file none of whose prompts fits is a :class:`DataError` (one line), not an empty run."""
    kept, too_long, no_room, first = [], 0, 0, None
    for record, length in zip(dataset.records, prompt_lengths, strict=True):
        if max_prompt_len is not None and length > max_prompt_len:
            too_long += 1
        elif context_len is not None and length + max_new_tokens > context_len:
            no_room += 1
        else:
            kept.append(record)
            continue
        first = record.line if first is None else first
    dropped = DroppedPrompts(too_long, no_room, first)
    if not kept:
        raise DataError(dropped.describe(dataset.path, max_prompt_len, context_len, max_new_tokens)
                        + ": no prompt is left; shorten the prompts or raise the limits")
    return replace(dataset, records=tuple(kept)), dropped
