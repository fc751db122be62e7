"""Engine base URLs: validation and the one canonical spelling (``scheme://host:port``).

Pure and dependency-free so that both the REST layer (:mod:`relax.rollout.control.api_models`, which validates
bodies with it) and the scaling core (:mod:`relax.rollout.scaling`, which compares URLs canonically) can use
it without importing each other.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

__all__ = ["MAX_URL_LENGTH", "normalize_engine_url"]

MAX_URL_LENGTH = 2048

_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")


def normalize_engine_url(url: str) -> str:
    """Validate an engine base URL and return its canonical ``scheme://host:port`` form.

    An engine is addressed by its base URL only; Relax appends the SGLang endpoint paths itself, so a path,
    query or fragment is a mistake (``http://h:30000/generate``) that would later fail in confusing ways.
    User info is refused because credentials in a URL end up in logs and in ``GET /rollout/engines``. The
    port must be explicit: SGLang servers never listen on 80/443 by default. Canonical form (lower-case
    scheme and host, no trailing slash) is what makes "already attached" checks idempotent.

    Raises ``ValueError`` with a message that quotes the URL and says what is wrong.
    """
    if not isinstance(url, str):
        raise ValueError(f"engine URL must be a string, got {type(url).__name__}")
    raw = url.strip()
    shown = repr(url if len(url) <= 80 else url[:77] + "...")
    if not raw:
        raise ValueError("engine URL is empty")
    if len(raw) > MAX_URL_LENGTH:
        raise ValueError(f"engine URL {shown} is longer than {MAX_URL_LENGTH} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in raw):
        raise ValueError(f"engine URL {shown} contains whitespace or control characters")
    try:
        parts = urlsplit(raw)
    except ValueError as exc:
        raise ValueError(f"engine URL {shown} is malformed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        hint = " (missing 'http://'?)" if not parts.scheme or "//" not in raw else ""
        raise ValueError(f"engine URL {shown} must use http or https{hint}")
    if "@" in parts.netloc:
        raise ValueError(f"engine URL {shown} must not contain user info ('user@')")
    host = parts.hostname
    if not host:
        raise ValueError(f"engine URL {shown} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or raw.endswith(("?", "#")):
        raise ValueError(
            f"engine URL {shown} must be a base URL without path, query or fragment (like http://10.0.0.5:30000)"
        )
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"engine URL {shown} has an invalid port (expected 1-65535)") from None
    if port is None:
        raise ValueError(f"engine URL {shown} needs an explicit port (like http://10.0.0.5:30000)")
    if port == 0:
        raise ValueError(f"engine URL {shown} has an invalid port 0 (expected 1-65535)")
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"engine URL {shown} has an invalid IPv6 host {host!r}") from None
        host_part = f"[{host}]"
    else:
        if not _HOSTNAME_RE.match(host):
            raise ValueError(f"engine URL {shown} has an invalid host {host!r}")
        host_part = host
    return f"{scheme}://{host_part}:{port}"
