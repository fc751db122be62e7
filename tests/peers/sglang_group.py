"""The weight-update group as SGLang 0.5.23's ``init_custom_process_group`` builds it (contract, written anew).

Steps from the contract: torch's ``tcp://host:port`` rendezvous (rank 0 hosts the store), the store wrapped as
``PrefixStore(group_name, store)``, then torch's ``_new_process_group_helper(world_size, rank, [], backend,
store, group_name=group_name, timeout=...)``, and the group's ranks mapped to themselves so ``src=0`` is rank 0.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d


def sglang_process_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                         backend: str = "gloo", timeout_s: float = 30.0) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    rendezvous = distributed_c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                             timeout=timeout)
    store, rank, world_size = next(rendezvous)
    store.set_timeout(timeout)
    store = distributed_c10d.PrefixStore(group_name, store)
    group, _ = distributed_c10d._new_process_group_helper(
        world_size, rank, [], distributed_c10d.Backend(backend), store, group_name=group_name, timeout=timeout)
    distributed_c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group
