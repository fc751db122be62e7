"""Prometheus HTTP service discovery of the rollout pool: ``GET /rollout/prometheus_sd``.

The pool is elastic, so a static scrape config goes stale at the first scale-out. Prometheus's
``http_sd_configs`` asks the control plane instead, every ``refresh_interval``, and scrapes what it answers:
one target group per ``ACTIVE`` engine (each engine serves its own ``/metrics``), in the http_sd format

    [{"targets": ["10.0.0.5:30000"], "labels": {"engine_id": "engine_0", "kind": "initial", ...}}, ...]

Only ``ACTIVE`` engines are listed: an engine still starting has no metrics worth having, and one draining or
gone drops out of the answer, so Prometheus stops scraping it (its series go stale instead of failing scrapes).

Pure: the input is the ``GET /rollout/engines`` view (``RolloutControl.engines_view``), the output plain JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ACTIVE", "METRICS_PATH", "sd_groups", "sd_target"]

ACTIVE = "ACTIVE"
"""The engine status (``EngineState.ACTIVE.value``) whose engines are scrape targets."""
METRICS_PATH = "/metrics"


def sd_target(url: str) -> tuple[str, str] | None:
    """``(scheme, "host:port")`` of an engine base URL, ``None`` when it has no host or port to scrape."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return None
    host = parts.hostname
    return parts.scheme, (f"[{host}]" if ":" in host else host) + f":{port}"


def sd_groups(view: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The http_sd answer for an engines view: one group per ``ACTIVE`` engine with a URL, in the view's order.

    Labels: ``engine_id``, ``kind`` (``initial``/``elastic``/``external``), ``node`` (the node id, ``""`` when
    unknown), ``model`` (the model the pool serves, as ``/rollout/engines`` names it), ``__metrics_path__``
    (``/metrics``) and ``__scheme__`` (the engine URL's scheme).
    """
    groups: list[dict[str, Any]] = []
    for model, entry in sorted((view.get("models") or {}).items()):
        for engine in (entry or {}).get("engines") or ():
            if engine.get("status") != ACTIVE or not engine.get("url"):
                continue
            target = sd_target(str(engine["url"]))
            if target is None:
                continue
            scheme, address = target
            labels = {
                "engine_id": str(engine.get("engine_id", "")),
                "kind": str(engine.get("kind") or ""),
                "node": str(engine.get("node_id") or ""),
                "model": str(model),
                "__metrics_path__": METRICS_PATH,
                "__scheme__": scheme,
            }
            groups.append({"targets": [address], "labels": labels})
    return groups
