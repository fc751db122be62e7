"""Small network helpers: free ports and the address other nodes can reach us on.

Kept free of Ray at import time so unit tests and the launcher can use them anywhere.
"""

from __future__ import annotations

import socket

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """Return a TCP port that is free on ``host`` right now.

    The OS picks it (bind to port 0), so two callers never get the same port at the same instant. The
    port is released before returning, so a small race with other processes remains; callers that start
    a server on it should treat "address already in use" as retryable.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
