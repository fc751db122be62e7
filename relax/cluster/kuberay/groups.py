"""The Ray resources each group of a RayCluster gives Ray, derived the way KubeRay v1.7.0's operator does.

Why derive rather than read ``rayStartParams``: on KubeRay the numbers Ray sees mostly come from the pod, not
from the start parameters. The operator turns the Ray container's limits into ``--num-cpus``/``--num-gpus``,
turns a group's ``resources`` field into start flags (every key ending in ``gpu`` becoming ``--num-gpus``, so a
``stable_gpu`` marker written there never reaches Ray), and pastes ``rayStartParams.resources`` verbatim into a
``bash -c`` line. A plan is checked against what Ray will really see, not against what the manifest seems to say.
(../shared/kuberay/README.md has the facts, read from KubeRay's and Ray's source.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RAY_CONTAINER_INDEX = 0  # KubeRay runs Ray in a pod template's first container
GPU_LIMIT_SUFFIX = "gpu"  # nvidia.com/gpu, amd.com/gpu: the operator counts any limit ending in gpu as GPUs
_QUANTITY_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(value: object) -> float | None:
    """A Kubernetes quantity (``"500m"``, ``"8"``, ``4``) as a number; None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            number, scale = text[: -len(suffix)], _QUANTITY_SUFFIXES[suffix]
            break
    else:
        number, scale = text, 1.0
    try:
        return float(number) * scale
    except ValueError:
        return None


@dataclass(frozen=True)
class StartResources:
    """``rayStartParams.resources`` as the operator and Ray's autoscaler read it."""

    markers: Mapping[str, int]
    problem: str | None = None  # why Ray would not get them (None: the text is well formed)


def parse_start_resources(text: str) -> StartResources:
    """Check ``rayStartParams.resources``: single-quoted JSON whose values are integers.

    The value is pasted verbatim into ``bash -c "... ray start --resources=<value>"``: single quotes keep it one
    word with its double quotes; bare JSON is split by bash; the escaped form of Ray's own docs fails the
    operator's parser (it trims the outer quotes, then reads JSON); the autoscaler wants integer amounts.
    """
    example = "'{\"stable_gpu\": 8, \"stable_cpu\": 16}' (in YAML: resources: '''{\"stable_gpu\": 8}''')"
    stripped = text.strip()
    if not (len(stripped) >= 2 and stripped[0] == "'" and stripped[-1] == "'"):
        how = "bash splits bare JSON into words" if stripped.startswith("{") else "the operator cannot parse it"
        return StartResources({}, f"rayStartParams.resources must be single-quoted JSON ({how}); write {example}")
    inner = stripped[1:-1]
    if "'" in inner:
        return StartResources({}, f"rayStartParams.resources has a quote inside its single quotes; write {example}")
    try:
        data = json.loads(inner)
    except json.JSONDecodeError as error:
        return StartResources({}, f"rayStartParams.resources is not JSON inside its quotes ({error.msg}); "
                                  f"write {example}")
    if not isinstance(data, dict):
        return StartResources({}, f"rayStartParams.resources must be a JSON object; write {example}")
    bad = [key for key, value in data.items() if not isinstance(value, int) or isinstance(value, bool) or value < 0]
    if bad:
        return StartResources({}, f"rayStartParams.resources: {bad[0]!r} must be a whole number (Ray's autoscaler "
                                  f"reads integer amounts), got {data[bad[0]]!r}")
    return StartResources(dict(data))


@dataclass(frozen=True)
class RayGroup:
    """One group of a RayCluster: how many pods, and what each pod gives Ray."""

    name: str
    is_head: bool
    where: str  # the field path, for findings: spec.headGroupSpec or spec.workerGroupSpecs[i]
    replicas: int  # pods at start
    min_replicas: int
    max_replicas: int
    cpus: float
    gpus: float
    custom: Mapping[str, float]  # custom resources Ray sees on each pod (the node-group markers)
    spec: Mapping[str, Any] = field(repr=False)  # the group's own manifest
    start_resources: StartResources | None = None  # rayStartParams.resources, when given

    @property
    def fixed(self) -> bool:
        """The head, or a worker group the autoscaler cannot resize (replicas = min = max)."""
        return self.is_head or self.min_replicas == self.max_replicas == self.replicas

    @property
    def pod_spec(self) -> Mapping[str, Any]:
        return _mapping(_mapping(self.spec.get("template")).get("spec"))

    @property
    def ray_container(self) -> Mapping[str, Any]:
        containers = self.pod_spec.get("containers")
        return _mapping(containers[RAY_CONTAINER_INDEX]) if isinstance(containers, list) and containers else {}

    def ray_resources(self) -> dict[str, float]:
        """One pod's resources as ``ray.cluster_resources()`` would count them."""
        return {"CPU": self.cpus, "GPU": self.gpus, **self.custom}


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _pod_resources(container: Mapping[str, Any]) -> tuple[float, float]:
    """CPUs and GPUs the operator derives from the Ray container: limits, else requests (CPUs rounded up)."""
    resources = _mapping(container.get("resources"))
    limits, requests = _mapping(resources.get("limits")), _mapping(resources.get("requests"))
    cpu = quantity(limits.get("cpu"))
    if cpu is None:
        cpu = quantity(requests.get("cpu"))
    gpus = sum(quantity(v) or 0.0 for k, v in limits.items() if str(k).lower().endswith(GPU_LIMIT_SUFFIX))
    return float(math.ceil(cpu)) if cpu is not None else 0.0, gpus


def ray_group(spec: Mapping[str, Any], where: str, is_head: bool) -> RayGroup:
    """The group as Ray will see it; a malformed manifest gives zeros here and findings in ``rules``."""
    params = {str(k): str(v) for k, v in _mapping(spec.get("rayStartParams")).items()}
    template = _mapping(spec.get("template"))
    containers = _mapping(template.get("spec")).get("containers")
    container = _mapping(containers[RAY_CONTAINER_INDEX]) if isinstance(containers, list) and containers else {}
    cpus, gpus = _pod_resources(container)
    custom: dict[str, float] = {}
    start = parse_start_resources(params["resources"]) if "resources" in params else None
    if start is not None:
        custom.update({k: float(v) for k, v in start.markers.items()})
    field_resources = _mapping(spec.get("resources"))
    for key, value in field_resources.items():  # KubeRay >= 1.5: the group-level `resources` field
        amount = quantity(value) or 0.0
        if str(key).lower() == "cpu":  # the operator lowercases the field's keys
            cpus = amount
        elif str(key).lower().endswith(GPU_LIMIT_SUFFIX):
            gpus = amount  # the operator writes every *gpu key as --num-gpus: a marker here never reaches Ray
        elif str(key).lower() != "memory":
            custom[str(key)] = amount
    if "num-cpus" in params:
        cpus = quantity(params["num-cpus"]) or 0.0
    if "num-gpus" in params:
        gpus = quantity(params["num-gpus"]) or 0.0
    if is_head:
        return RayGroup("head", True, where, 1, 1, 1, cpus, gpus, custom, spec, start)
    minimum = _int(spec.get("minReplicas"), 0)
    maximum = _int(spec.get("maxReplicas"), minimum)
    replicas = _int(spec.get("replicas"), minimum)
    return RayGroup(str(spec.get("groupName", "")), False, where, replicas, minimum, maximum, cpus, gpus, custom,
                    spec, start)


def cluster_groups(spec: Mapping[str, Any]) -> list[RayGroup]:
    """The head group, then every worker group, of a RayCluster's ``spec`` (or a RayJob's ``rayClusterSpec``)."""
    groups = [ray_group(_mapping(spec.get("headGroupSpec")), "spec.headGroupSpec", is_head=True)]
    workers = spec.get("workerGroupSpecs")
    for index, worker in enumerate(workers if isinstance(workers, list) else []):
        groups.append(ray_group(_mapping(worker), f"spec.workerGroupSpecs[{index}]", is_head=False))
    return groups


def resources_at_start(groups: list[RayGroup]) -> dict[str, float]:
    """``ray.cluster_resources()`` once every group has its starting pods (no autoscaling yet)."""
    total: dict[str, float] = {}
    for group in groups:
        for key, amount in group.ray_resources().items():
            total[key] = total.get(key, 0.0) + amount * group.replicas
    return total
