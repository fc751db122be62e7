"""The node provider of the local elastic cluster: Ray's ``fake_multinode`` provider, with each fake node kept
apart from the others where one machine makes them share what separate hosts would not.

Why not the stock provider: every fake node is a real raylet on this host, in the head's session directory.

* **One runtime-env directory for all nodes.** Ray's ``working_dir`` plugin extracts a job's package the first
  time a node needs it, deleting whatever is at that path first. A node that joins mid-job therefore deleted
  the package that the head's and the other nodes' workers were importing from, and an engine actor placed on
  the new node died in ``__init__`` with ``ModuleNotFoundError`` (measured on the recipe's e2e: its first
  scale-out came up one engine short and the autoscaler had to ask again, 77 s later). Here each fake node has
  its own directory (``RayParams.runtime_env_dir_name``, the parameter Ray has for this), as separate hosts do.
* **A log monitor per node.** Each node's log monitor tails the one shared ``logs/`` folder, so every line
  reached a driver once per node, and each monitor cost CPU (25 CPU-s over the recipe's e2e). Ray's own
  advice (``ray start --help``): one log monitor per physical host. The head's is that one.

Everything else (node ids, tags, termination) is the stock provider's; the node-creating method is restated with
the two parameters added (Ray has no hook for them). The autoscaler loads this class
through the ``external`` provider type (``provider.module`` in the cluster config).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import ray._private.node
import ray._private.parameter
import ray._private.ray_constants as ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

MODULE_PATH = f"{__name__}.SeparateFakeNodeProvider"
"""What the cluster config's ``provider.module`` names."""


def runtime_env_dir_name(node_id: str) -> str:
    """The fake node's own runtime-env folder in the session directory (the head keeps Ray's default)."""
    return f"{ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME}_{node_id[-5:]}"


class SeparateFakeNodeProvider(FakeMultiNodeProvider):
    """``fake_multinode`` nodes with their own runtime-env directory and without a log monitor of their own."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        if not provider_config.get("gcs_address"):
            # the stock provider falls back to port 6379, where fake nodes hang without a word
            raise ValueError("the fake node provider needs provider.gcs_address (the head's GCS ip:port)")
        super().__init__(provider_config, cluster_name)

    def _create_node_with_resources_and_labels(self, node_config: dict[str, Any], tags: dict[str, str],
                                               count: int, resources: dict[str, Any],
                                               labels: dict[str, str]) -> None:
        """The stock method (Ray 2.60) with two ``RayParams`` more: ``runtime_env_dir_name`` and
        ``include_log_monitor``. Ray has no hook for a node's parameters, so the method is restated here;
        an upgrade of Ray must compare it with the stock one."""
        resources = copy.deepcopy(resources)  # popped below; the autoscaler keeps its own copy
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            node_id = self._next_hex_node_id()
            params = ray._private.parameter.RayParams(
                min_worker_port=0, max_worker_port=0, dashboard_port=None, dashboard_agent_listen_port=0,
                num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0),
                object_store_memory=resources.pop("object_store_memory", None),
                resources=resources, labels=labels,
                redis_address=self._gcs_address, gcs_address=self._gcs_address,
                runtime_env_dir_name=runtime_env_dir_name(node_id),
                include_log_monitor=False,
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id,
                    "RAY_CLOUD_INSTANCE_ID": node_id,
                    "RAY_NODE_TYPE_NAME": node_type,
                    ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                    ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
                },
            )
            node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
            self._nodes[node_id] = {
                "tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                    TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: node_id,
                    TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                    **tags,
                },
                "node": node,
            }
