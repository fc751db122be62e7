"""Prompt datasets: JSONL loading, chat templates, and a checkpointable position in the prompt stream.

A training run is long and gets resumed; two things make resume exact. The prompt order of an epoch is a
pure function of ``(seed, epoch)`` (no global RNG, no hash randomisation), and the position in the stream
is a small value (``PromptCursor``: epoch, offset) that the driver saves with each checkpoint. Loading the
same file with the same seed and cursor yields the same next prompts.

Errors are ``DataError`` and name the file and the 1-based line, because the first user of this code is a
person whose 17k-line JSONL file has one bad line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ChatTemplateTokenizer",
    "DataError",
    "PromptBatch",
    "PromptCursor",
    "PromptDataset",
    "PromptRecord",
    "PromptStream",
    "epoch_order",
    "load_prompt_data",
    "render_chat_prompt",
]

Message = Mapping[str, Any]


class DataError(ValueError):
    """A prompt file or a data position is unusable; the message says where and why."""


class ChatTemplateTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that chat-templating needs (tests pass a fake)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset.

    ``text`` is what is sent to the engine (chat template already applied when asked for); ``raw`` keeps
    the original input (a string or a message list) for logs; ``metadata`` keeps the line's other keys
    so custom rewards and logs can use them.
    """

    index: int  # 0-based position in the file (blank lines skipped): stable across epochs
    line: int  # 1-based line number in the file, for error messages and logs
    text: str
    label: str
    raw: str | tuple[Message, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class PromptDataset:
    """An immutable, indexable list of prompts loaded from one file."""

    path: str
    records: tuple[PromptRecord, ...]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]


def _where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def _label_to_str(value: Any, path: Path, line: int, label_key: str) -> str:
    # Datasets store answers as strings ("34", "\\frac{3}{4}") or, for integer answers (AIME), numbers.
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(
        f"{_where(path, line)}: label key {label_key!r} must be a string or a number, got {type(value).__name__}"
    )


def _check_messages(value: list[Any], path: Path, line: int, input_key: str) -> tuple[Message, ...]:
    if not value:
        raise DataError(f"{_where(path, line)}: input key {input_key!r} is an empty message list")
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise DataError(
                f"{_where(path, line)}: message {i} of {input_key!r} must be an object with 'role' and "
                f"'content', got {type(msg).__name__}"
            )
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                raise DataError(f"{_where(path, line)}: message {i} of {input_key!r} needs a string {key!r}")
    return tuple(dict(m) for m in value)


def render_chat_prompt(
    raw: str | Sequence[Message],
    tokenizer: ChatTemplateTokenizer,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Apply the tokenizer's chat template, ending with the assistant's generation prompt.

    A plain string is treated as one user message, so the same dataset works with and without
    ``--apply-chat-template``. Extra keyword arguments (e.g. Qwen3's ``enable_thinking``) go to the
    template.
    """
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
    except Exception as exc:  # transformers raises ValueError without a template, jinja errors otherwise
        raise DataError(f"cannot apply the tokenizer's chat template: {exc}") from exc
    if not isinstance(text, str):
        raise DataError(f"chat template returned {type(text).__name__}, expected a string")
    return text


def load_prompt_data(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str | None = "label",
    *,
    tokenizer: ChatTemplateTokenizer | None = None,
    apply_chat_template: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> PromptDataset:
    """Load a JSONL prompt file (``--prompt-data``, ``--input-key``, ``--label-key``).

    Each non-blank line must be a JSON object holding ``input_key`` (a string, or a list of chat messages
    when ``apply_chat_template`` is set) and, unless ``label_key`` is None, ``label_key`` (a string or a
    number). The whole file is validated up front so that a bad line fails the run at start-up, not hours
    later when the stream reaches it.
    """
    p = Path(path)
    if apply_chat_template and tokenizer is None:
        raise DataError("apply_chat_template needs a tokenizer")
    if not p.exists():
        raise DataError(f"prompt data file not found: {p}")
    if not p.is_file():
        raise DataError(f"prompt data path is not a file: {p}")

    records: list[PromptRecord] = []
    try:
        fh = p.open("rb")  # decode per line so an encoding error names its exact line
    except OSError as exc:
        raise DataError(f"cannot read prompt data file {p}: {exc}") from exc
    with fh:
        for lineno, raw_line in enumerate(fh, start=1):
            try:
                line = raw_line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{_where(p, lineno)}: not valid UTF-8 ({exc.reason})") from exc
            if not line.strip():
                continue
            records.append(
                _parse_line(
                    line,
                    p,
                    lineno,
                    len(records),
                    input_key,
                    label_key,
                    tokenizer if apply_chat_template else None,
                    chat_template_kwargs,
                )
            )
    if not records:
        raise DataError(f"prompt data file {p} holds no prompts (it is empty or only blank lines)")
    return PromptDataset(str(p), tuple(records))


def _parse_line(
    line: str,
    path: Path,
    lineno: int,
    index: int,
    input_key: str,
    label_key: str | None,
    tokenizer: ChatTemplateTokenizer | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> PromptRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{_where(path, lineno)}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{_where(path, lineno)}: expected a JSON object, got {type(obj).__name__}")
    if input_key not in obj:
        raise DataError(f"{_where(path, lineno)}: missing input key {input_key!r} (keys present: {sorted(obj)})")
    value = obj[input_key]
    raw: str | tuple[Message, ...]
    if isinstance(value, str):
        raw = value
    elif isinstance(value, list):
        raw = _check_messages(value, path, lineno, input_key)
        if tokenizer is None:
            raise DataError(
                f"{_where(path, lineno)}: input key {input_key!r} is a chat message list; "
                "pass --apply-chat-template to render it"
            )
    else:
        raise DataError(
            f"{_where(path, lineno)}: input key {input_key!r} must be a string or a list of chat "
            f"messages, got {type(value).__name__}"
        )

    if label_key is None:
        label = ""
    elif label_key not in obj:
        raise DataError(f"{_where(path, lineno)}: missing label key {label_key!r} (keys present: {sorted(obj)})")
    else:
        label = _label_to_str(obj[label_key], path, lineno, label_key)

    if tokenizer is not None:
        try:
            text = render_chat_prompt(raw, tokenizer, chat_template_kwargs)
        except DataError as exc:
            raise DataError(f"{_where(path, lineno)}: {exc}") from exc
    else:
        text = raw  # type: ignore[assignment]  # a str: message lists without a tokenizer raised above
    metadata = {k: v for k, v in obj.items() if k not in (input_key, label_key)}
    return PromptRecord(index=index, line=lineno, text=text, label=label, raw=raw, metadata=metadata)


# --------------------------------------------------------------------------------------------------
# Order and position


def epoch_order(num_prompts: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """The prompt indices of one epoch, in the order the stream serves them.

    Seeded with a string so the permutation depends only on ``(seed, epoch)``: Python hashes string
    seeds with SHA-512, unaffected by PYTHONHASHSEED, so every process and every resume agrees.
    """
    if num_prompts < 0 or epoch < 0:
        raise ValueError("num_prompts and epoch must be >= 0")
    order = list(range(num_prompts))
    if shuffle:
        random.Random(f"relax-prompt-order:{seed}:{epoch}").shuffle(order)
    return order


@dataclass(frozen=True, order=True)
class PromptCursor:
    """A position in the prompt stream: the next prompt served is position ``offset`` of ``epoch``."""

    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "offset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DataError(f"prompt cursor {name} must be an integer >= 0, got {v!r}")

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptCursor:
        try:
            return cls(epoch=data["epoch"], offset=data["offset"])
        except (KeyError, TypeError) as exc:
            raise DataError(f"invalid prompt cursor {data!r}: needs integer 'epoch' and 'offset'") from exc


@dataclass(frozen=True)
class PromptBatch:
    """Prompts for one rollout step, with the cursor before and after them.

    The rollout loop runs ahead of the trainer, so the stream's *current* cursor is not what a
    checkpoint should save; the driver keeps ``end`` of the batch behind each partition and saves the
    one of the last step the trainer finished.
    """

    records: tuple[PromptRecord, ...]
    start: PromptCursor
    end: PromptCursor

    def __len__(self) -> int:
        return len(self.records)


class PromptStream:
    """Serves prompts batch by batch, epoch after epoch, from a cursor that can be saved and restored."""

    def __init__(
        self,
        dataset: PromptDataset,
        *,
        shuffle: bool = False,
        seed: int = 42,
        cursor: PromptCursor | None = None,
    ) -> None:
        if len(dataset) == 0:
            raise DataError("cannot stream an empty dataset")
        self._dataset = dataset
        self._shuffle = shuffle
        self._seed = seed
        self._cursor = PromptCursor()
        self._order_epoch = -1
        self._order: list[int] = []
        if cursor is not None:
            self.seek(cursor)

    @property
    def cursor(self) -> PromptCursor:
        return self._cursor

    @property
    def dataset(self) -> PromptDataset:
        return self._dataset

    def seek(self, cursor: PromptCursor) -> None:
        if cursor.offset > len(self._dataset):
            raise DataError(
                f"prompt cursor offset {cursor.offset} is past the end of a {len(self._dataset)}-prompt dataset"
            )
        self._cursor = cursor

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = epoch_order(len(self._dataset), epoch, shuffle=self._shuffle, seed=self._seed)
            self._order_epoch = epoch
        return self._order

    def next_batch(self, batch_size: int) -> PromptBatch:
        """The next ``batch_size`` prompts; a batch that crosses an epoch end continues in the next epoch."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        start = self._cursor
        epoch, offset = start.epoch, start.offset
        n = len(self._dataset)
        out: list[PromptRecord] = []
        while len(out) < batch_size:
            if offset >= n:
                epoch, offset = epoch + 1, 0
            order = self._order_of(epoch)
            take = min(batch_size - len(out), n - offset)
            out.extend(self._dataset[i] for i in order[offset : offset + take])
            offset += take
        if offset >= n:  # normalise "end of epoch e" to "start of epoch e+1"
            epoch, offset = epoch + 1, 0
        self._cursor = PromptCursor(epoch, offset)
        return PromptBatch(tuple(out), start, self._cursor)

    # ---- checkpointing -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue at exactly this position (plus what to check it against)."""
        return {
            "cursor": self._cursor.to_dict(),
            "num_prompts": len(self._dataset),
            "shuffle": self._shuffle,
            "seed": self._seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position; refuses one taken on a different dataset size, seed or shuffle setting,
        because the same cursor would then point at different prompts."""
        try:
            cursor = PromptCursor.from_dict(state["cursor"])
            expected = (state["num_prompts"], state["shuffle"], state["seed"])
        except (KeyError, TypeError) as exc:
            raise DataError(f"invalid prompt stream state {state!r}") from exc
        actual = (len(self._dataset), self._shuffle, self._seed)
        if expected != actual:
            raise DataError(
                "prompt stream state was saved with (num_prompts, shuffle, seed) = "
                f"{expected}, but this run has {actual}; the saved position would point at other prompts"
            )
        self.seek(cursor)
