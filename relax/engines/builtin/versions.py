"""Which weight versions produced which tokens of a request (pure; SGLang's ``meta_info.weight_versions``).

A weight update can land while a request is generating (a paused-and-retracted request resumes on the new
weights; an in-place load lets it continue). SGLang records, for every live request that has output at
that moment, the old version and how many tokens it had; at the end the request's answer carries
``weight_version`` — the *newest* version that produced any of its tokens — and ``weight_versions``, the
spans ``[{"version", "start", "end"}]`` over the output tokens. The built-in engine reports the same, so
the manager's version accounting is tested against SGLang's real shape.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VersionChange", "VersionSpan", "version_spans"]


@dataclass(frozen=True)
class VersionChange:
    """At an update: the version being replaced and how many output tokens the request had then."""

    old_version: str
    num_output_tokens: int


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` came from ``version``."""

    version: str
    start: int
    end: int

    def to_json(self) -> dict[str, str | int]:
        return {"version": self.version, "start": self.start, "end": self.end}


def version_spans(changes: list[VersionChange], current_version: str, num_output_tokens: int) -> list[VersionSpan]:
    """The spans of a finished request: one per version that produced tokens, in order; never empty.

    An update that found no new tokens since the previous one adds no span; consecutive spans of one
    version merge; a request with no output has a single empty span of the current version.
    """
    boundaries = [(c.old_version, min(c.num_output_tokens, num_output_tokens)) for c in changes]
    boundaries.append((current_version, num_output_tokens))
    spans: list[VersionSpan] = []
    for version, end in boundaries:
        if spans and end <= spans[-1].end:
            continue  # no token came from this version
        if spans and spans[-1].version == version:
            spans[-1] = VersionSpan(version, spans[-1].start, end)
            continue
        spans.append(VersionSpan(version, spans[-1].end if spans else 0, end))
    return spans
