"""The pure part of the SGLang router mirror: what a pass adds and removes, and how the router's list is read.

The shell against the real ``sglang-router`` is tests/integration/test_sglang_router_mirror.py.
"""

from __future__ import annotations

import pytest

from relax.rollout.routing.router_mirror import MirrorPlan, RouterAPIError, canonical_url, parse_workers, plan_changes

A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


def test_adds_what_relax_routes_and_the_router_lacks() -> None:
    assert plan_changes([A, B], [], managed=[]) == MirrorPlan(add=(A, B))


def test_removes_managed_workers_relax_no_longer_routes() -> None:
    assert plan_changes([A], [A, B], managed=[A, B]) == MirrorPlan(remove=(B,))


def test_leaves_other_peoples_workers_alone() -> None:
    foreign = "http://10.9.9.9:8000"
    assert plan_changes([A], [A, foreign], managed=[A, B]) == MirrorPlan()


def test_in_sync_is_an_empty_plan() -> None:
    plan = plan_changes([A, B], [B, A], managed=[A, B, C])
    assert plan == MirrorPlan() and not plan


def test_removal_and_addition_in_one_pass_removes_first() -> None:
    plan = plan_changes([C], [A], managed=[A])
    assert plan.remove == (A,) and plan.add == (C,)
    assert bool(plan)


def test_a_registration_that_finished_late_is_removed() -> None:
    # Relax asked for B, gave it up, and the router's background job listed it afterwards: B is ours, not wanted.
    assert plan_changes([A], [A, B], managed=[A, B]) == MirrorPlan(remove=(B,))


def test_urls_compare_canonically() -> None:
    assert plan_changes(["HTTP://Host-1:30000/"], ["http://host-1:30000"], managed=[]) == MirrorPlan()
    assert canonical_url("http://[::1]:8000/") == "http://[::1]:8000"
    assert canonical_url("not a url/") == "not a url"


def test_parse_workers_reads_0_3_2s_listing() -> None:
    body = {"workers": [{"id": "7b1c", "url": "http://10.0.0.1:30000/", "is_healthy": True},
                        {"id": "9f00", "url": B}], "total": 2}
    assert parse_workers(body) == {A: "7b1c", B: "9f00"}
    assert parse_workers({"workers": [], "total": 0}) == {}


@pytest.mark.parametrize("body", [None, [], {"urls": [A]}, {"workers": [{"url": A}]}, {"workers": [{"id": 1}]}])
def test_parse_workers_refuses_other_shapes_with_a_clear_error(body: object) -> None:
    with pytest.raises(RouterAPIError, match="/workers"):
        parse_workers(body)


def test_the_flag_is_ours_not_an_sglang_passthrough() -> None:
    from relax.config.flags import parse_args

    args = parse_args(["--sglang-router-url", "http://10.0.0.5:30000/"])
    assert args.sglang_router_url == "http://10.0.0.5:30000"
    assert args.sglang_passthrough == () and parse_args([]).sglang_router_url is None


@pytest.mark.parametrize(("value", "why"), [
    ("10.0.0.5:30000", "missing 'http://'"),
    ("ftp://10.0.0.5:30000", "http(s) URL"),
    ("http://user:pw@10.0.0.5:30000", "without credentials"),
    ("http://10.0.0.5:30000/?x=1", "without credentials, query or fragment"),
    ("http://10.0.0.5:99999", "not a URL"),
])
def test_a_malformed_router_url_is_one_line_naming_the_flag(value: str, why: str) -> None:
    from relax.config.flags import ConfigError, parse_args

    with pytest.raises(ConfigError) as info:
        parse_args(["--sglang-router-url", value])
    message = str(info.value)
    assert message.startswith("--sglang-router-url: ") and why in message and "\n" not in message
