"""A driver given a loopback RAY_ADDRESS without Ray's loopback switch (relax.cluster.loopback): pure rules."""

from __future__ import annotations

import pytest

from relax.cluster.loopback import must_keep_loopback, split_address
from relax.cluster.ray_auth import LOOPBACK_ENV as SWITCH

ROUTABLE = "192.0.2.2"


def routable(ip: str = ROUTABLE):
    return lambda: ip


def listening(*hosts: str):
    return lambda host, port: host in hosts


@pytest.mark.parametrize(("address", "parts"), [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)), ("localhost:1", ("localhost", 1)), ("10.0.0.5:6380", ("10.0.0.5", 6380)),
    ("auto", None), ("ray://127.0.0.1:10001", None), ("127.0.0.1:", None), ("127.0.0.1:gcs", None), (":6379", None),
])
def test_split_address(address: str, parts) -> None:
    assert split_address(address) == parts


def test_a_cluster_bound_to_loopback_only_keeps_the_driver_there() -> None:
    assert must_keep_loopback("127.0.0.1:6379", {}, SWITCH, routable(), listening("127.0.0.1"))
    assert must_keep_loopback("localhost:6379", {}, SWITCH, routable(), listening("127.0.0.1"))


@pytest.mark.parametrize(("address", "env", "routable_ip", "answers"), [
    ("127.0.0.1:6379", {}, ROUTABLE, listening("127.0.0.1", ROUTABLE)),  # bound everywhere: Ray's swap works
    ("127.0.0.1:6379", {SWITCH: "0"}, ROUTABLE, listening("127.0.0.1")),  # the switch is already set
    ("127.0.0.1:6379", {}, ROUTABLE, listening()),  # nothing answers: Ray's own error, not a guess
    ("127.0.0.1:6379", {}, "127.0.0.1", listening("127.0.0.1")),  # no routable address: Ray stays on loopback
    ("10.0.0.5:6379", {}, ROUTABLE, listening("127.0.0.1")),  # not a loopback address
    ("auto", {}, ROUTABLE, listening("127.0.0.1")),
])
def test_otherwise_ray_decides(address: str, env: dict, routable_ip: str, answers) -> None:
    assert not must_keep_loopback(address, env, SWITCH, routable(routable_ip), answers)


def test_nothing_is_probed_when_the_address_or_the_environment_decides() -> None:
    def never():
        raise AssertionError("probed")
    assert not must_keep_loopback("10.0.0.5:6379", {}, SWITCH, never, never)
    assert not must_keep_loopback("127.0.0.1:6379", {SWITCH: "0"}, SWITCH, never, never)
