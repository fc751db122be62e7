"""The wrapper around Ray's private drain API falls back cleanly where Ray cannot say."""

from __future__ import annotations

import logging

import ray

from relax.cluster import drain


def test_an_old_ray_reports_no_notices_and_says_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(ray, "__version__", "2.50.1")
    monkeypatch.setattr(drain, "_warned", False)
    assert drain.supported() is False
    with caplog.at_level(logging.WARNING, logger="relax.cluster"):
        assert drain.draining_nodes() is None
        assert drain.draining_nodes() is None
    assert [r.getMessage() for r in caplog.records].count(
        "Ray 2.50.1 has no drain notices (needs >= 2.57): evictions are seen only when engines die") == 1


def test_the_pinned_ray_is_supported_and_an_unreachable_gcs_is_not_an_error(monkeypatch) -> None:
    assert drain.supported() is True  # Ray 2.60 is pinned
    monkeypatch.setattr(drain, "_warned", True)
    if not ray.is_initialized():
        assert drain.draining_nodes() is None  # no cluster to ask: no notices, no exception
