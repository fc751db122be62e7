"""Request bodies of the engine HTTP contract (SGLang's native API; docs/architecture.md, "Engines"), validated.

Validation lives here so that a malformed request is answered with a 4xx naming the field
before it can reach the generation loop. Unknown *sampling* keys are rejected (a typo such as
`max_tokens` would otherwise silently fall back to a default), while unknown top-level keys that
SGLang clients commonly send (`stream`, `lora_path`, ...) are tolerated and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from relax.engines.builtin.sampling import NEUTRAL_PARAMS, SamplingParams

MAX_N = 64


class SamplingParamsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: StrictInt = Field(0, ge=0)
    spaces_between_special_tokens: StrictBool = True
    sampling_seed: StrictInt | None = None
    stream_interval: StrictInt | None = Field(None, ge=1)  # SGLang's per-request chunk size (server default else)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _neutral_only(self) -> SamplingParamsBody:
        for key, neutral in NEUTRAL_PARAMS.items():
            if getattr(self, key) != neutral:
                raise ValueError(f"{key}={getattr(self, key)} is not supported by the built-in engine "
                                 f"(only {neutral})")
        if self.min_new_tokens:
            raise ValueError("min_new_tokens is not supported by the built-in engine")
        return self

    def to_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            n=self.n,
        )


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    rid: str | list[str] | None = None
    return_logprob: StrictBool = False
    stream: StrictBool = False

    @model_validator(mode="after")
    def _one_prompt_source(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        prompts = self.prompts()
        if not prompts:
            raise ValueError("the prompt list is empty")
        for i, p in enumerate(prompts):
            if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
                raise ValueError(f"prompt {i} is empty")
        if isinstance(self.rid, list) and len(self.rid) != len(prompts):
            raise ValueError(f"rid has {len(self.rid)} entries for {len(prompts)} prompts")
        return self

    @property
    def batched(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return self.text if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None
        return self.input_ids if self.batched else [self.input_ids]  # type: ignore[return-value]


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    abort_all: StrictBool = False

    @model_validator(mode="after")
    def _target(self) -> AbortBody:
        if not self.abort_all and not self.rid:
            raise ValueError("give 'rid' or set 'abort_all': true")
        return self


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    weight_version: str | int | None = None
    abort_all_requests: StrictBool = False
    is_async: StrictBool = False
    flush_cache: StrictBool = True  # SGLang's field; the built-in engine keeps no prefix cache across requests

    @field_validator("load_format")
    @classmethod
    def _format(cls, v: str | None) -> str | None:
        if v not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {v!r} is not supported by the built-in engine (auto, safetensors)")
        return v


# ------------------------------------------------------------------ broadcast weight updates (SGLang's io_struct)


class InitWeightsUpdateGroupBody(BaseModel):
    """``/init_weights_update_group``: join a process group with the trainer (rank ``rank_offset``)."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1)
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1)
    world_size: StrictInt = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"
    rid: str | None = None  # SGLang's request id field: accepted, unused

    @model_validator(mode="after")
    def _rank_inside(self) -> InitWeightsUpdateGroupBody:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside a group of world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedBody(BaseModel):
    """``/update_weights_from_distributed``: receive the named tensors by broadcast from rank 0 and load them."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = Field("weight_update_group", min_length=1)
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | int | None = None
    load_format: Literal["flattened_bucket"] | None = None
    rid: str | None = None  # SGLang's fields without a meaning on CPU or for one engine process: accepted, unused
    selector: Any = None
    torch_empty_cache: StrictBool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedBody:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names ({len(self.names)}), dtypes ({len(self.dtypes)}) and shapes ({len(self.shapes)}) "
                             "must have the same length")
        return self


class UpdateWeightVersionBody(BaseModel):
    """``/update_weight_version``. SGLang's default aborts every request in flight: callers that mean to keep
    them (Relax always does) must send ``abort_all_requests: false``."""

    model_config = ConfigDict(extra="forbid")

    new_version: str = Field(min_length=1)
    abort_all_requests: StrictBool = True


class WeightsGroupBody(BaseModel):
    """``/destroy_weights_update_group``."""

    model_config = ConfigDict(extra="forbid")

    group_name: str = Field("weight_update_group", min_length=1)
    rid: str | None = None


class WeightUpdateSessionBody(BaseModel):
    """``/begin_weight_update`` and ``/end_weight_update`` (body ``{}``; ``selector`` accepted, unused)."""

    model_config = ConfigDict(extra="forbid")

    selector: Any = None
    rid: str | None = None
