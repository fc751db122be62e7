"""Prompt loading, chat templates, epoch order and the checkpointable cursor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relax.data.dataset import (
    DataError,
    PromptCursor,
    PromptStream,
    epoch_order,
    load_prompt_data,
    render_chat_prompt,
)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


class FakeTokenizer:
    """Renders messages like a minimal chat template; records the kwargs it got."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        self.kwargs = kwargs
        body = "".join(f"<|{m['role']}|>{m['content']}\n" for m in conversation)
        return body + ("<|assistant|>" if kwargs.get("add_generation_prompt") else "")


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "label": str(i), "src": "x"} for i in range(10)])


def test_load_plain_prompts(prompts: Path) -> None:
    ds = load_prompt_data(prompts, "prompt", "label")
    assert len(ds) == 10
    r = ds[3]
    assert (r.index, r.line, r.text, r.label, r.raw) == (3, 4, "q3", "3", "q3")
    assert r.metadata == {"src": "x"}


def test_blank_lines_skipped_numbers_kept(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "p.jsonl", [{"q": "a", "a": 1}, "", "  ", {"q": "b", "a": 2.5}])
    ds = load_prompt_data(p, "q", "a")
    assert [(r.index, r.line, r.label) for r in ds.records] == [(0, 1, "1"), (1, 4, "2.5")]


def test_label_key_none(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "p.jsonl", [{"q": "a"}])
    assert load_prompt_data(p, "q", None)[0].label == ""


@pytest.mark.parametrize(
    ("rows", "pattern"),
    [
        ([{"prompt": "a", "label": "1"}, "{not json"], r"p\.jsonl:2: malformed JSON"),
        ([{"prompt": "a", "label": "1"}, {"label": "2"}], r":2: missing input key 'prompt'"),
        ([{"prompt": "a"}], r":1: missing label key 'label'"),
        ([{"prompt": 5, "label": "1"}], r":1: input key 'prompt' must be a string or a list"),
        ([{"prompt": "a", "label": True}], r":1: label key 'label' must be a string or a number, got bool"),
        ([{"prompt": "a", "label": ["x"]}], r":1: label key .* got list"),
        ([[1, 2]], r":1: expected a JSON object, got list"),
        ([{"prompt": [{"role": "user", "content": "x"}], "label": "1"}], r"--apply-chat-template"),
        ([{"prompt": [], "label": "1"}], r"empty message list"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, rows: list[Any], pattern: str) -> None:
    p = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=pattern):
        load_prompt_data(p, "prompt", "label")


def test_bad_messages_with_template(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user"}], "label": "1"}])
    with pytest.raises(DataError, match=r":1: message 0 of 'prompt' needs a string 'content'"):
        load_prompt_data(p, "prompt", "label", tokenizer=FakeTokenizer(), apply_chat_template=True)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="holds no prompts"):
        load_prompt_data(empty)
    with pytest.raises(DataError, match="not found: .*nope.jsonl"):
        load_prompt_data(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="not a file"):
        load_prompt_data(tmp_path)


def test_invalid_utf8_names_line(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "\xff", "label": "1"}\n')
    with pytest.raises(DataError, match=r":2: not valid UTF-8"):
        load_prompt_data(p)


def test_chat_template_for_messages_and_strings(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": msgs, "label": "4"}, {"prompt": "hi", "label": "x"}])
    tok = FakeTokenizer()
    ds = load_prompt_data(p, tokenizer=tok, apply_chat_template=True, chat_template_kwargs={"enable_thinking": False})
    assert ds[0].text == "<|system|>be brief\n<|user|>2+2?\n<|assistant|>"
    assert ds[0].raw == tuple(msgs)
    assert ds[1].text == "<|user|>hi\n<|assistant|>"
    assert tok.kwargs == {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}


def test_chat_template_errors_are_data_errors(tmp_path: Path) -> None:
    class NoTemplate:
        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
            raise ValueError("tokenizer has no chat_template")

    with pytest.raises(DataError, match="chat template: tokenizer has no chat_template"):
        render_chat_prompt("x", NoTemplate())
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1"}])
    with pytest.raises(DataError, match=r"p\.jsonl:1: cannot apply"):
        load_prompt_data(p, tokenizer=NoTemplate(), apply_chat_template=True)
    with pytest.raises(DataError, match="needs a tokenizer"):
        load_prompt_data(p, apply_chat_template=True)


def test_epoch_order_deterministic_and_per_epoch() -> None:
    a0 = epoch_order(50, 0, shuffle=True, seed=1)
    assert a0 == epoch_order(50, 0, shuffle=True, seed=1)
    assert sorted(a0) == list(range(50))
    assert a0 != epoch_order(50, 1, shuffle=True, seed=1)
    assert a0 != epoch_order(50, 0, shuffle=True, seed=2)
    assert epoch_order(5, 3, shuffle=False, seed=1) == [0, 1, 2, 3, 4]


def test_stream_crosses_epochs(prompts: Path) -> None:
    ds = load_prompt_data(prompts)
    s = PromptStream(ds, shuffle=False)
    b1 = s.next_batch(4)
    assert [r.index for r in b1.records] == [0, 1, 2, 3]
    assert (b1.start, b1.end) == (PromptCursor(0, 0), PromptCursor(0, 4))
    s.next_batch(6)
    assert s.cursor == PromptCursor(1, 0)  # end of epoch 0 is normalised to the start of epoch 1
    b3 = s.next_batch(25)  # spans epochs 1, 2 and part of 3
    assert len(b3) == 25 and s.cursor == PromptCursor(3, 5)
    with pytest.raises(ValueError):
        s.next_batch(0)


def test_resume_continues_at_the_same_position(prompts: Path) -> None:
    ds = load_prompt_data(prompts)
    ref = PromptStream(ds, shuffle=True, seed=7)
    full = [r.index for _ in range(7) for r in ref.next_batch(3).records]

    first = PromptStream(ds, shuffle=True, seed=7)
    got = [r.index for _ in range(4) for r in first.next_batch(3).records]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptStream(ds, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    got += [r.index for _ in range(3) for r in resumed.next_batch(3).records]
    assert got == full
    # each epoch is a permutation, and epochs differ
    assert sorted(full[:10]) == list(range(10)) and full[:10] != full[10:20]


def test_resume_refuses_other_dataset_or_seed(prompts: Path, tmp_path: Path) -> None:
    ds = load_prompt_data(prompts)
    state = PromptStream(ds, shuffle=True, seed=7).state_dict()
    with pytest.raises(DataError, match="seed"):
        PromptStream(ds, shuffle=True, seed=8).load_state_dict(state)
    small = load_prompt_data(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "label": "1"}]))
    with pytest.raises(DataError, match="num_prompts"):
        PromptStream(small, shuffle=True, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match="invalid prompt stream state"):
        PromptStream(ds).load_state_dict({"cursor": {"epoch": 0, "offset": 0}})
    with pytest.raises(DataError, match="invalid prompt cursor"):
        PromptStream(ds).load_state_dict({**state, "cursor": {"epoch": 0}})


def test_cursor_dict_roundtrip_and_validation(prompts: Path) -> None:
    c = PromptCursor(2, 5)
    assert PromptCursor.from_dict(c.to_dict()) == c
    assert PromptCursor(1, 9) < PromptCursor(2, 0)
    with pytest.raises(DataError):
        PromptCursor(-1, 0)
    with pytest.raises(DataError):
        PromptCursor.from_dict({"epoch": "1", "offset": 0})
    with pytest.raises(DataError, match="past the end"):
        PromptStream(load_prompt_data(prompts), cursor=PromptCursor(0, 11))


def test_real_hf_tokenizer_chat_template(tmp_path: Path) -> None:
    """The same call path with a real transformers tokenizer (built in memory, no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    )
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "label": "4"}])
    ds = load_prompt_data(p, tokenizer=tok, apply_chat_template=True)
    assert ds[0].text == "<user>2+2?<assistant>"
