"""How the driver hands the autoscaler to the control plane: a picklable factory run inside its actor.

The autoscaler lives beside the REST API (DESIGN 2): the factory is shipped to the ControlPlane actor,
which calls it inside its own event loop to start the service and mount its routes under /autoscaler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.autoscaler.config import AutoscalerConfig


@dataclass(frozen=True)
class AutoscalerFactory:
    config: AutoscalerConfig
    manager: Any  # the RolloutManager's Ray actor handle: the same scaling entry points as the REST API

    def __call__(self) -> Any:
        from relax.autoscaler.routes import autoscaler_router
        from relax.autoscaler.service import RayManagerBackend, start_autoscaler

        service = start_autoscaler(self.config, RayManagerBackend(self.manager))
        return autoscaler_router(service)
