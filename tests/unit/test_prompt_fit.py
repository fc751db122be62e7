"""Which prompts the engines can serve (``data.prompt_fit``): the rest are dropped at load, counted, the first
one's line named; a file with none left is one clear error."""

from __future__ import annotations

import pytest

from relax.data.dataset import DataError, PromptDataset, PromptRecord
from relax.data.prompt_fit import DroppedPrompts, fit_prompts


def dataset(n: int) -> PromptDataset:
    return PromptDataset("train.jsonl", tuple(PromptRecord(i, i + 1, f"p{i}", "l", f"p{i}") for i in range(n)))


def test_prompts_over_the_flag_or_without_room_for_the_response_are_dropped() -> None:
    kept, dropped = fit_prompts(dataset(5), [10, 300, 40, 250, 1_000_000], max_prompt_len=280, context_len=256,
                                max_new_tokens=8)
    assert [r.line for r in kept.records] == [1, 3]
    assert [r.index for r in kept.records] == [0, 2]  # indices stay the file's: samples name their prompt
    assert dropped == DroppedPrompts(too_long=2, no_room=1, first_line=2)
    assert dropped.describe("train.jsonl", 280, 256, 8) == (
        "train.jsonl: dropped 3 prompt(s) the engines cannot serve (2 longer than --rollout-max-prompt-len 280; 1 "
        "leaving no room for 8 response tokens in the engine's context of 256); the first is on line 2")


def test_the_context_alone_drops_what_cannot_fit_and_nothing_is_dropped_without_limits() -> None:
    kept, dropped = fit_prompts(dataset(3), [248, 249, 10], max_prompt_len=None, context_len=256, max_new_tokens=8)
    assert [r.line for r in kept.records] == [1, 3] and dropped == DroppedPrompts(no_room=1, first_line=2)
    kept, dropped = fit_prompts(dataset(2), [10**6, 1], max_prompt_len=None, context_len=None, max_new_tokens=8)
    assert len(kept) == 2 and dropped.count == 0


def test_a_file_with_no_servable_prompt_is_one_clear_error() -> None:
    with pytest.raises(DataError, match=r"dropped 2 prompt\(s\) .*: no prompt is left; shorten the prompts"):
        fit_prompts(dataset(2), [300, 400], max_prompt_len=None, context_len=256, max_new_tokens=8)
