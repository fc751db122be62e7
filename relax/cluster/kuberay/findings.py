"""One problem found in a manifest: which rule, where, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Rule(Enum):
    """Every check a manifest gets; the value is the name printed beside each finding."""

    SCHEMA = "schema"                    # KubeRay v1.7.0's v1 schema, unknown fields being errors
    LIST_MAP_KEY = "list-map-key"        # keys of x-kubernetes list maps are unique (containers, env, ports ...)
    NAME = "name"                        # metadata.name is a DNS-1035 label within KubeRay's length
    # a group's `resources` field vs rayStartParams num-cpus/num-gpus/memory/resources
    RESOURCES_EXCLUSIVE = "resources-exclusive"
    GROUPS = "groups"                    # worker group names unique, every group's pod has a container
    REPLICAS = "replicas"                # minReplicas <= replicas <= maxReplicas
    RESTART_POLICY = "restart-policy"    # autoscaler v2: pod restartPolicy unset or Never
    TOKEN_AUTH = "token-auth"            # authOptions.mode token on, and only with rayVersion >= 2.52.0
    RAYJOB = "rayjob"                    # rayClusterSpec or clusterSelector; ttlSecondsAfterFinished rules
    MARKER_PLACEMENT = "marker-placement"  # node-group markers only on a fixed worker group
    MARKER_QUOTING = "marker-quoting"    # rayStartParams.resources as single-quoted JSON of integers
    GPU_KEY_IN_RESOURCES = "gpu-key-in-resources"  # no *gpu key but GPU in a group's `resources` field
    DRAIN_GRACE = "drain-grace"          # Ray's drain timeout < the grace the platform gives <= the pod's own
    SHM = "shm"                          # /dev/shm is a memory emptyDir with an explicit sizeLimit
    SECRETS = "secrets"                  # secrets from a Secret, never in runtimeEnvYAML or a literal env value
    STABLE_PDB = "stable-pdb"            # a PodDisruptionBudget keeps voluntary disruptions off the stable group
    ELASTIC_CAPACITY = "elastic-capacity"  # the unmarked autoscaled groups hold exactly the scale-out headroom
    PLAN_FIT = "plan-fit"                # the baseline fits the cluster at start (the live start-up check's words)


@dataclass(frozen=True)
class Finding:
    """``where`` names the document and the field (``rayclusters/relax-qwen3-4b: spec.workerGroupSpecs[1]``)."""

    rule: Rule
    where: str
    message: str

    def line(self) -> str:
        return f"{self.where}: {self.message} [{self.rule.value}]"
