"""SGLang's own GPU tensor hash (its Triton kernels, run by Triton's interpreter on the CPU), for the tensors in a
file: ``python gpu_hash_reference.py TENSORS.pt`` prints ``{name: hex}`` as JSON. Run in the SGLang venv.

SGLang's wrapper (``gpu_tensor_hash``) asserts a CUDA tensor; this launches the same two kernels the same way on
CPU tensors. ``reduce_chunk`` 2 makes the partials' reduction take several passes even for small tensors (a sum
mod 2**64 is the same however it is grouped, which is what the test relies on).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

_spec = importlib.util.find_spec("sglang.kernels.ops.memory.gpu_tensor_hash")
assert _spec is not None and _spec.loader is not None, "SGLang's gpu_tensor_hash module is not installed"
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)


def sglang_hash(t: torch.Tensor, seed: int = 0x243F6A88, tile_words: int = 8192, block_words: int = 256,
                reduce_chunk: int = 2) -> int:
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    pad = (4 - (raw.numel() & 3)) & 3
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8)])
    u32 = raw.view(torch.uint32)
    n = u32.numel()
    if n == 0:
        return 0
    grid = (triton.cdiv(n, tile_words),)
    partials = torch.empty(grid[0], dtype=torch.uint64)
    kernels.hash_tiles32_kernel_blocked[grid](
        u32, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=kernels.FMIX32_C1, FM_C2=kernels.FMIX32_C2, POS_A=kernels.POS_C1, POS_B=kernels.POS_C2,
        TILE=tile_words, BLOCK=block_words, USE_CG=True)
    cur = partials
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), reduce_chunk), dtype=torch.uint64)
        kernels.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=reduce_chunk)
        cur = nxt
    return kernels._final_splitmix64(int(cur.item()))


if __name__ == "__main__":
    tensors = torch.load(sys.argv[1])
    print(json.dumps({name: f"{sglang_hash(t):016x}" for name, t in tensors.items()}))
