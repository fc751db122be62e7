"""Small network helpers: free ports and the address other nodes can reach us on.

Kept free of Ray at import time so unit tests and the launcher can use them anywhere.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """Return a TCP port that is free on ``host`` right now.

    The OS picks it (bind to port 0), so two callers never get the same port at the same instant. The
    port is released before returning, so a small race with other processes remains; callers that start
    a server on it should treat "address already in use" as retryable.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "", avoid: Iterable[int] = ()) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` right now, none of them in ``avoid``.

    Calls of :func:`free_port` one after another may return the same port (it is released in between), and Ray
    refuses to start when two of its components are given one port. These sockets stay bound until all are
    drawn, so the ports differ from each other; ports already promised elsewhere go in ``avoid``.
    """
    taken, ports = set(avoid), []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                                     socket.SOCK_STREAM))
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in taken:
                taken.add(port)
                ports.append(port)
    return ports


def node_ip() -> str:
    """The IP address of this node as Ray knows it, or 127.0.0.1 outside Ray.

    Engines bind to this address only when asked to (``host="node"``): servers that other nodes must
    reach need it, local runs are safer on the loopback interface.
    """
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a hard dependency, but keep the helper standalone
        return LOCALHOST
    if not ray.is_initialized():
        return LOCALHOST
    return str(ray.util.get_node_ip_address())


def port_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection on ``host:port`` within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
