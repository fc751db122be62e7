"""The built-in engine's tokenizer: the checkpoint's ``tokenizer.json`` through the `tokenizers` library.

Why not ``AutoTokenizer``: it costs an engine ``import transformers`` (~2 s of CPU at every start) to wrap the
very same Rust tokenizer. Where transformers would change what the file says — a ``tokenizer_config.json``
that adds BOS/EOS itself, cleans up spaces, or names special tokens the file lacks — the engine uses
``AutoTokenizer`` instead (``load_tokenizer``), so ids and texts are the same either way
(tests/unit/test_engine_tokenizer.py compares both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class EngineTokenizer(Protocol):
    """What the engine needs of a tokenizer (``AutoTokenizer``'s names)."""

    pad_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


# tokenizer_config.json keys with which transformers rewrites or extends what tokenizer.json says
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "split_special_tokens", "added_tokens_decoder",
                   "add_prefix_space", "legacy", "additional_special_tokens")
# tokenizer classes that take tokenizer.json as it is; others (Qwen2Tokenizer, LlamaTokenizer, GPT2Tokenizer...)
# rebuild its normalizer, pre-tokenizer and decoder in code and fill in default special tokens
_FILE_AS_IS_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs: {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class FileTokenizer:
    """``tokenizer.json`` as-is, with the special tokens ``tokenizer_config.json`` names."""

    def __init__(self, backend: Any, special: dict[str, int | None]) -> None:
        self._backend = backend
        self.pad_token_id = special.get("pad_token")
        self.eos_token_id = special.get("eos_token")
        self.bos_token_id = special.get("bos_token")

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def file_tokenizer(model_dir: Path) -> FileTokenizer | None:
    """The tokenizer of ``model_dir`` read straight from its files, or None where transformers would differ."""
    from tokenizers import Tokenizer

    vocab, config_file = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not vocab.is_file() or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if any(key in config for key in _REWRITING_KEYS) or config.get("clean_up_tokenization_spaces"):
        return None
    if config.get("tokenizer_class") not in _FILE_AS_IS_CLASSES:
        return None
    backend = Tokenizer.from_file(str(vocab))
    if backend.post_processor is None:  # transformers would install its own template
        return None
    if backend.padding is not None or backend.truncation is not None:  # transformers turns both off per call
        return None
    specials = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    named = {key: _token_text(config.get(key)) for key in ("pad_token", "eos_token", "bos_token", "unk_token")}
    extra = [_token_text(t) for t in config.get("extra_special_tokens") or []]
    if any(text is not None and text not in specials for text in [*named.values(), *extra]):
        return None
    return FileTokenizer(backend, {key: None if text is None else backend.token_to_id(text)
                                   for key, text in named.items()})


def load_tokenizer(model_dir: Path, prefer_file: bool = True) -> EngineTokenizer:
    """The file's tokenizer where it gives transformers' ids and texts (and ``prefer_file``), else AutoTokenizer."""
    tokenizer = file_tokenizer(model_dir) if prefer_file else None
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
