"""Records that carry one generated response (``Sample``) and one prompt's responses (``PromptGroup``).

They are frozen because a sample crosses several owners on its way to the trainer (engine client →
generator → reward → buffer → trainer, often through Ray's object store): a record nobody can mutate in
place cannot be half-updated by one owner while another reads it. A sample is built with its reward (the
generator scores the response first); later stages derive new records (``with_advantage``) instead.

Token sequences are stored as tuples for the same reason; the trainer turns them into tensors once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    """Why generation of a response ended (SGLang's ``meta_info.finish_reason.type`` names)."""

    STOP = "stop"  # EOS or a stop string: the response is complete
    LENGTH = "length"  # hit max_new_tokens: the response is truncated
    ABORT = "abort"  # the engine aborted the request (drain, eviction, pause)

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | FinishReason | None) -> FinishReason:
        """Accept a name or SGLang's ``{"type": "length", "length": 64}`` form (``None`` means stop)."""
        if isinstance(value, FinishReason):
            return value
        if value is None:
            return cls.STOP
        if isinstance(value, Mapping):
            value = value.get("type")
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown finish reason {value!r}; expected one of {[m.value for m in cls]}") from None


def _int_tuple(name: str, values: Iterable[Any]) -> tuple[int, ...]:
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {type(v).__name__} ({v!r})")
    return out


@dataclass(frozen=True)
class Sample:
    """One response to one prompt, with everything the trainer and the logs need.

    ``rollout_log_probs`` are the log-probs the *inference engine* reported for each sampled response
    token; the trainer compares them with its own recomputation for truncated importance sampling.
    ``loss_mask`` (1 = train on this token) defaults to all ones; it exists so that multi-turn or
    tool-call responses can exclude tokens the policy did not produce.
    ``weight_version`` is the engine's weight version when the response was generated: the trainer's
    version minus this number is the sample's staleness.
    """

    prompt_index: int  # position of the prompt in its dataset file (stable across epochs)
    group_id: str  # unique id of the prompt group this sample belongs to
    sample_index: int  # position of this sample within its group (0 .. n-1)
    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    response_text: str
    label: str
    weight_version: int
    rollout_step: int
    rollout_log_probs: tuple[float, ...] = ()
    loss_mask: tuple[int, ...] | None = None
    finish_reason: FinishReason = FinishReason.STOP
    engine_id: str | None = None
    # (version, start, end) over the response tokens, from the engine's meta_info.weight_versions; empty
    # when the engine reports none (then weight_version is the bound the dispatcher knew)
    weight_version_spans: tuple[tuple[int, int, int], ...] = ()
    reward: float | None = None
    advantage: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise fields once, here
        set_(self, "prompt_token_ids", _int_tuple("prompt_token_ids", self.prompt_token_ids))
        set_(self, "response_token_ids", _int_tuple("response_token_ids", self.response_token_ids))
        set_(self, "rollout_log_probs", tuple(float(x) for x in self.rollout_log_probs))
        set_(self, "finish_reason", FinishReason.parse(self.finish_reason))
        set_(self, "weight_version_spans", tuple(tuple(int(x) for x in span) for span in self.weight_version_spans))
        if any(len(span) != 3 for span in self.weight_version_spans):
            raise ValueError("weight_version_spans must be (version, start, end) triples")
        n = len(self.response_token_ids)
        if self.loss_mask is None:
            set_(self, "loss_mask", (1,) * n)
        else:
            mask = _int_tuple("loss_mask", self.loss_mask)
            if any(m not in (0, 1) for m in mask):
                raise ValueError("loss_mask must contain only 0 and 1")
            set_(self, "loss_mask", mask)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
        if self.rollout_log_probs and len(self.rollout_log_probs) != n:
            raise ValueError(f"rollout_log_probs has {len(self.rollout_log_probs)} entries for {n} response tokens")
        if self.sample_index < 0 or self.prompt_index < 0:
            raise ValueError("prompt_index and sample_index must be >= 0")
        if self.weight_version < 0 or self.rollout_step < 0:
            raise ValueError("weight_version and rollout_step must be >= 0")

    @property
    def truncated(self) -> bool:
        """True when the response hit the length limit (it has no natural end)."""
        return self.finish_reason is FinishReason.LENGTH

    @property
    def response_length(self) -> int:
        return len(self.response_token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask or ())

    def staleness(self, trainer_version: int) -> int:
        """How many weight versions the trainer is ahead of the weights that generated this sample."""
        return trainer_version - self.weight_version

    def with_advantage(self, advantage: float) -> Sample:
        return dataclasses.replace(self, advantage=float(advantage))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (for JSONL sample dumps and debugging)."""
        d = dataclasses.asdict(self)
        d["finish_reason"] = self.finish_reason.value
        for key in ("prompt_token_ids", "response_token_ids", "rollout_log_probs", "loss_mask"):
            d[key] = list(d[key])
        d["weight_version_spans"] = [list(span) for span in self.weight_version_spans]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        return cls(**data)


@dataclass(frozen=True)
class PromptGroup:
    """The n responses to one prompt: the unit GRPO normalises rewards over and the buffer stores."""

    group_id: str
    prompt_index: int
    rollout_step: int
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        if not self.samples:
            raise ValueError(f"prompt group {self.group_id!r} has no samples")
        for s in self.samples:
            if (s.group_id, s.prompt_index, s.rollout_step) != (
                self.group_id,
                self.prompt_index,
                self.rollout_step,
            ):
                raise ValueError(
                    f"sample (group {s.group_id!r}, prompt {s.prompt_index}, step {s.rollout_step}) does "
                    f"not belong to group {self.group_id!r} (prompt {self.prompt_index}, "
                    f"step {self.rollout_step})"
                )

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> PromptGroup:
        if not samples:
            raise ValueError("cannot build a prompt group from no samples")
        first = samples[0]
        return cls(first.group_id, first.prompt_index, first.rollout_step, tuple(samples))

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    @property
    def rewards(self) -> list[float]:
        """Rewards of all samples; raises if any sample has not been scored yet."""
        missing = [s.sample_index for s in self.samples if s.reward is None]
        if missing:
            raise ValueError(f"group {self.group_id!r}: samples {missing} have no reward yet")
        return [float(s.reward) for s in self.samples]  # type: ignore[arg-type]

    @property
    def num_tokens(self) -> int:
        return sum(s.response_length for s in self.samples)

    def with_advantages(self, advantages: Sequence[float]) -> PromptGroup:
        if len(advantages) != len(self.samples):
            raise ValueError(f"{len(advantages)} advantages for {len(self.samples)} samples")
        return dataclasses.replace(
            self,
            samples=tuple(s.with_advantage(a) for s, a in zip(self.samples, advantages, strict=True)),
        )
