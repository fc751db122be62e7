"""The autoscaler's YAML configuration (docs/architecture.md, "The autoscaler"): a strict pydantic model and its loader.

Why strict: the file drives a loop that creates and destroys GPU engines, so a typo must fail at
startup with a message naming the key instead of silently falling back to a default. Every block
forbids unknown keys, values are not coerced (``max_engines: "8"`` or ``enabled: yes-please`` are
errors, not guesses), and cross-field rules that would make the pool flap or never move are
rejected with the names of the fields involved.

The model is frozen: a running autoscaler swaps whole configs (``config.patch(...)`` returns a new
one, the semantics of ``PATCH /autoscaler/config``), so a half-applied change is never visible.
"""

from __future__ import annotations

import difflib
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from relax.config.flags import ConfigError
from relax.yaml_errors import yaml_error_text

__all__ = [
    "AutoscalerConfig",
    "AutoscalerConfigError",
    "RLSignalsConfig",
    "ScaleInPolicy",
    "ScaleOutPolicy",
    "effective_bounds",
    "load_autoscaler_config",
]


class AutoscalerConfigError(ConfigError):
    """A bad autoscaler config; the message is one line that names the key to fix.

    A ``ConfigError`` (hence a ``ValueError``) so the driver's existing "print and exit" handling
    covers it without a traceback.
    """


_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class ScaleOutPolicy(BaseModel):
    """When to add engines: ANY of these signals, held for ``condition_duration_secs``."""

    model_config = _STRICT

    token_usage_threshold: float = Field(0.85, ge=0.0, le=1.0)
    """Mean KV/token capacity in use (``sglang:token_usage``, 0-1) at or above which engines are full."""
    queue_depth_per_engine: float = Field(10.0, gt=0.0)
    """Waiting requests per answering engine at or above which there is a backlog."""
    queue_time_p95_threshold: float = Field(5.0, gt=0.0)
    """P95 of ``sglang:queue_time_seconds`` (seconds) at or above which requests wait too long."""
    ttft_p95_threshold: float = Field(10.0, gt=0.0)
    """P95 of ``sglang:time_to_first_token_seconds`` (seconds) at or above which first tokens are late."""
    condition_duration_secs: float = Field(30.0, ge=0.0)
    max_delta: int = Field(4, ge=1)
    """Most engines one scale-out adds."""


class ScaleInPolicy(BaseModel):
    """When to remove engines: ALL of these, held for ``condition_duration_secs``."""

    model_config = _STRICT

    token_usage_threshold: float = Field(0.3, ge=0.0, le=1.0)
    queue_depth_threshold: float = Field(0.0, ge=0.0)
    """Total waiting requests (whole pool) at or below which there is "no queue"."""
    throughput_variance_threshold: float = Field(0.1, ge=0.0)
    """Coefficient of variation of pool throughput over ``condition_window_secs`` that counts as stable."""
    condition_duration_secs: float = Field(120.0, ge=0.0)
    max_delta: int = Field(1, ge=1)
    """Most engines one scale-in removes."""
    projected_usage_max: float = Field(0.5, gt=0.0, le=1.0)
    """Token usage the pool may reach after losing one engine (usage × n / (n − 1))."""


class RLSignalsConfig(BaseModel):
    """Relax's RL-specific signals, beside the engines' own metrics.

    * Trainer waiting: when the trainer spends more than ``trainer_wait_fraction_threshold`` of its
      time waiting for samples, rollout is the bottleneck, so it is one more ANY-condition for
      scale-out (held for ``scale_out_policy.condition_duration_secs``).
    * Staleness gate: when the rollout loop is blocked by ``--max-staleness`` more than
      ``staleness_blocked_fraction_threshold`` of the time, engines are waiting for the trainer, so
      extra engines would only wait too: scale-out is suppressed. It never blocks scale-in, which
      still needs all of its own conditions.
    """

    model_config = _STRICT

    trainer_wait_enabled: bool = True
    trainer_wait_fraction_threshold: float = Field(0.5, gt=0.0, le=1.0)
    staleness_blocked_enabled: bool = True
    staleness_blocked_fraction_threshold: float = Field(0.5, gt=0.0, le=1.0)


class AutoscalerConfig(BaseModel):
    """The whole ``--autoscaler-config`` file; satisfies ``relax.config.plan.AutoscalerBoundsLike``."""

    model_config = _STRICT

    enabled: bool = False
    min_engines: int = Field(1, ge=1)
    max_engines: int = Field(8, ge=1)
    scale_out_cooldown_secs: float = Field(60.0, ge=0.0)
    scale_in_cooldown_secs: float = Field(300.0, ge=0.0)
    metrics_interval_secs: float = Field(10.0, gt=0.0)
    evaluation_interval_secs: float = Field(30.0, gt=0.0)
    condition_window_secs: float = Field(60.0, gt=0.0)
    """How far back the metrics history reaches (throughput stability is measured over it)."""
    min_coverage_scale_out: float = Field(0.5, ge=0.0, le=1.0)
    """Share of ACTIVE engines that must answer a scrape before scale-out may act.

    0.5 because an overloaded pool is exactly when scrapes time out: insisting on every engine
    would block scale-out when it is most needed, while half the pool is still a fair sample.
    """
    min_coverage_scale_in: float = Field(1.0, ge=0.0, le=1.0)
    """Share needed before scale-in may act; 1.0 because an engine that does not answer is not idle."""
    scale_out_request_timeout_secs: float = Field(300.0, gt=0.0)
    rollout_service_url: str | None = None
    """Base URL of the control plane when the autoscaler runs out of process; None = in-process."""
    scale_out_policy: ScaleOutPolicy = Field(default_factory=ScaleOutPolicy)
    scale_in_policy: ScaleInPolicy = Field(default_factory=ScaleInPolicy)
    rl_signals: RLSignalsConfig = Field(default_factory=RLSignalsConfig)

    @field_validator("rollout_service_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        text = value.strip().rstrip("/")
        if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1]) == 0:
            raise ValueError(f"must be an http(s) URL such as http://127.0.0.1:8000, got {value!r}")
        return text

    @model_validator(mode="after")
    def _check_cross_fields(self) -> AutoscalerConfig:
        if self.max_engines < self.min_engines:
            raise ValueError(f"max_engines ({self.max_engines}) is below min_engines ({self.min_engines})")
        low, high = self.scale_in_policy.token_usage_threshold, self.scale_out_policy.token_usage_threshold
        if low >= high:
            raise ValueError(
                f"scale_in_policy.token_usage_threshold ({low:g}) must be below "
                f"scale_out_policy.token_usage_threshold ({high:g}), or the pool would flap between them"
            )
        if self.evaluation_interval_secs < self.metrics_interval_secs:
            raise ValueError(
                f"evaluation_interval_secs ({self.evaluation_interval_secs:g}) is shorter than "
                f"metrics_interval_secs ({self.metrics_interval_secs:g}); decisions would reuse the same scrape"
            )
        return self

    def patch(self, partial: dict[str, Any]) -> AutoscalerConfig:
        """``PATCH /autoscaler/config``: deep-merge ``partial`` into this config and revalidate.

        Returns a new config; raises ``AutoscalerConfigError`` (naming the key) for unknown keys,
        wrong types or a result that breaks a cross-field rule, leaving this config untouched.
        """
        if not isinstance(partial, dict):
            raise AutoscalerConfigError(f"config patch must be a mapping of settings, got {type(partial).__name__}")
        merged = _deep_merge(self.model_dump(), partial)
        return _validate(merged, "config patch")


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------------
# Loading and error messages


def load_autoscaler_config(path: str) -> AutoscalerConfig:
    """Read and validate the autoscaler YAML; raises ``AutoscalerConfigError`` with a one-line message."""
    source = f"--autoscaler-config {path}"
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise AutoscalerConfigError(
            f"{source}: no such file; check the path (AUTOSCALER_CONFIG in the launch scripts)"
        ) from None
    except IsADirectoryError:
        raise AutoscalerConfigError(f"{source}: is a directory, not a YAML file") from None
    except OSError as error:
        raise AutoscalerConfigError(f"{source}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError:
        raise AutoscalerConfigError(f"{source}: not a UTF-8 text file") from None
    except yaml.YAMLError as error:
        raise AutoscalerConfigError(f"{source}: {yaml_error_text(error)}") from None
    if data is None:
        raise AutoscalerConfigError(f"{source}: the file is empty; it needs at least 'enabled: true'")
    if not isinstance(data, dict):
        raise AutoscalerConfigError(
            f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}"
        )
    return _validate(data, source)


def _validate(data: dict[str, Any], source: str) -> AutoscalerConfig:
    try:
        return AutoscalerConfig.model_validate(data)
    except ValidationError as error:
        problems = [_describe(item) for item in error.errors(include_url=False)]
        shown = "; ".join(problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise AutoscalerConfigError(f"{source}: {shown}{more}") from None


_BLOCKS: dict[str, type[BaseModel]] = {
    "scale_out_policy": ScaleOutPolicy,
    "scale_in_policy": ScaleInPolicy,
    "rl_signals": RLSignalsConfig,
}
_KINDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "finite_number": "a finite number",
}
_COMPARISONS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _describe(item: Any) -> str:
    """One pydantic error as a sentence that names the key."""
    loc = [str(part) for part in item.get("loc", ())]
    name = ".".join(loc) or "config"
    kind, ctx, given = item["type"], item.get("ctx") or {}, item.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{name} must be a mapping of settings, got {given!r}"
    if kind in _KINDS:
        return f"{name} must be {_KINDS[kind]}, got {given!r}"
    if kind in _COMPARISONS:
        bound = next(iter(ctx.values()))
        bound_text = f"{bound:g}" if isinstance(bound, (int, float)) else str(bound)
        return f"{name} must be {_COMPARISONS[kind]} {bound_text}, got {given!r}"
    message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
    return message if not loc else f"{name}: {message}"


def _unknown_key(loc: list[str]) -> str:
    key = loc[-1]
    parent = loc[:-1]
    model: type[BaseModel] = _BLOCKS.get(parent[0], AutoscalerConfig) if parent else AutoscalerConfig
    allowed = list(model.model_fields)
    where = f" in {'.'.join(parent)}" if parent else ""
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {'.'.join(loc)!r}{hint}; allowed keys{where}: {', '.join(allowed)}"


# --------------------------------------------------------------------------------------------------
# Bounds


def effective_bounds(config: AutoscalerConfig, initial_engines: int) -> tuple[int, int, list[str]]:
    """The hard engine bounds ``(floor, ceiling, notes)`` for a pool that starts with ``initial_engines``.

    Scale-in never removes initial engines, so the floor is ``max(min_engines, initial)``; when
    ``min_engines`` is lower a note says that the effective floor is the initial count. The startup
    rule of ``relax.config.plan.check_engine_bounds`` (``min_engines <= initial <= max_engines``) is enforced
    here as well, so the autoscaler refuses a pool the plan would have refused.
    """
    if initial_engines < 0:
        raise AutoscalerConfigError(f"initial engine count must be >= 0, got {initial_engines}")
    if initial_engines > config.max_engines:
        raise AutoscalerConfigError(
            f"max_engines ({config.max_engines}) is below the {initial_engines} initial engines; "
            "raise max_engines or give rollout fewer GPUs in --resource"
        )
    if config.min_engines > initial_engines:
        raise AutoscalerConfigError(
            f"min_engines ({config.min_engines}) is above the {initial_engines} initial engines; "
            "lower min_engines or give rollout more GPUs in --resource"
        )
    notes: list[str] = []
    if config.min_engines < initial_engines:
        notes.append(
            f"min_engines ({config.min_engines}) is below the {initial_engines} initial engines; the effective "
            f"floor is the initial count ({initial_engines}) because initial engines are never scaled in"
        )
    return max(config.min_engines, initial_engines), config.max_engines, notes
