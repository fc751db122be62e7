"""One process group between the trainer's rank 0 and one engine, for broadcast weight updates.

Why a group per engine and not one for all (docs/architecture.md, "Weights and staleness"): a torch
process group has a fixed membership, so with one shared group every scale-out or scale-in would rebuild
it for everybody, and one engine that dies in the middle of a broadcast would stall the collective for
every other engine until the timeout. With one small group per engine (world size 1 + the engine's
tensor-parallel ranks) a joining engine costs one group set-up (tens of milliseconds over loopback, a TCP
rendezvous on a cluster), a leaving or dead engine only ever breaks its own group, and the broadcasts to
different engines are independent collectives that run at the same time. The price is that rank 0 sends
the bytes once per engine instead of once in a tree: N times the trainer's egress.

Each group has its own rendezvous: a ``TCPStore`` that the trainer side hosts on a free port (port 0, so
no race with other runs), which the engine reaches through ``/init_weights_update_group``'s
``master_address``/``master_port`` as in SGLang. Gloo on CPU, NCCL on GPU. Nothing here touches
``torch.distributed``'s default group: the trainer's own FSDP group is unaffected.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

import torch

__all__ = ["BACKENDS", "WeightGroup", "join_group"]

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class WeightGroup:
    """A process group of ``world_size`` ranks made for weight broadcasts (rank 0 sends)."""

    def __init__(self, name: str, pg: object, rank: int, world_size: int, backend: str,
                 store: object, timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._pg = pg
        self._store = store  # kept alive: the master's store must outlive the group's rendezvous

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` from rank ``src`` (in place on the receivers); raises on timeout or a dead peer."""
        work = self._pg.broadcast(tensor, src, timedelta(seconds=self.timeout_s))  # type: ignore[attr-defined]
        work.wait()

    def close(self) -> None:
        """Release the group (best effort: a peer that died leaves nothing to agree with)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        for method in ("abort", "shutdown"):
            fn = getattr(pg, method, None)
            if fn is not None:
                with contextlib.suppress(Exception):  # a dead peer makes these raise; nothing to agree with
                    fn()
                break
        self._store = None


def join_group(name: str, master_address: str, master_port: int, rank: int, world_size: int,
               backend: str = "gloo", timeout_s: float = 60.0, *, store: object | None = None,
               device: torch.device | None = None) -> WeightGroup:
    """Join (rank > 0) or host (rank 0, with ``store`` made by :func:`host_store`) one weight group.

    Blocks until all ``world_size`` ranks have joined or ``timeout_s`` passes.
    """
    from torch.distributed import TCPStore

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
    prefixed = torch.distributed.PrefixStore(f"relax-weights/{name}", store)  # type: ignore[attr-defined]
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg: object = ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        from torch.distributed import ProcessGroupNCCL

        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout  # noqa: SLF001 - the only way to give a standalone NCCL group a timeout
        pg = ProcessGroupNCCL(prefixed, rank, world_size, options)
    log.info("weight group %s: rank %d/%d joined (%s, %s:%s)", name, rank, world_size, backend, master_address,
             master_port)
    return WeightGroup(name, pg, rank, world_size, backend, store, timeout_s)


def host_store(address: str, world_size: int, timeout_s: float) -> tuple[object, int]:
    """A rendezvous store that rank 0 hosts on a free port; returns ``(store, port)``."""
    from torch.distributed import TCPStore

    store = TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout_s))
    return store, int(store.port)
