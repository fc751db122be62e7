"""The control plane's token: every run has one, and the CLI finds it for a run on this machine.

Without a token anyone who can open a connection to the control plane — another user of the same machine, on
127.0.0.1 — could scale the pool or attach a server of their own as an "engine". So every run requires one:
``RELAX_API_TOKEN`` when the operator sets it, else a fresh random one. The driver writes it, readable by
its user only (mode 0600, like Ray's token file), into the run's output directory and into
``~/.relax/api-tokens/<port>`` (directory 0700), where ``relax engines/scale-out/scale-in/events/monitor`` and
the demo find it for a control plane on that port; the lookup file goes when the driver exits.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["TOKEN_ENV", "TOKEN_FILE", "find_token", "lookup_path", "run_token", "withdraw_token", "write_token"]

TOKEN_ENV = "RELAX_API_TOKEN"
#: The token's file in the run's output directory.
TOKEN_FILE = "api-token"


def run_token(environ: Mapping[str, str] = os.environ) -> str:
    """The operator's ``RELAX_API_TOKEN``, or a new random token for this run."""
    value = (environ.get(TOKEN_ENV) or "").strip()
    return value or secrets.token_urlsafe(32)


def lookup_path(port: int, home: Path | None = None) -> Path:
    """Where the token of the control plane on ``port`` of this machine is kept for its user."""
    return (home or Path.home()) / ".relax" / "api-tokens" / str(int(port))


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)  # mkdir's mode does not apply to a directory that already existed


def _write_private(path: Path, text: str) -> None:
    _private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of another mode keeps its mode through O_TRUNC
        f.write(text + "\n")


def write_token(token: str, port: int, run_dir: Path, home: Path | None = None) -> Path:
    """Write the token (0600) into the run's directory and the per-user lookup; returns the lookup path."""
    _write_private(Path(run_dir) / TOKEN_FILE, token)
    lookup = lookup_path(port, home)
    _private_dir(lookup.parent.parent)
    _write_private(lookup, token)
    return lookup


def withdraw_token(lookup: Path, token: str) -> None:
    """Remove the lookup file at exit, unless another run has written its own token there since."""
    with contextlib.suppress(OSError):
        if lookup.read_text().strip() == token:
            lookup.unlink()


def find_token(url: str, environ: Mapping[str, str] = os.environ, home: Path | None = None) -> str | None:
    """``RELAX_API_TOKEN``, else the token of a run on this machine serving ``url``'s port; None if neither."""
    value = (environ.get(TOKEN_ENV) or "").strip()
    if value:
        return value
    port = urlsplit(url).port or 80
    with contextlib.suppress(OSError):
        return lookup_path(port, home).read_text().strip() or None
    return None
