"""What drives a simulated pool: the tuned autoscaler, its documented defaults, or a fixed pool.

``--policy`` of ``relax autoscaler simulate`` and of ``benchmarks/autoscaler_policies.py``. Why the
``relax`` policy is tuned the way it is: see ``relax.autoscaler.simulator``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from relax.autoscaler.config import AutoscalerConfig, AutoscalerConfigError

__all__ = [
    "RECIPE_BOUNDS",
    "RELAX_TUNED",
    "PolicyError",
    "PolicyKind",
    "PolicySpec",
    "parse_policy",
    "relax_defaults_config",
    "relax_tuned_config",
]

RECIPE_BOUNDS = (4, 8)
"""The seed recipe's pool bounds (``examples/elastic_rollout/autoscaler.yaml``): the simulator's default."""

RELAX_TUNED: dict[str, Any] = {
    "metrics_interval_secs": 5.0,
    "evaluation_interval_secs": 10.0,
    "scale_in_cooldown_secs": 120.0,
    "scale_out_policy": {"condition_duration_secs": 20.0, "token_usage_threshold": 1.0},
    "scale_in_policy": {"throughput_variance_threshold": 0.25},
}
"""The ``relax`` policy: a patch over ``AutoscalerConfig`` defaults (why: see the module docstring)."""



class PolicyError(ValueError):
    """A ``--policy`` that cannot be understood; the message is one line."""


class PolicyKind(str, Enum):
    """``--policy`` families: the tuned autoscaler, the documented defaults, or a fixed pool (no autoscaler)."""

    RELAX = "relax"
    RELAX_DEFAULTS = "relax-defaults"
    STATIC = "static"


@dataclass(frozen=True)
class PolicySpec:
    """What drives the pool: the autoscaler with ``config``, or ``static_engines`` fixed engines."""

    kind: PolicyKind
    config: AutoscalerConfig
    static_engines: int | None = None

    @property
    def label(self) -> str:
        return f"static:{self.static_engines}" if self.kind is PolicyKind.STATIC else self.kind.value


def relax_defaults_config(bounds: tuple[int, int] = RECIPE_BOUNDS) -> AutoscalerConfig:
    """``AutoscalerConfig``'s documented defaults, enabled, with the recipe's bounds."""
    return AutoscalerConfig(enabled=True, min_engines=bounds[0], max_engines=bounds[1])


def relax_tuned_config(bounds: tuple[int, int] = RECIPE_BOUNDS) -> AutoscalerConfig:
    """The ``relax`` policy's config: the defaults patched with ``RELAX_TUNED``."""
    return relax_defaults_config(bounds).patch(RELAX_TUNED)


def parse_policy(text: str, user_config: AutoscalerConfig | None = None) -> PolicySpec:
    """``relax`` | ``relax-defaults`` | ``static:N`` | ``static:min`` | ``static:max`` -> a ``PolicySpec``.

    ``user_config`` (``--config YAML``) is what the real autoscaler would run from that file, so for
    ``relax-defaults`` it is used as is; for ``relax`` only the keys the file sets are laid over the tuned
    settings; for ``static:min|max`` it gives the bounds. The simulator always enables the autoscaler:
    ``static:N`` is how to simulate it switched off.
    """
    spec = text.strip().lower()
    if spec == PolicyKind.RELAX.value:
        config = relax_tuned_config()
        if user_config is not None:
            try:
                config = config.patch(user_config.model_dump(exclude_unset=True))
            except AutoscalerConfigError as error:
                reason = str(error).removeprefix("config patch: ")
                raise PolicyError(
                    f"--config laid over the relax policy's tuned settings gives a bad config: {reason} "
                    "(set the related key too, or use --policy relax-defaults to run the file as is)"
                ) from None
        return PolicySpec(PolicyKind.RELAX, config.patch({"enabled": True}))
    if spec == PolicyKind.RELAX_DEFAULTS.value:
        config = user_config if user_config is not None else relax_defaults_config()
        return PolicySpec(PolicyKind.RELAX_DEFAULTS, config.patch({"enabled": True}))
    if spec.startswith("static:"):
        bounds_from = user_config if user_config is not None else relax_defaults_config()
        value = spec.split(":", 1)[1].strip()
        if value == "min":
            engines = bounds_from.min_engines
        elif value == "max":
            engines = bounds_from.max_engines
        else:
            try:
                engines = int(value)
            except ValueError:
                raise PolicyError(f"--policy {text}: N in static:N must be a whole number of engines") from None
            if engines < 1:
                raise PolicyError(f"--policy {text}: static:N needs at least 1 engine")
        return PolicySpec(PolicyKind.STATIC, bounds_from, engines)
    raise PolicyError(f"unknown --policy {text!r}; choose relax, relax-defaults, static:N, static:min or static:max")
