"""The rules that keep Ray locked: token auth on, loopback for clusters Relax starts, loud when turned off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax.cluster import ray_auth


def test_clusters_relax_starts_get_token_auth_and_loopback() -> None:
    assert ray_auth.locked_env({}, loopback=True, token="t") == {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t"}
    assert ray_auth.locked_env({}, loopback=False) == {"RAY_AUTH_MODE": "token"}


def test_an_explicit_disabled_is_honoured_and_said_loudly(caplog: pytest.LogCaptureFixture) -> None:
    env = {"RAY_AUTH_MODE": " Disabled "}
    assert ray_auth.locked_env(env, loopback=True, token="t") == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with caplog.at_level(logging.WARNING, logger="relax.cluster"):
        assert ray_auth.warn_if_disabled(env, "unit test place")
        assert ray_auth.warn_if_disabled(env, "unit test place")  # said once per place, still reported
    warnings = [r.getMessage() for r in caplog.records if "unit test place" in r.getMessage()]
    assert len(warnings) == 1 and "token auth is OFF" in warnings[0] and "run code" in warnings[0]
    assert not ray_auth.warn_if_disabled({"RAY_AUTH_MODE": "token"}, "unit test place")


def test_the_callers_token_is_reused_else_a_fresh_one() -> None:
    assert ray_auth.cluster_token({"RAY_AUTH_TOKEN": " abc "}) == "abc"
    a, b = ray_auth.cluster_token({}), ray_auth.cluster_token({})
    assert a != b and len(a) == 64


def test_token_lookup_follows_rays_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_auth, "DEFAULT_TOKEN_FILE", tmp_path / "default")
    path = ray_auth.write_token_file(tmp_path / "dir" / "token", "from-file")
    assert path.stat().st_mode & 0o777 == 0o600
    assert ray_auth.read_token({"RAY_AUTH_TOKEN": "env", "RAY_AUTH_TOKEN_PATH": str(path)}) == "env"
    assert ray_auth.read_token({"RAY_AUTH_TOKEN_PATH": str(path)}) == "from-file"
    assert ray_auth.read_token({}) is None and not ray_auth.has_token({})
    (tmp_path / "default").write_text("dflt\n")
    assert ray_auth.read_token({}) == "dflt" and ray_auth.has_token({})
    assert ray_auth.auth_headers({"RAY_AUTH_TOKEN": "x"}) == {"Authorization": "Bearer x"}
    assert ray_auth.auth_headers({"RAY_AUTH_TOKEN": "x", "RAY_AUTH_MODE": "disabled"}) == {}


APPLY_AFTER_IMPORT = """
import ray
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
from relax.cluster import ray_auth
assert get_authentication_mode() != AuthenticationMode.TOKEN  # read when Ray was imported
ray_auth.apply_in_process({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "first"})
assert get_authentication_mode() == AuthenticationMode.TOKEN
assert AuthenticationTokenLoader.instance().has_token()
print("OK", flush=True)
"""


def test_auth_turned_on_after_ray_is_imported_reaches_rays_cached_config() -> None:
    """A driver decides to start a locked cluster after `import ray`: its own Ray must use the token too,
    or the cluster it just started refuses it (how `relax train` from a fresh shell once failed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    done = subprocess.run([sys.executable, "-c", APPLY_AFTER_IMPORT], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]
