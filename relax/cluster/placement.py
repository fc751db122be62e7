"""Placement groups of the baseline: one per role's bundles, created, awaited and removed."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from relax.config.plan import Bundle

log = logging.getLogger("relax.cluster")


class PlacementError(RuntimeError):
    pass


def create_groups(named_bundles: Sequence[tuple[str, Sequence[Bundle]]], *, strategy: str = "PACK",
                  timeout_s: float = 60.0) -> list[PlacementGroup]:
    """Create one placement group per (name, bundles); fail clearly if the cluster cannot hold them."""
    groups = [placement_group([b.to_ray() for b in bundles], strategy=strategy, name=name)
              for name, bundles in named_bundles]
    refs = [g.ready() for g in groups]
    ready, _ = ray.wait(refs, num_returns=len(groups), timeout=timeout_s)
    if len(ready) != len(groups):
        pending = [name for (name, _), ref in zip(named_bundles, refs, strict=True) if ref not in ready]
        remove_groups(groups)
        total = ray.cluster_resources()
        raise PlacementError(
            f"the cluster cannot hold the baseline: placement group(s) {', '.join(pending)} not ready after "
            f"{timeout_s:.0f}s. Cluster resources: GPU={total.get('GPU', 0):g}, CPU={total.get('CPU', 0):g}. "
            "Give the cluster more GPUs or reduce --resource.")
    for name, _ in named_bundles:
        log.info("placement group %s ready", name)
    return groups


def remove_groups(groups: Sequence[PlacementGroup]) -> None:
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as exc:  # already removed / cluster gone
            log.info("placement group removal: %s", exc)
