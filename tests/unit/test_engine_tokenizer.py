"""The built-in engine reads tokenizer.json itself where that gives AutoTokenizer's ids and texts exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relax.engines.builtin.tokenizer import FileTokenizer, file_tokenizer, load_tokenizer

TEXTS = ["", "hello world", "  leading and trailing  ", "2+2=4\nthen 17*3 = 51", "<|im_start|>user\nhi<|im_end|>",
         "unicode: café — 数学 🙂", "tabs\tand\r\nnewlines"]


def assert_same_as_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = file_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert isinstance(ours, FileTokenizer)
    assert (ours.pad_token_id, ours.eos_token_id) == (theirs.pad_token_id, theirs.eos_token_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_the_tiny_preset_tokenizer_matches_autotokenizer(tiny_preset) -> None:
    assert_same_as_transformers(tiny_preset.model_dir)


def test_the_smollm2_tokenizer_matches_autotokenizer(smollm2_preset) -> None:
    assert_same_as_transformers(smollm2_preset.model_dir)


@pytest.mark.parametrize("change", [{"add_bos_token": True}, {"clean_up_tokenization_spaces": True},
                                    {"eos_token": "<|not-in-the-file|>"}, {"add_prefix_space": False},
                                    {"tokenizer_class": "GPT2Tokenizer"}, "padding in tokenizer.json",
                                    "no tokenizer.json"])
def test_configs_transformers_would_reinterpret_use_autotokenizer(tiny_preset, tmp_path: Path, change) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_preset.model_dir, model_dir)
    if change == "no tokenizer.json":
        # a slow-tokenizer checkpoint: AutoTokenizer converts it; here the file is simply absent
        (model_dir / "tokenizer.json").unlink()
        assert file_tokenizer(model_dir) is None
        return
    if change == "padding in tokenizer.json":  # AutoTokenizer turns it off per call; the file would pad always
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        backend.enable_padding(length=64)
        backend.save(str(model_dir / "tokenizer.json"))
        change = {}
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert file_tokenizer(model_dir) is None
    tokenizer = load_tokenizer(model_dir)
    assert not isinstance(tokenizer, FileTokenizer)
    assert tokenizer.encode("hello")  # transformers serves it
