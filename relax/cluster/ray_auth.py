"""Ray stays locked: token auth on, and clusters Relax starts itself listen on loopback only.

Why: with ``RAY_AUTH_MODE=disabled`` any process that can reach a Ray cluster's GCS can attach a driver and
run code as the training's user, and a cluster whose node address is routable listens on every interface
(GCS, raylet, every worker). Measured on Ray 2.60 (docs/development.md, "Traps when the whole cluster is on one
machine"):

* Token auth (``RAY_AUTH_MODE=token``) refuses a driver without the token at once
  (``AuthenticationError``), and one with a wrong token after Ray's connection retries; every Ray process
  reads the token from ``RAY_AUTH_TOKEN`` (first), ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``.
* Ray binds its servers to loopback only when the node address *is* loopback, and ``ray.init`` /
  ``ray start`` replace an explicit 127.0.0.1 by the routable address unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` — the switch Ray itself uses to keep laptop clusters local.
  That switch also makes ``ray start --address`` refuse to join, so it is set only on heads and
  single-node clusters; a worker started against a 127.0.0.1 head finds 127.0.0.1 on its own.

Everything here returns environment updates rather than mutating a process, so the same rules serve the
embedded cluster (this process), ``relax cluster up`` (a detached head) and the test harness.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "LOOPBACK_ENV",
    "MODE_ENV",
    "TOKEN_ENV",
    "TOKEN_PATH_ENV",
    "apply_in_process",
    "auth_disabled",
    "auth_headers",
    "cluster_token",
    "disabled_warning",
    "has_token",
    "keep_on_loopback_in_process",
    "locked_env",
    "read_token",
    "warn_if_disabled",
    "write_token_file",
]

log = logging.getLogger("relax.cluster")

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# Ray's own switch for "this machine is the whole cluster": node address = loopback, servers bound to it.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")

_warned: set[str] = set()


def auth_disabled(env: Mapping[str, str]) -> bool:
    """The user switched Ray's token auth off explicitly."""
    return env.get(MODE_ENV, "").strip().lower() == "disabled"


def has_token(env: Mapping[str, str]) -> bool:
    """A token Ray will find, in its own order: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, the default file."""
    return read_token(env) is not None


def cluster_token(env: Mapping[str, str]) -> str:
    """The token of a cluster Relax starts: the caller's ``RAY_AUTH_TOKEN`` if set, else a new random one.

    Reusing the caller's token keeps one token per process (Ray reads it once per process), so a driver that
    already holds one can still reach the clusters it starts.
    """
    given = env.get(TOKEN_ENV, "").strip()
    return given or secrets.token_hex(32)


def disabled_warning(where: str) -> str:
    return (f"RAY_AUTH_MODE=disabled ({where}): Ray's token auth is OFF — anyone who can reach this cluster's "
            "ports can attach a driver or submit a job and run code as this user. Unset it (Relax then keeps "
            "token auth on) unless the cluster is on a network only you can reach; see docs/install.md, "
            "'Security'.")


def warn_if_disabled(env: Mapping[str, str], where: str) -> bool:
    """Log, once per place, that auth is off; returns whether it is."""
    if not auth_disabled(env):
        return False
    if where not in _warned:
        _warned.add(where)
        log.warning(disabled_warning(where))
    return True


def read_token(env: Mapping[str, str]) -> str | None:
    """The token Ray would use in a process with ``env`` (same precedence as Ray), or None."""
    given = env.get(TOKEN_ENV, "").strip()
    if given:
        return given
    path = env.get(TOKEN_PATH_ENV, "").strip()
    candidate = Path(path).expanduser() if path else DEFAULT_TOKEN_FILE.expanduser()
    try:
        return candidate.read_text().strip() or None
    except OSError:
        return None


def auth_headers(env: Mapping[str, str]) -> dict[str, str]:
    """HTTP headers for Ray's dashboard / jobs API when token auth is on (empty when off or no token)."""
    if auth_disabled(env):
        return {}
    token = read_token(env)
    return {"Authorization": f"Bearer {token}"} if token else {}


def locked_env(env: Mapping[str, str], *, loopback: bool, token: str | None = None) -> dict[str, str]:
    """Environment updates for the processes of a cluster Relax starts (and for drivers of it).

    ``loopback``: a single-machine cluster (embedded, or a head whose workers all run on this machine) binds
    127.0.0.1 only. ``token``: the cluster's token, put in ``RAY_AUTH_TOKEN`` (leave None when it comes from
    a file named by ``RAY_AUTH_TOKEN_PATH`` in ``env``). An explicit ``RAY_AUTH_MODE=disabled`` is honoured
    (tests and users who insist), never silently: :func:`warn_if_disabled`.
    """
    updates: dict[str, str] = {}
    if loopback:
        updates[LOOPBACK_ENV] = "0"
    if auth_disabled(env):
        return updates
    updates[MODE_ENV] = "token"
    if token is not None:
        updates[TOKEN_ENV] = token
    return updates


def apply_in_process(updates: Mapping[str, str], remove: Iterable[str] = ()) -> None:
    """Put ``updates`` into this process's environment (and drop ``remove``) so that Ray, already imported,
    sees them too.

    Ray reads its auth mode into a cached config, and the token into a cached loader, the first time it
    uses either (``import ray`` is enough for the mode). A driver that turns auth on after importing Ray
    would otherwise start a token-auth cluster and then talk to it without a token, and be refused by its
    own GCS. Ray's ``ray.init`` refreshes both the same way when it turns token auth on itself.
    """
    auth_vars = {MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV}
    before = {k: os.environ.get(k) for k in auth_vars}
    for key in remove:
        os.environ.pop(key, None)
    os.environ.update(updates)
    changed = {k for k in auth_vars if os.environ.get(k) != before[k]}
    if not changed or "ray" not in sys.modules:  # nothing cached yet: Ray reads the environment when it starts
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # pragma: no cover - a Ray without token auth: nothing to refresh
        return
    if MODE_ENV in changed:
        Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def keep_on_loopback_in_process() -> None:
    """Make this process's Ray treat the machine as the whole cluster (node address 127.0.0.1).

    Ray reads :data:`LOOPBACK_ENV` once, when ``ray`` is imported; a driver decides to embed a cluster later,
    so the value read at import is set here too (a private constant: callers check the result, e.g. with
    ``ray.util.get_node_ip_address()``). Child processes get the variable from the environment.
    """
    os.environ[LOOPBACK_ENV] = "0"
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - ray is a dependency
        return
    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        ray_constants.ENABLE_RAY_CLUSTER = False


def write_token_file(path: Path, token: str) -> Path:
    """Write ``token`` readable by this user only (created 0600: never world-readable, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path
