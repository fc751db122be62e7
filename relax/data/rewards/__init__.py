"""Reward functions by name (``--rm-type``) or by dotted path (a user's own function).

Every reward has the signature ``fn(response: str, label: str) -> float``. A user's function may return a dict
instead (a score and its parts, as slime's reward models do): ``--reward-key`` names the entry that is the
reward. Built-ins are registered as
dotted paths and imported only when chosen, so picking ``tiny`` does not load sympy, and a broken
optional dependency only matters to the run that uses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["RewardConfigError", "RewardFn", "available_reward_types", "get_reward_fn", "load_callable"]

RewardFn = Callable[[str, str], float]


class RewardConfigError(ValueError):
    """The chosen reward cannot be used (unknown name, import failure, not callable)."""


#: ``--rm-type`` name -> dotted path of its function.
BUILTIN_REWARDS: dict[str, str] = {
    "dapo": "relax.data.rewards.dapo:compute_score",
    "math": "relax.data.rewards.math_verify_reward:compute_score",
    "deepscaler": "relax.data.rewards.math_verify_reward:compute_deepscaler_score",
    "tiny": "relax.data.rewards.tiny_task:compute_score",
    "last-number": "relax.data.rewards.last_number:compute_score",
}


def available_reward_types() -> list[str]:
    return sorted(BUILTIN_REWARDS)


def load_callable(path: str) -> Callable[..., object]:
    """Import ``module:attr.sub`` or ``module.attr`` and return it, checking that it is callable."""
    if not isinstance(path, str) or not path.strip():
        raise RewardConfigError(f"reward path must be a non-empty string, got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise RewardConfigError(
            f"reward path {path!r} must look like 'package.module:function' or 'package.module.function'"
        )
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise RewardConfigError(
            f"cannot import module {module_name!r} of reward {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardConfigError(f"reward {path!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise RewardConfigError(f"reward {path!r} is a {type(obj).__name__}, not a callable")
    return obj


def _as_float_reward(fn: Callable[..., object], name: str, reward_key: str | None = None) -> RewardFn:
    """Make a user function's result a float (a dict's ``reward_key`` entry), with an error that names the
    function when it is not one."""

    def reward(response: str, label: str) -> float:
        value = fn(response, label)
        if isinstance(value, Mapping):
            if reward_key is None:
                raise TypeError(f"reward {name!r} returned a dict (keys {sorted(map(str, value))}); name the "
                                "entry that is the reward with --reward-key")
            if reward_key not in value:
                raise TypeError(f"reward {name!r} returned a dict without --reward-key {reward_key!r} (keys "
                                f"{sorted(map(str, value))})")
            value = value[reward_key]
        if isinstance(value, (int, float)):  # bool is an int: True -> 1.0
            return float(value)
        raise TypeError(f"reward {name!r} returned {type(value).__name__} ({value!r}); expected a number")

    reward.__name__ = getattr(fn, "__name__", "reward")
    reward.__qualname__ = f"reward[{name}]"
    reward.__wrapped__ = fn  # type: ignore[attr-defined]
    return reward


def get_reward_fn(rm_type: str | None, custom_path: str | None = None, reward_key: str | None = None) -> RewardFn:
    """The reward function for ``--rm-type`` (``dapo``, ``math``, ``deepscaler``, ``tiny``, ``last-number``).

    A ``custom_path`` (``module:function`` or ``module.function``) takes precedence over ``rm_type``;
    ``rm_type`` may also be such a path itself (anything containing ``:`` or ``.``). ``reward_key``
    (``--reward-key``): the entry of a user function's dict result that is the reward.
    """
    if custom_path:
        return _as_float_reward(load_callable(custom_path), custom_path, reward_key)
    if not rm_type:
        raise RewardConfigError(
            f"no reward chosen: set --rm-type to one of {available_reward_types()} or give a custom path"
        )
    name = rm_type.strip()
    if name in BUILTIN_REWARDS:
        return load_callable(BUILTIN_REWARDS[name])  # type: ignore[return-value]
    if ":" in name or "." in name:
        return _as_float_reward(load_callable(name), name, reward_key)
    raise RewardConfigError(
        f"unknown reward type {rm_type!r}; choose one of {available_reward_types()} "
        "or a dotted path 'package.module:function'"
    )
