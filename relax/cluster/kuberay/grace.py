"""How long a pod really has between SIGTERM and SIGKILL, and how much of it Ray's drain may take.

A reclaimed node's pods get SIGTERM; ``ray start --block`` (the Ray container's command) then marks the node
DRAINING with deadline now + ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (default 30 s) and Relax moves the
engine's work off before it. The kubelet kills the pod at the end of its grace, which on preemptible capacity
is the platform's, not the pod's: GKE's node shutdown gives pods of a Spot node 15 s of its 30 s notice by
default, whatever ``terminationGracePeriodSeconds`` says. A drain longer than that grace never ends: the pod
dies first and the work is lost instead of moved. Numbers from ../shared/kuberay/README.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
RAY_DEFAULT_DRAIN_S = 30.0  # Ray >= 2.57
KUBERNETES_DEFAULT_GRACE_S = 30  # terminationGracePeriodSeconds when unset
#: Platforms whose reclaim caps a pod's grace below its own terminationGracePeriodSeconds, by node label.
GRACE_CAPS: tuple[tuple[str, str, int, str], ...] = (
    ("cloud.google.com/gke-spot", "true", 15, "GKE Spot (its default node shutdown grace for pods)"),
    ("cloud.google.com/gke-preemptible", "true", 15, "GKE preemptible VMs (its default node shutdown grace)"),
    # AWS Spot: the instance is gone 2 minutes after the notice; an interruption handler needs a few seconds
    ("karpenter.sh/capacity-type", "spot", 110, "AWS Spot (a 2-minute notice, less the handler's reaction)"),
    ("eks.amazonaws.com/capacityType", "SPOT", 110, "AWS Spot (a 2-minute notice, less the handler's reaction)"),
)
#: Pod-template annotation for a node pool whose shutdown grace was raised (GKE Standard allows up to 120 s).
GRACE_ANNOTATION = "relax.io/platform-grace-seconds"


@dataclass(frozen=True)
class Grace:
    """A pod's drain timeout, its own grace, the grace its platform gives it, and why."""

    drain_s: float
    pod_grace_s: int
    effective_s: float
    platform: str  # what capped the grace, or "the pod's terminationGracePeriodSeconds"

    @property
    def ok(self) -> bool:
        return self.drain_s < self.effective_s  # effective_s never exceeds the pod's own grace


def _env_value(container: Mapping[str, Any], name: str) -> str | None:
    for entry in container.get("env") or []:
        if isinstance(entry, Mapping) and entry.get("name") == name and isinstance(entry.get("value"), str):
            return entry["value"]
    return None


def _selected_labels(pod_spec: Mapping[str, Any]) -> dict[str, str]:
    """Node labels a pod requires: its nodeSelector and its required node affinity's ``In`` terms of one value."""
    labels = {str(k): str(v) for k, v in (pod_spec.get("nodeSelector") or {}).items()}
    affinity = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms") or []:
        for expression in (term or {}).get("matchExpressions") or []:
            values = expression.get("values") or []
            if expression.get("operator") == "In" and len(values) == 1:
                labels[str(expression.get("key"))] = str(values[0])
    return labels


def pod_grace(template: Mapping[str, Any], container: Mapping[str, Any]) -> Grace:
    """The grace of the pods a group's template makes (``template`` is the group's pod template)."""
    pod_spec = template.get("spec") or {}
    raw_drain = _env_value(container, DRAIN_ENV)
    try:
        drain = float(raw_drain) if raw_drain is not None else RAY_DEFAULT_DRAIN_S
    except ValueError:
        drain = RAY_DEFAULT_DRAIN_S
    own = pod_spec.get("terminationGracePeriodSeconds")
    own = own if isinstance(own, int) and not isinstance(own, bool) else KUBERNETES_DEFAULT_GRACE_S
    labels = _selected_labels(pod_spec)
    annotated = ((template.get("metadata") or {}).get("annotations") or {}).get(GRACE_ANNOTATION)
    for key, value, cap, platform in GRACE_CAPS:
        if labels.get(key) == value:
            if annotated is not None and str(annotated).isdigit():
                cap, platform = int(annotated), f"{platform[:platform.index(' (')]} ({GRACE_ANNOTATION})"
            return Grace(drain, own, float(min(cap, own)), platform)
    return Grace(drain, own, float(own), "the pod's terminationGracePeriodSeconds")
