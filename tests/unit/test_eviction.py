"""Evictions planned from Ray's drain notices (relax.rollout.fleet.eviction)."""

from __future__ import annotations

from relax.rollout.fleet.eviction import plan_evictions
from relax.rollout.settings import EvictionSettings

S = EvictionSettings(margin_s=5.0, default_budget_s=30.0)


def test_every_engine_on_a_draining_node_gets_the_time_left_minus_the_margin() -> None:
    plans = plan_evictions({"n1": 100_000 + 25_000}, {"n1": ["e2", "e1"], "n2": ["e3"]}, now_ms=100_000, settings=S)
    assert [(p.engine_id, p.budget_s, p.node_id) for p in plans] == [("e1", 20.0, "n1"), ("e2", 20.0, "n1")]


def test_no_deadline_takes_the_default_and_a_past_one_gives_no_time() -> None:
    plans = plan_evictions({"a": 0, "b": 50_000}, {"a": ["e1"], "b": ["e2"]}, now_ms=60_000, settings=S)
    assert [(p.engine_id, p.budget_s) for p in plans] == [("e2", 0.0), ("e1", 30.0)]  # soonest first


def test_engines_already_leaving_and_nodes_without_engines_are_skipped() -> None:
    assert plan_evictions({"n1": 0, "n9": 0}, {"n1": ["e1"]}, now_ms=0, leaving={"e1"}, settings=S) == []


def test_a_deadline_inside_the_margin_is_an_immediate_eviction() -> None:
    (p,) = plan_evictions({"n1": 3_000}, {"n1": ["e1"]}, now_ms=0, settings=S)
    assert p.budget_s == 0.0 and p.deadline_ms == 3_000
