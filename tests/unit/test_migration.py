"""Stitching rules of migrated generations (relax.rollout.dispatch.migration)."""

from __future__ import annotations

import pytest

from relax.data.sample import Sample  # noqa: F401 - the shape the stitched answer feeds
from relax.rollout.dispatch.generator import sample_version
from relax.rollout.dispatch.migration import Next, Segment, continue_after, stitch

EOS = 2
PROMPT = (10, 11, 12)


def seg(ids, version="3", engine="e1", start_lp=-0.5) -> Segment:
    return Segment(engine, tuple(ids), tuple(start_lp - i for i in range(len(ids))),
                   ({"version": version, "start": 0, "end": len(ids)},) if ids else (), "".join(f"<{t}>" for t in ids))


def test_an_aborted_request_continues_with_the_prefix_and_the_remaining_budget() -> None:
    params = {"max_new_tokens": 10, "temperature": 0.7, "min_new_tokens": 6, "stop_token_ids": [99]}
    d = continue_after(PROMPT, params, [seg([5, 6, 7, 8])], eos_ids={EOS}, max_context=64)
    assert d.next is Next.CONTINUE
    assert d.input_ids == (*PROMPT, 5, 6, 7, 8)
    assert d.sampling_params == {"max_new_tokens": 6, "temperature": 0.7, "min_new_tokens": 2, "stop_token_ids": [99]}
    assert params["max_new_tokens"] == 10  # the original is untouched


def test_a_stop_token_exactly_at_the_boundary_completes_the_sample() -> None:
    d = continue_after(PROMPT, {"max_new_tokens": 10}, [seg([5, EOS])], eos_ids={EOS})
    assert d.next is Next.COMPLETE and d.finish_reason == {"type": "stop", "matched": EOS}
    d = continue_after(PROMPT, {"max_new_tokens": 10, "stop_token_ids": [7]}, [seg([5, 7])])
    assert d.next is Next.COMPLETE
    # ignore_eos: the stop token is just a token, generation goes on
    assert continue_after(PROMPT, {"max_new_tokens": 10, "ignore_eos": True}, [seg([5, EOS])],
                          eos_ids={EOS}).next is Next.CONTINUE


def test_a_budget_already_spent_completes_as_length() -> None:
    d = continue_after(PROMPT, {"max_new_tokens": 4}, [seg([5, 6]), seg([7, 8])], eos_ids={EOS})
    assert d.next is Next.COMPLETE and d.finish_reason == {"type": "length", "length": 4}


def test_a_prefix_longer_than_the_next_engines_context_restarts_from_the_prompt() -> None:
    d = continue_after(PROMPT, {"max_new_tokens": 100}, [seg(range(20, 40))], max_context=23)
    assert d.next is Next.RESTART and d.input_ids == PROMPT and d.sampling_params["max_new_tokens"] == 100
    assert "exceed the next engine's context (23)" in d.reason
    assert continue_after(PROMPT, {"max_new_tokens": 100}, [seg(range(20, 39))], max_context=23).next is Next.CONTINUE


def test_nothing_generated_yet_is_a_plain_retry() -> None:
    assert continue_after(PROMPT, {"max_new_tokens": 8}, [seg([])]).next is Next.RESTART


def test_stitching_concatenates_tokens_logprobs_and_shifts_the_version_spans() -> None:
    a = Segment("e1", (5, 6, 7), (-0.1, -0.2, -0.3), ({"version": "3", "start": 0, "end": 2},
                                                        {"version": "4", "start": 2, "end": 3}), "abc", 3)
    b = Segment("e2", (8, 9), (-0.4, -0.5), ({"version": "4", "start": 0, "end": 2},), "de", 4)
    out = stitch([a, b], prompt_tokens=3, finish_reason={"type": "length", "length": 5})
    meta = out["meta_info"]
    assert out["output_ids"] == [5, 6, 7, 8, 9] and out["text"] == "abcde"
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == [5, 6, 7, 8, 9]
    assert meta["weight_versions"] == [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert meta["weight_version"] == "4" and meta["completion_tokens"] == 5
    assert meta["segments"] == [{"engine_id": "e1", "tokens": 3}, {"engine_id": "e2", "tokens": 2}]
    assert sample_version(meta, 4)[0] == 3  # the oldest segment decides staleness


def test_a_segment_from_an_engine_answer_keeps_its_spans_or_takes_the_reported_version() -> None:
    out = {"text": "x", "output_ids": [1, 2],
           "meta_info": {"output_token_logprobs": [[-1.0, 1, None], [-2.0, 2, None]], "weight_version": "7"}}
    s = Segment.from_output("e9", out, dispatch_version=7)
    assert s.logprobs == (-1.0, -2.0) and s.spans == ({"version": "7", "start": 0, "end": 2},)
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        Segment.from_output("e9", {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}})
