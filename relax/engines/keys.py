"""An engine's two keys: one that generates, one that controls.

SGLang (0.5.x, ``srt/utils/auth.py``) takes two keys. ``--api-key`` opens the generation routes
(``/generate``, ``/v1/*``, ``/model_info``); ``--admin-api-key``, when set, is the *only* key its control routes
accept (pause and continue, weight updates and groups, ``/abort_request``, ``/flush_cache``, ``/weights_checker``),
and it is refused on ``/generate``. The built-in engine enforces the same split (``ADMIN_ROUTES``).

Why two: anything that only generates — an external SGLang router, a client script, an operator poking an
engine — must be able to send requests without being able to pause the engine or rewrite its weights.

Why one pair per engine: a key that leaks (an engine's log, a router's config) opens one engine, not the
pool. The pairs are derived from the run's secret with HMAC, so the rollout manager keeps one secret and
finds any engine's keys again (after a restart of its client, for the router), and nothing is stored.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

#: Control routes: the admin key opens them, the generation key does not. SGLang 0.5.23's ``ADMIN_OPTIONAL``
#: routes about weights, pausing and caches (the rest of its list: LoRA, profiling, expert records).
ADMIN_ROUTES: frozenset[str] = frozenset({
    "/abort_request",
    "/begin_weight_update",
    "/continue_generation",
    "/destroy_weights_update_group",
    "/end_weight_update",
    "/flush_cache",
    "/get_weights_by_name",
    "/init_weights_update_group",
    "/pause_generation",
    "/update_weight_version",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/weights_checker",
})

#: Routes open without a key on SGLang (and the built-in engine): probes and Prometheus scrapes.
OPEN_ROUTE_PREFIXES: tuple[str, ...] = ("/health", "/ready", "/metrics")


@dataclass(frozen=True)
class EngineKeys:
    """The keys of one engine; either may be None (no key: that side of the engine is open).

    Kept out of ``repr`` so that logging options or a Ray error quoting them never prints a key.
    """

    generation: str | None = field(default=None, repr=False)
    admin: str | None = field(default=None, repr=False)

    @classmethod
    def single(cls, key: str | None) -> EngineKeys:
        """One key for both sides: an engine Relax did not start (``engine_urls``), which has one key at most."""
        return cls(key, key)

    def __bool__(self) -> bool:
        return bool(self.generation or self.admin)


def is_admin_route(path: str) -> bool:
    """Whether ``path`` (no query string) is a control route that only the admin key opens."""
    return path.rstrip("/") in ADMIN_ROUTES


def is_open_route(path: str) -> bool:
    """Whether ``path`` is a probe or scrape route, open without a key (on SGLang too)."""
    return path.startswith(OPEN_ROUTE_PREFIXES)


def carries_a_key(header: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """Whether ``Authorization: header`` carries either key of this engine (a caller of the run, not anonymous)."""
    return any(key and _bearer_matches(header, key) for key in (api_key, admin_api_key))


def _bearer_matches(header: str | None, key: str) -> bool:
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {key}".encode())


def authorized(path: str, header: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """Whether a request to ``path`` with ``Authorization: header`` passes, by SGLang 0.5.23's rules.

    Probes and scrapes are open. A control route needs the admin key when there is one (the generation key is
    refused there), else the generation key when there is one. Any other route needs the generation key when
    there is one (the admin key is refused there).
    """
    if is_open_route(path):
        return True
    key = (admin_api_key or api_key) if is_admin_route(path) else api_key
    return key is None or _bearer_matches(header, key)


def _derive(secret: str, label: str) -> str:
    """Hex, never base64: a key starting with ``-`` (1 in 64 base64 keys) is read as a flag when SGLang turns its
    ``--config`` file back into arguments (``--admin-api-key: expected one argument``)."""
    return hmac.new(secret.encode(), label.encode(), hashlib.sha256).hexdigest()


def engine_keys(run_secret: str | None, engine_id: str, *, generation: str | None = None) -> EngineKeys:
    """Engine ``engine_id``'s own pair, derived from ``run_secret`` (None: an open engine, no keys).

    ``generation``: a generation key the user chose (``RELAX_ENGINE_API_KEY``, for scripts that call the engines
    themselves); the admin key is still the engine's own.
    """
    if not run_secret:
        return EngineKeys()
    return EngineKeys(generation or _derive(run_secret, f"{engine_id}/generation"),
                      _derive(run_secret, f"{engine_id}/admin"))


__all__ = ["ADMIN_ROUTES", "OPEN_ROUTE_PREFIXES", "EngineKeys", "authorized", "carries_a_key", "engine_keys",
           "is_admin_route", "is_open_route"]
