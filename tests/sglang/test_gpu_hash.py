"""The trainer computes what SGLang on a GPU will answer: ``sglang_gpu_hash`` against SGLang's own Triton kernels.

SGLang's ``/weights_checker`` hashes a tensor on a GPU with its Triton kernel, not SHA-256 (only CPU tensors get
SHA-256). No GPU here, but Triton's interpreter runs the very kernels SGLang ships on the CPU
(``gpu_hash_reference.py``, in the SGLang venv): every tensor below, of every size class the kernel treats
differently (empty, not a multiple of 4 bytes, less than a tile, whole tiles, a partial last tile, several tiles
reduced in several passes), and a whole layer in SGLang's fused layout, must hash the same in both.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from relax.weights.digest import ChecksumAlgorithm, layout_checksums, sglang_gpu_hash, sglang_layout

HERE = Path(__file__).resolve().parent


def reference(tensors: dict[str, torch.Tensor], sglang_python: str, tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "tensors.pt"
    torch.save(tensors, path)
    done = subprocess.run([sglang_python, str(HERE / "gpu_hash_reference.py"), str(path)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sglang_gpu_hash_is_sglangs_own_kernel(sglang_python: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {
        "empty": torch.empty(0, dtype=torch.bfloat16),
        "odd_bytes": torch.arange(7, dtype=torch.uint8),
        "one_bf16": torch.randn(1, generator=g).to(torch.bfloat16),
        "small": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "one_tile": torch.randn(8192, generator=g),  # 8192 fp32 words: exactly one tile
        "tiles_and_a_half": torch.randn(3 * 8192 + 4100, generator=g).to(torch.bfloat16),
        "fp32_matrix": torch.randn(48, 700, generator=g),  # 4.1 tiles
    }
    layer = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=g),
             "model.layers.0.self_attn.k_proj.weight": torch.randn(16, 32, generator=g),
             "model.layers.0.self_attn.v_proj.weight": torch.randn(16, 32, generator=g),
             "model.embed_tokens.weight": torch.randn(100, 32, generator=g)}
    layer = {n: t.to(torch.bfloat16) for n, t in layer.items()}
    fused = {f"served:{n}": t for n, t in sglang_layout(layer).items()}  # what the engine holds, as copies
    expected = reference({**tensors, **fused}, sglang_python, tmp_path)
    assert {n: f"{sglang_gpu_hash(t):016x}" for n, t in tensors.items()} == {n: expected[n] for n in tensors}
    ours = layout_checksums(layer, "sglang", algorithm=ChecksumAlgorithm.SGLANG_GPU)  # fused without the layout
    assert ours == {n.removeprefix("served:"): expected[n] for n in fused}
    assert len(set(expected.values())) == len(expected)  # no two of them collide: the hash sees the bytes
