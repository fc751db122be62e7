"""The control plane's token (``relax.cluster.api_token``): one per run, private, found by port."""

from __future__ import annotations

from pathlib import Path

from relax.cluster.api_token import find_token, lookup_path, run_token, withdraw_token, write_token


def test_every_run_has_a_token_the_operators_or_a_fresh_one() -> None:
    assert run_token({"RELAX_API_TOKEN": " given\n"}) == "given"
    fresh = run_token({})
    assert len(fresh) >= 32 and fresh != run_token({"RELAX_API_TOKEN": "  "})


def test_the_token_is_written_for_its_user_only_and_found_by_port(tmp_path: Path) -> None:
    home, run = tmp_path / "home", tmp_path / "run"
    run.mkdir()
    lookup = write_token("t0k3n", 8123, run, home)
    assert lookup == lookup_path(8123, home)
    for path in (lookup, run / "api-token"):
        assert path.read_text().strip() == "t0k3n" and path.stat().st_mode & 0o777 == 0o600
    assert lookup.parent.stat().st_mode & 0o777 == 0o700
    assert find_token("http://127.0.0.1:8123", {}, home) == "t0k3n"
    assert find_token("http://127.0.0.1:8123", {"RELAX_API_TOKEN": "env"}, home) == "env"  # the variable wins
    assert find_token("http://127.0.0.1:9999", {}, home) is None


def test_an_older_file_and_directory_of_another_mode_are_made_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    lookup = lookup_path(8124, home)
    lookup.parent.mkdir(parents=True)
    lookup.parent.chmod(0o755)
    lookup.write_text("old")
    lookup.chmod(0o644)
    write_token("new", 8124, tmp_path, home)
    assert lookup.stat().st_mode & 0o777 == 0o600 and lookup.read_text().strip() == "new"
    assert lookup.parent.stat().st_mode & 0o777 == 0o700


def test_withdraw_leaves_another_runs_token_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    lookup = write_token("mine", 8125, tmp_path, home)
    write_token("theirs", 8125, tmp_path, home)  # a later run on the same port
    withdraw_token(lookup, "mine")
    assert lookup.read_text().strip() == "theirs"
    withdraw_token(lookup, "theirs")
    assert not lookup.exists()
