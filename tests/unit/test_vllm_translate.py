"""The vLLM front's translations (relax.engines.vllm.translate): SGLang's contract in, vLLM 0.32's out, and back."""

from __future__ import annotations

import pytest

from relax.engines.event_stream import EventStream, sse
from relax.engines.vllm.translate import (
    Output,
    RequestRefused,
    abort_body,
    generate_call,
    pause_query,
    sample_rids,
    version_body,
)


def _rid() -> str:
    return "fresh"


def test_sampling_keys_are_renamed_and_sglang_defaults_kept() -> None:
    call = generate_call({"input_ids": [5, 6, 7], "rid": "r1", "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 9, "temperature": 0.7, "top_k": -1,
                                              "sampling_seed": 3, "no_stop_trim": True, "stop": None}}, _rid)
    assert call.vllm_body == {
        "token_ids": [5, 6, 7], "request_id": "r1", "stream": False, "output_mode": "text",
        "sampling_params": {"max_tokens": 9, "temperature": 0.7, "top_k": -1, "seed": 3,
                            "include_stop_str_in_output": True, "detokenize": True, "logprobs": 0}}
    assert (call.rid, call.prompt_tokens, call.n, call.return_logprob) == ("r1", 3, 1, True)
    # no max_new_tokens: SGLang's 128, not vLLM's "the rest of the context"; no rid: a fresh one
    bare = generate_call({"input_ids": [1]}, _rid)
    assert bare.vllm_body["sampling_params"] == {"max_tokens": 128, "detokenize": True}
    assert bare.rid == "fresh" and "logprobs" not in bare.vllm_body["sampling_params"]


@pytest.mark.parametrize(("body", "names"), [
    ({"input_ids": [1], "sampling_params": {"max_tokens": 4}}, "max_tokens"),  # vLLM's name: vLLM would drop ours
    ({"input_ids": [1], "sampling_params": {"regex": "a"}}, "regex"),
    ({"text": "hi"}, "input_ids only"),
    ({"input_ids": [[1, 2]]}, "batches"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [1, -2]}, "non-negative"),
    ({"input_ids": [1], "stream": "yes"}, "stream must be true or false"),
    ({"input_ids": [1], "stream": True, "sampling_params": {"n": 2}}, "send n requests"),
    ({"input_ids": [1], "lora_path": "x"}, "lora_path"),
    ({"input_ids": [1], "rid": ""}, "rid"),
    ([1, 2], "JSON object"),
])
def test_what_vllm_would_ignore_or_misread_is_refused_by_name(body: object, names: str) -> None:
    with pytest.raises(RequestRefused, match=names):
        generate_call(body, _rid)


def test_a_stream_folds_into_cumulative_chunks_labelled_until_vllm_reports_its_spans() -> None:
    out = Output("r", prompt_tokens=4, return_logprob=True)
    out.add({"token_ids": [10, 11], "text": "ab", "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}]},
             "finish_reason": None}, "3")
    first = out.answer("3")
    assert first["output_ids"] == [10, 11] and first["text"] == "ab"
    assert first["meta_info"]["finish_reason"] is None and first["meta_info"]["weight_version"] == "3"
    assert first["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 2}]
    assert first["meta_info"]["output_token_logprobs"] == [[-0.5, 10, None], [-1.0, 11, None]]
    # a refit relabelled the engine (while paused): later tokens carry the new label in the prefix
    out.add({"token_ids": [12], "text": "c", "logprobs": {"content": [{"logprob": -0.1}]}}, "4")
    assert out.answer("4")["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 2},
                                                                {"version": "4", "start": 2, "end": 3}]
    # the last chunk: EOS (stop_reason None), and vLLM's own spans replace the provisional ones
    out.add({"token_ids": [2], "text": "", "logprobs": {"content": [{"logprob": -0.2}]}, "finish_reason": "stop",
             "stop_reason": None, "weight_versions": [{"version": "3", "start": 0, "end": 3},
                                                      {"version": "4", "start": 3, "end": 4}]}, "4")
    final = out.answer("4")
    assert final["output_ids"] == [10, 11, 12, 2] and final["meta_info"]["completion_tokens"] == 4
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert final["meta_info"]["weight_versions"][0] == {"version": "3", "start": 0, "end": 3}
    assert final["meta_info"]["weight_version"] == "4"
    # what Relax's client keeps of such a stream: the newest complete chunk, the final answer after [DONE]
    held = EventStream()
    held.feed(sse(first) + sse(final) + b"data: [DONE]\n\n")
    assert held.done and held.latest() == final


@pytest.mark.parametrize(("reason", "stop_reason", "expected"), [
    ("length", None, {"type": "length", "length": 2}),
    ("abort", None, {"type": "abort", "message": "aborted by the engine"}),
    ("stop", 7, {"type": "stop", "matched": 7}),
    ("stop", None, {"type": "stop", "matched": 9}),
])
def test_finish_reasons_take_sglang_form(reason: str, stop_reason: int | None, expected: dict) -> None:
    out = Output("r", 1, False)
    out.add({"token_ids": [8, 9], "finish_reason": reason, "stop_reason": stop_reason}, "0")
    assert out.answer("0")["meta_info"]["finish_reason"] == expected
    assert "output_token_logprobs" not in out.answer("0")["meta_info"]


def test_samples_of_one_request_are_named_as_the_built_in_engine_names_them() -> None:
    assert sample_rids(generate_call({"input_ids": [1], "rid": "g"}, _rid)) == ["g"]
    assert sample_rids(generate_call({"input_ids": [1], "rid": "g", "sampling_params": {"n": 3}}, _rid)) == [
        "g-0", "g-1", "g-2"]


def test_pause_modes_map_to_vllm_and_none_is_refused() -> None:
    assert pause_query({"mode": "abort"}) == {"mode": "abort"}
    assert pause_query({}) == {"mode": "abort"}  # SGLang's default
    assert pause_query({"mode": "retract"}) == {"mode": "keep", "clear_cache": "true"}
    assert pause_query({"mode": "in_place"}) == {"mode": "keep", "clear_cache": "false"}
    for mode in ("none", "wait", 3):
        with pytest.raises(RequestRefused, match="abort, retract, in_place"):
            pause_query({"mode": mode})


def test_an_abort_never_turns_into_vllm_abort_everything_by_accident() -> None:
    assert abort_body({"rid": "", "abort_all": False}) is None  # vLLM aborts every request for an empty list
    assert abort_body({}) is None
    assert abort_body({"abort_all": True}) == {"request_ids": []}
    assert abort_body({"rid": "x"}) == {"request_ids": ["generate-tokens-x"]}
    with pytest.raises(RequestRefused):
        abort_body({"rid": 5})


def test_version_labels_are_strings() -> None:
    assert version_body({"new_version": "7"}) == "7"
    assert version_body({"new_version": 8}) == "8"
    for bad in ({}, {"new_version": ""}, {"new_version": True}, "7"):
        with pytest.raises(RequestRefused, match="new_version"):
            version_body(bad)
