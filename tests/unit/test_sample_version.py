"""The version a sample counts as: the oldest that produced any of its tokens (SGLang reports the newest)."""

from __future__ import annotations

import pytest

from relax.data.sample import Sample
from relax.rollout.dispatch.generator import sample_version


@pytest.mark.parametrize(
    ("meta", "dispatch", "expected"),
    [
        # SGLang 0.5.23: weight_version is the newest; the spans say v3 made the first 5 tokens
        ({"weight_version": "4", "weight_versions": [{"version": "3", "start": 0, "end": 5},
                                                     {"version": "4", "start": 5, "end": 9}]}, 3,
         (3, ((3, 0, 5), (4, 5, 9)))),
        ({"weight_version": "4", "weight_versions": [{"version": "4", "start": 0, "end": 9}]}, 3, (4, ((4, 0, 9),))),
        ({"weight_version": "4"}, 3, (3, ())),  # an older build without spans: the dispatch version bounds it
        ({"weight_version": "2"}, 3, (2, ())),
        ({}, 3, (3, ())),
        ({"weight_version": "default"}, 3, (3, ())),  # SGLang's default version string
        ({"weight_version": "4", "weight_versions": [{"version": "x"}]}, 3, (3, ())),  # malformed spans: ignored
        ({"weight_version": "4", "weight_versions": "nope"}, 3, (3, ())),
    ],
)
def test_sample_version(meta: dict, dispatch: int, expected: tuple) -> None:
    assert sample_version(meta, dispatch) == expected


def test_spans_survive_the_dict_round_trip() -> None:
    sample = Sample(prompt_index=0, group_id="g", sample_index=0, prompt_token_ids=(1,), response_token_ids=(2, 3),
                    response_text="", label="1", weight_version=3, rollout_step=0,
                    weight_version_spans=((3, 0, 1), (4, 1, 2)))
    data = sample.to_dict()
    assert data["weight_version_spans"] == [[3, 0, 1], [4, 1, 2]]
    assert Sample.from_dict(data) == sample
    with pytest.raises(ValueError, match="triples"):
        Sample.from_dict({**data, "weight_version_spans": [[3, 0]]})
