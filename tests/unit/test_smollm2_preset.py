"""The smollm2 preset's GGUF memoising: one parse per file inside the block, gguf untouched outside it.

The conversion itself (real GGUF, byte-identical rebuild) is tested in tests/integration/test_smollm2.py.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from relax.presets.smollm2 import gguf_parsed_once


def _write_gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_each_file_is_parsed_once_inside_the_block_and_anew_outside(tmp_path: Path) -> None:
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(first)
    _write_gguf(second)
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is reader  # str or Path: one file, one parse
        assert gguf.GGUFReader(second) is not reader
        assert [t.name for t in reader.tensors] == ["token_embd.weight"]
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)
