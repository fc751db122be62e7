"""The control plane's token: every run has one, and the CLI finds it for a run on this machine.

Without a token anyone who can open a connection to the control plane — another user of the same machine, on
127.0.0.1 — could scale the pool or attach a server of their own as an "engine". So every run requires one:
``RELAX_API_TOKEN`` when the operator sets it, else a fresh random one. The driver writes it, readable by
its user only (mode 0600, like Ray's token file), into the run's output directory, and a lookup record into
``~/.relax/api-tokens/`` (directory 0700) named after the exact address the control plane listens on.

Why the exact address and not the port: the control plane binds one address (127.0.0.1 by default), so the
same port on ``[::1]``, ``127.0.0.2`` or another host is free for anyone to listen on. The CLI therefore sends
a found token only to the address it was written for — it connects to that literal address even when the
operator typed a name such as ``localhost`` — and a record whose driver is gone (a SIGKILLed run) is dropped
rather than handed to whoever listens on that port next.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

__all__ = ["TOKEN_ENV", "TOKEN_FILE", "Access", "LookupRecord", "find_token", "lookup_dir", "lookup_path",
           "publish_token", "run_token", "withdraw_token", "write_token"]

TOKEN_ENV = "RELAX_API_TOKEN"
#: The token's file in the run's output directory.
TOKEN_FILE = "api-token"

_WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


@dataclass(frozen=True)
class Access:
    """Where the CLI sends its requests, and the token it sends there (None: no token for that address)."""

    url: str
    token: str | None


@dataclass(frozen=True)
class LookupRecord:
    """One lookup file: the run's token for one listening address, and the driver that owns it.

    ``started`` is the owner's process start time: a pid alone could be reused by an unrelated process after
    the driver was killed."""

    token: str
    pid: int
    started: float

    def to_json(self) -> str:
        return json.dumps({"token": self.token, "pid": self.pid, "started": self.started})

    @staticmethod
    def parse(text: str) -> LookupRecord | None:
        """The record, or None for a file that is not one (an older plain-token file, a torn write)."""
        try:
            raw = json.loads(text)
            return LookupRecord(str(raw["token"]), int(raw["pid"]), float(raw["started"]))
        except (ValueError, TypeError, KeyError):
            return None


def run_token(environ: Mapping[str, str] = os.environ) -> str:
    """The operator's ``RELAX_API_TOKEN``, or a new random token for this run."""
    value = (environ.get(TOKEN_ENV) or "").strip()
    return value or secrets.token_urlsafe(32)


def _netloc(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{int(port)}"
    return f"{host}:{int(port)}"


def lookup_dir(home: Path | None = None) -> Path:
    return (home or Path.home()) / ".relax" / "api-tokens"


def lookup_path(host: str, port: int, home: Path | None = None) -> Path:
    """The lookup file of the control plane listening on literal address ``host:port`` of this machine."""
    return lookup_dir(home) / _netloc(host, port)


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)  # mkdir's mode does not apply to a directory that already existed


def _write_private(path: Path, text: str) -> None:
    _private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of another mode keeps its mode through O_TRUNC
        f.write(text + "\n")


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def write_token(token: str, run_dir: Path) -> Path:
    """Write the token (0600) into the run's output directory, where a user of another machine (or of
    Prometheus, ``credentials_file``) can read it; returns its path."""
    path = Path(run_dir) / TOKEN_FILE
    _write_private(path, token)
    return path


def publish_token(token: str, url: str, home: Path | None = None, *, wildcard: str | None = None,
                  pid: int | None = None) -> list[Path]:
    """Write a lookup record for each address the control plane at ``url`` listens on (its bound port, never
    the flag's 0), owned by process ``pid`` (this one); returns the lookup paths.

    Call it only on the machine the control plane serves on. ``wildcard`` is the bound host when it was a
    wildcard (``0.0.0.0``/``::``): the run then also answers on that family's loopback, which no other
    process can bind while the wildcard socket holds the port."""
    pid = os.getpid() if pid is None else pid
    record = LookupRecord(token, pid, _start_time(pid) or 0.0)
    parts = urlsplit(url)
    port = parts.port or 80
    hosts = [parts.hostname or "127.0.0.1"]
    if wildcard in _WILDCARD_LOOPBACK and _WILDCARD_LOOPBACK[wildcard] not in hosts:
        hosts.append(_WILDCARD_LOOPBACK[wildcard])
    _private_dir(lookup_dir(home).parent)
    paths = [lookup_path(host, port, home) for host in hosts]
    for path in paths:
        _write_private(path, record.to_json())
    return paths


def withdraw_token(lookups: list[Path], token: str) -> None:
    """Remove the lookup files at exit, unless another run has written its own token there since."""
    for lookup in lookups:
        with contextlib.suppress(OSError):
            record = LookupRecord.parse(lookup.read_text())
            if record is not None and record.token == token:
                lookup.unlink()


def _literal_addresses(host: str, port: int) -> list[str]:
    """``host`` itself when it is an IP address, else what it resolves to (in the resolver's order)."""
    with contextlib.suppress(ValueError):
        return [str(ipaddress.ip_address(host))]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _owner_alive(record: LookupRecord) -> bool:
    started = _start_time(record.pid)
    return started is not None and abs(started - record.started) < 0.5


def find_token(url: str, environ: Mapping[str, str] = os.environ, home: Path | None = None,
               owner_alive: Callable[[LookupRecord], bool] = _owner_alive) -> Access:
    """Where to send requests for ``url`` and with which token.

    ``RELAX_API_TOKEN`` is the operator's own choice: it goes to ``url`` as given. Otherwise the token of a live
    run on this machine whose control plane listens on one of the addresses ``url``'s host names, and the
    URL rewritten to that literal address, so a name resolving to several addresses never carries the token
    to another listener. A record whose driver has exited is removed. No record: no token."""
    value = (environ.get(TOKEN_ENV) or "").strip()
    if value:
        return Access(url, value)
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for address in _literal_addresses(host, port):
        path = lookup_path(address, port, home)
        try:
            record = LookupRecord.parse(path.read_text())
        except OSError:
            continue
        if record is None or not owner_alive(record):
            with contextlib.suppress(OSError):
                path.unlink()  # a dead run's token must not reach whoever listens on this port next
            continue
        netloc = _netloc(address, port)
        if parts.username or parts.password:  # pragma: no cover - userinfo in a control-plane URL is unusual
            netloc = f"{parts.netloc.rsplit('@', 1)[0]}@{netloc}"
        return Access(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), record.token)
    return Access(url, None)
