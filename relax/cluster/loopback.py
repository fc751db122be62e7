"""Whether a driver given a loopback ``RAY_ADDRESS`` must stay on loopback to reach its cluster.

Ray replaces the 127.0.0.1 of a driver's address with the machine's routable address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set (``relax.cluster.ray_auth.LOOPBACK_ENV``). A cluster that
listens on every interface (``ray start --head``'s default) is reached either way. One bound to 127.0.0.1
only (``relax cluster up``, Relax's embedded clusters) is not: the driver retries on the routable address
for ever, printing a connection warning every few seconds and never failing. So when the switch is missing
and only the loopback listener answers, the driver keeps to loopback itself. Pure: the probe is injected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` -> (host, port); None for anything else (a ``ray://`` URL, ``auto``, a port that is not one)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "://" in address or not port.isdigit():
        return None
    return host, int(port)


def must_keep_loopback(address: str, env: Mapping[str, str], loopback_env: str, routable_ip: Callable[[], str],
                       answers: Callable[[str, int], bool]) -> bool:
    """True when ``address`` is on loopback, ``env`` lacks the switch, and the cluster's GCS port answers on
    127.0.0.1 but not on the routable address (where Ray would go instead). ``routable_ip`` and ``answers`` are
    asked only when the address and the environment leave the question open."""
    parts = split_address(address)
    if parts is None or loopback_env in env or parts[0] not in LOOPBACK_HOSTS:
        return False
    port, routable = parts[1], routable_ip()
    if routable in LOOPBACK_HOSTS:
        return False
    return answers("127.0.0.1", port) and not answers(routable, port)
