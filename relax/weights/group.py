"""The weight-update process group, built the way SGLang 0.5.23 builds it, used by both ends in Relax.

A broadcast update only works if the trainer and the engine agree on every key they exchange through the
rendezvous store, so this module does exactly what SGLang's engine does for ``/init_weights_update_group``
(``init_custom_process_group``; docs/architecture.md, "Weights and staleness"), and what the
trainers that speak to SGLang (slime, verl, OpenRLHF) do on their side:

1. torch's ``tcp://<master_address>:<master_port>`` rendezvous: rank 0 (the trainer) hosts the TCP store,
   the engine's ranks (``rank_offset + tp_rank``) connect to it;
2. the store wrapped as ``PrefixStore(group_name, store)``;
3. the group made by torch's ``_new_process_group_helper(world_size, rank, [], backend, store,
   group_name=group_name, timeout=...)``, which adds its own ``<group_name>/`` and per-device prefixes before
   the backend exchanges its addresses, and the group's ranks mapped to themselves.

A group built any other way (another prefix, a backend object made directly on the store) writes keys the
other side never reads: both wait until the timeout. The built-in engine and the trainer's sender both call
:func:`init_weight_group`, and the tests check each of them against a peer written from SGLang's side.

One Relax-specific choice, which changes no key: the trainer's rank 0 does not pick a port and hope it is
still free when it binds (what SGLang's peers do); it hosts the store on port 0 first (:func:`host_rendezvous`)
and hands the store in, so the engine's ``tcp://`` rendezvous reaches a store that already listens.

No default process group is needed or touched: the trainer's own FSDP group is unaffected, and the built-in
engine has none. Every group lives in torch's registry under its name until :meth:`WeightGroup.close`, so
names must be unique per process (Relax draws one per join).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any

import torch

from relax.weights.rendezvous_store import bound_store

__all__ = ["BACKENDS", "DEFAULT_GROUP_NAME", "WeightGroup", "host_rendezvous", "init_weight_group"]

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
#: SGLang's default ``group_name`` of ``/init_weights_update_group``.
DEFAULT_GROUP_NAME = "weight_update_group"


class WeightGroup:
    """One weight-update group as its member sees it: broadcasts from rank 0, then ``close``."""

    def __init__(self, name: str, pg: Any, rank: int, world_size: int, backend: str, store: Any,
                 timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._pg = pg
        self._store = store  # kept alive: rank 0's store must outlive the group's rendezvous

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``torch.distributed.broadcast`` on this group (in place on receivers); raises after the group's timeout."""
        if self._pg is None:
            raise RuntimeError(f"weight group {self.name!r} is closed")
        torch.distributed.broadcast(tensor, src=src, group=self._pg)

    def close(self) -> None:
        """Leave the group and free its name (best effort: a dead peer leaves nothing to agree with)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        with contextlib.suppress(Exception):  # gloo has no abort; NCCL's unblocks a collective stuck on a dead peer
            pg.abort()
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group(pg)
        self._store = None


def host_rendezvous(address: str, world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's TCP store on a free port of ``address`` (listening there only): what ``tcp://address:port``
    reaches; ``(store, port)``."""
    store = bound_store(address, 0, world_size, timeout_s)
    return store, int(store.port)


def init_weight_group(group_name: str, master_address: str, master_port: int, rank: int, world_size: int,
                      backend: str = "gloo", timeout_s: float = 60.0, *, store: Any | None = None,
                      device: torch.device | None = None) -> WeightGroup:
    """Join weight group ``group_name`` as ``rank`` of ``world_size``; blocks until every rank has joined.

    Without ``store`` this is SGLang's rendezvous on ``tcp://master_address:master_port`` (rank 0 would host it
    there); rank 0 in Relax passes the store of :func:`host_rendezvous` instead. Raises after ``timeout_s``
    when a rank never arrives.
    """
    from torch.distributed import distributed_c10d as c10d

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        url = f"tcp://{_url_host(master_address)}:{int(master_port)}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    if backend == "nccl" and device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    prefixed = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(  # noqa: SLF001 - torch's own way to a group beside the default one
        world_size, rank, [], c10d.Backend(backend), prefixed, group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # noqa: SLF001 - src=0 means rank 0 here
    log.info("weight group %s: rank %d/%d joined (%s, %s:%s)", group_name, rank, world_size, backend,
             master_address, master_port)
    return WeightGroup(group_name, pg, rank, world_size, backend, store, timeout_s)


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
