"""A torch ``TCPStore`` server that listens on one address, not on every interface.

torch's store server binds the wildcard address whatever host it is given, so a trainer's rendezvous stores
(its own process group's, one per engine weight group) would answer anyone who can reach the machine, and
write access to a weight group's store lets a peer disturb or join a new engine's group. Here the socket is
bound by us — to loopback on one machine, to the node's address on a cluster: the address the peers need —
and handed to torch (``master_listen_fd``), which then owns it and closes it with the store.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["bound_store"]

LISTEN_BACKLOG = 128


def bound_store(address: str, port: int, world_size: int, timeout_s: float, *,
                wait_for_workers: bool = False) -> Any:
    """The server side of a store on ``address:port`` (port 0: a free one; read it from ``store.port``)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(LISTEN_BACKLOG)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here on
    return TCPStore(address, bound_port, world_size, is_master=True, wait_for_workers=wait_for_workers,
                    multi_tenant=True, master_listen_fd=fd, timeout=timedelta(seconds=timeout_s))
