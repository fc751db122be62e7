"""Weight-version spans of a request (SGLang's meta_info.weight_versions), a pure function."""

from __future__ import annotations

import pytest

from relax.engines.builtin.versions import VersionChange, VersionSpan, version_spans


@pytest.mark.parametrize(
    ("changes", "current", "n", "expected"),
    [
        ([], "3", 10, [("3", 0, 10)]),  # no update while generating: one span, the current version
        ([], "3", 0, [("3", 0, 0)]),  # no output at all: still one (empty) span
        ([VersionChange("1", 4)], "2", 10, [("1", 0, 4), ("2", 4, 10)]),
        ([VersionChange("1", 4), VersionChange("2", 7)], "3", 9, [("1", 0, 4), ("2", 4, 7), ("3", 7, 9)]),
        ([VersionChange("1", 4), VersionChange("2", 4)], "3", 9, [("1", 0, 4), ("3", 4, 9)]),  # v2 made nothing
        ([VersionChange("1", 4)], "1", 9, [("1", 0, 9)]),  # same version again: one span
        ([VersionChange("1", 12)], "2", 9, [("1", 0, 9)]),  # tokens cut back after the update: clamped
    ],
)
def test_spans(changes: list[VersionChange], current: str, n: int, expected: list[tuple[str, int, int]]) -> None:
    spans = version_spans(changes, current, n)
    assert spans == [VersionSpan(*e) for e in expected]
    assert spans[0].start == 0 and spans[-1].end == n
    assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))


def test_span_json_is_sglangs_shape() -> None:
    assert VersionSpan("2", 4, 10).to_json() == {"version": "2", "start": 4, "end": 10}
