"""The run's secrets in process environments: only the processes that read a secret get it.

A variable in a process's environment is readable by whoever can read ``/proc/<pid>/environ`` of that process
and of everything it starts, for as long as each lives: the run's engine servers, Ray's daemons and workers.
``WANDB_API_KEY`` and the control plane's ``RELAX_API_TOKEN`` are read by the driver alone, so the driver
takes them out of its environment before it starts Ray (:func:`withhold`); an engine server gets its own key
explicitly and none of the run's other secrets (:func:`without`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping

from relax.cluster import api_token, ray_auth

__all__ = ["DRIVER_ONLY", "WANDB_KEY_ENV", "without", "withhold"]

WANDB_KEY_ENV = "WANDB_API_KEY"
#: Read by the driver only: W&B runs in the driver, and the control plane's token reaches its actor as an argument.
DRIVER_ONLY = (WANDB_KEY_ENV, api_token.TOKEN_ENV)
#: Ray's cluster token: Ray's own processes need it, a process that is not Ray's does not.
RAY_ONLY = (ray_auth.TOKEN_ENV,)


def withhold(environ: MutableMapping[str, str], names: Iterable[str] = DRIVER_ONLY) -> dict[str, str]:
    """Take ``names`` out of ``environ`` (the driver's ``os.environ``) and return them, for the driver's use."""
    return {name: environ.pop(name) for name in names if name in environ}


def without(environ: Mapping[str, str], names: Iterable[str]) -> dict[str, str]:
    """A copy of ``environ`` for a child process, with ``names`` left out."""
    dropped = frozenset(names)
    return {name: value for name, value in environ.items() if name not in dropped}
