"""How the driver hands the autoscaler to the control plane: a picklable factory run inside its actor.

The autoscaler lives beside the REST API (docs/architecture.md, "Processes and actors"): the factory is
shipped to the ControlPlane actor, which calls it inside its own event loop to start the service and mount
its routes under /autoscaler. The service talks to the RolloutManager through the same client as the REST
routes (``ManagerClient``), so an autoscaler request obeys the same scaling rules as a human's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.autoscaler.config import AutoscalerConfig


@dataclass(frozen=True)
class AutoscalerFactory:
    config: AutoscalerConfig
    manager: Any  # the RolloutManager's Ray actor handle, wrapped in a ManagerClient inside the actor

    def __call__(self) -> Any:
        # Imported here: the factory is pickled in the driver, which needs none of this.
        from relax.autoscaler.routes import autoscaler_router
        from relax.autoscaler.service import start_autoscaler
        from relax.rollout.control.manager_client import ManagerClient

        service = start_autoscaler(self.config, ManagerClient(self.manager))
        return autoscaler_router(service)
