"""The control plane's token (``relax.cluster.api_token``): one per run, private, found by the exact address."""

from __future__ import annotations

import os
from pathlib import Path

from relax.cluster.api_token import (
    Access,
    LookupRecord,
    find_token,
    lookup_path,
    publish_token,
    run_token,
    withdraw_token,
    write_token,
)


def alive(_: LookupRecord) -> bool:
    return True


def test_every_run_has_a_token_the_operators_or_a_fresh_one() -> None:
    assert run_token({"RELAX_API_TOKEN": " given\n"}) == "given"
    fresh = run_token({})
    assert len(fresh) >= 32 and fresh != run_token({"RELAX_API_TOKEN": "  "})


def test_the_token_is_written_for_its_user_only_and_found_by_its_exact_address(tmp_path: Path) -> None:
    home, run = tmp_path / "home", tmp_path / "run"
    run.mkdir()
    token_file = write_token("t0k3n", run)
    [lookup] = publish_token("t0k3n", "http://127.0.0.1:8123", home)
    assert lookup == lookup_path("127.0.0.1", 8123, home)
    assert token_file.read_text().strip() == "t0k3n" and token_file.stat().st_mode & 0o777 == 0o600
    assert lookup.stat().st_mode & 0o777 == 0o600 and lookup.parent.stat().st_mode & 0o777 == 0o700
    assert LookupRecord.parse(lookup.read_text()) == LookupRecord("t0k3n", os.getpid(), LookupRecord.parse(
        lookup.read_text()).started)
    assert find_token("http://127.0.0.1:8123/x", {}, home) == Access("http://127.0.0.1:8123/x", "t0k3n")
    assert find_token("http://127.0.0.1:8123", {"RELAX_API_TOKEN": "env"}, home).token == "env"  # the variable wins


def test_the_same_port_on_another_address_gets_no_token(tmp_path: Path) -> None:
    home = tmp_path / "home"
    publish_token("t0k3n", "http://127.0.0.1:8123", home)
    for url in ("http://[::1]:8123", "http://127.0.0.2:8123", "http://10.1.2.3:8123", "http://127.0.0.1:9999"):
        assert find_token(url, {}, home, alive) == Access(url, None), url


def test_a_name_is_sent_to_the_literal_address_the_run_listens_on(tmp_path: Path) -> None:
    home = tmp_path / "home"
    publish_token("t0k3n", "http://127.0.0.1:8123", home)
    # localhost may resolve to ::1 first: the CLI must connect where the run is, not wherever the name leads
    assert find_token("http://localhost:8123/rollout/engines", {}, home, alive) == Access(
        "http://127.0.0.1:8123/rollout/engines", "t0k3n")
    publish_token("six", "http://[::1]:8124", home)
    assert find_token("http://[::1]:8124", {}, home, alive) == Access("http://[::1]:8124", "six")


def test_a_wildcard_bind_is_found_by_the_nodes_address_and_loopback(tmp_path: Path) -> None:
    home = tmp_path / "home"
    paths = publish_token("t0k3n", "http://10.0.0.5:8123", home, wildcard="0.0.0.0")
    assert paths == [lookup_path("10.0.0.5", 8123, home), lookup_path("127.0.0.1", 8123, home)]
    assert find_token("http://127.0.0.1:8123", {}, home, alive).token == "t0k3n"
    assert find_token("http://[::1]:8123", {}, home, alive).token is None  # 0.0.0.0 does not hold ::1


def test_a_dead_runs_record_is_ignored_and_removed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    [lookup] = publish_token("dead", "http://127.0.0.1:8123", home)
    assert find_token("http://127.0.0.1:8123", {}, home, lambda record: False).token is None
    assert not lookup.exists()
    # the real liveness check: a pid that exists but started at another time is not the owner (pid reuse)
    publish_token("reused", "http://127.0.0.1:8123", home)
    record = LookupRecord.parse(lookup.read_text())
    assert record is not None and find_token("http://127.0.0.1:8123", {}, home).token == "reused"
    lookup.write_text(LookupRecord("reused", record.pid, record.started - 100).to_json())
    assert find_token("http://127.0.0.1:8123", {}, home).token is None and not lookup.exists()
    lookup.parent.joinpath("127.0.0.1:8125").write_text("an older plain token\n")  # not a record: dropped
    assert find_token("http://127.0.0.1:8125", {}, home).token is None


def test_an_older_file_and_directory_of_another_mode_are_made_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    lookup = lookup_path("127.0.0.1", 8124, home)
    lookup.parent.mkdir(parents=True)
    lookup.parent.chmod(0o755)
    lookup.write_text("old")
    lookup.chmod(0o644)
    publish_token("new", "http://127.0.0.1:8124", home)
    assert lookup.stat().st_mode & 0o777 == 0o600 and "new" in lookup.read_text()
    assert lookup.parent.stat().st_mode & 0o777 == 0o700


def test_withdraw_leaves_another_runs_token_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    lookups = publish_token("mine", "http://127.0.0.1:8125", home)
    publish_token("theirs", "http://127.0.0.1:8125", home)  # a later run on the same address
    withdraw_token(lookups, "mine")
    assert find_token("http://127.0.0.1:8125", {}, home).token == "theirs"
    withdraw_token(lookups, "theirs")
    assert not any(path.exists() for path in lookups)
