"""Who can reach a Ray cluster: the sockets its processes listen on, and whether a driver can attach.

Shared by the tests that check Ray stays locked (the embedded cluster, the elastic cluster).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

import psutil

LOOPBACK = frozenset({"127.0.0.1", "::ffff:127.0.0.1", "::1"})
_ATTACH = "import ray; ray.init(address={address!r}, log_to_driver=False); print('ATTACHED', flush=True)"


#: Ray tries a GCS that refuses it 20 times, a second apart, before it gives up (``RAY_NUM_REDIS_GET_RETRIES``):
#: 20 s for each refused driver. Every try is refused alike, so 3 show the same refusal (unless ``env`` says).
REFUSED_AFTER_TRIES = {"RAY_NUM_REDIS_GET_RETRIES": "3"}


def attach(address: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A fresh driver process with ``env`` tries to join ``address``; it prints ATTACHED when it got in."""
    return subprocess.run([sys.executable, "-c", _ATTACH.format(address=address)], capture_output=True, text=True,
                          timeout=timeout, env={**REFUSED_AFTER_TRIES, **env})


def listening(pids: Iterable[int]) -> set[tuple[int, str, str]]:
    """(pid, process name, address) of every TCP socket these processes listen on (gone ones skipped)."""
    out: set[tuple[int, str, str]] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out |= {(pid, proc.name(), c.laddr.ip) for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return out


def not_loopback(pids: Iterable[int]) -> set[tuple[int, str, str]]:
    """The listening sockets of ``pids`` that other machines could reach."""
    return {s for s in listening(pids) if s[2] not in LOOPBACK}
