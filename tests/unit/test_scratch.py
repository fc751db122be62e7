"""Run scratch directories: run-unique, leased by live processes, removed by the last one out or a sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax.cluster import scratch

HOLDER = r"""
import os, sys
os.environ["RELAX_SCRATCH_DIR"] = sys.argv[1]
os.environ["RELAX_RUN_ID"] = sys.argv[2]
from relax.cluster import scratch
root = scratch.run_dir()
(root / "weights").mkdir(exist_ok=True)
(root / "weights" / "v1").write_text("w")
print(root, flush=True)
sys.stdin.read()  # hold the lease until told to go (or killed)
if len(sys.argv) > 3:
    scratch.release()
"""


class Holder:
    """Another process of a run, leasing its scratch directory."""

    def __init__(self, base: Path, run: str, *, release_on_exit: bool = False) -> None:
        args = [sys.executable, "-c", HOLDER, str(base), run] + (["release"] if release_on_exit else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        self.root = Path(self.proc.stdout.readline().strip())

    def finish(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAX_SCRATCH_DIR", str(tmp_path))
    yield tmp_path
    scratch.release()


def test_two_runs_get_two_directories(base: Path) -> None:
    a = scratch.run_dir(run="a")
    b = scratch.run_dir(run="b")
    assert a != b and a.parent == b.parent == base
    assert a.name == "relax-run-a" and (a / ".lease").is_file()
    assert scratch.run_dir(run="a") == a  # cached: one lease per process and directory


def test_run_id_from_env_is_made_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAX_RUN_ID", "../../etc x")
    assert "/" not in scratch.run_id() and " " not in scratch.run_id()


def test_a_live_holder_keeps_its_directory_from_sweeps_and_from_our_release(base: Path) -> None:
    other = Holder(base, "busy")
    try:
        assert scratch.sweep(base) == []
        ours = scratch.run_dir(run="busy")  # a second process of the same run
        assert ours == other.root
        assert scratch.release(ours) == []  # not the last user: the directory stays
        assert (other.root / "weights" / "v1").read_text() == "w"
    finally:
        other.finish()
    assert other.root.is_dir()  # the holder left without releasing (as an engine killed by Ray does)
    assert scratch.sweep(base) == [other.root] and not other.root.exists()


def test_a_sigkilled_holder_leaves_a_directory_the_next_sweep_removes(base: Path) -> None:
    other = Holder(base, "crashed")
    alive = Holder(base, "alive")
    try:
        other.kill()  # the kernel drops its lease; nothing of it ran
        assert other.root.is_dir()
        (base / "relax-run-not-ours").mkdir()  # our name, but no lease file: never touched
        (base / "unrelated").mkdir()
        assert scratch.sweep(base) == [other.root]
        assert alive.root.is_dir() and (base / "relax-run-not-ours").is_dir() and (base / "unrelated").is_dir()
    finally:
        alive.finish()


def test_the_last_user_removes_the_directory_on_release(base: Path) -> None:
    other = Holder(base, "shared", release_on_exit=True)
    ours = scratch.run_dir(run="shared")
    other.finish()  # it released, but we still hold a lease: kept
    assert ours.is_dir()
    assert scratch.release(ours) == [ours] and not ours.exists()


def test_first_use_on_a_node_sweeps_what_crashed_runs_left(base: Path) -> None:
    crashed = Holder(base, "old")
    crashed.kill()
    fresh = scratch.run_dir(run="new")
    assert not crashed.root.exists() and fresh.is_dir()


CLAIMER = r"""
import sys
from pathlib import Path
from relax.cluster import scratch
assert scratch.claim(Path(sys.argv[1])) is None
print("claimed", flush=True)
sys.stdin.read()
"""


def test_an_output_directory_is_one_live_runs_alone(tmp_path: Path) -> None:
    out = tmp_path / "out"
    other = subprocess.Popen([sys.executable, "-c", CLAIMER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "claimed"
        why = scratch.claim(out)
        assert why == f"{out.resolve()} is in use by another live run (pid {other.pid})"
    finally:
        os.killpg(other.pid, signal.SIGKILL)  # a crashed run never blocks the next one
        other.wait(timeout=30)
    assert scratch.claim(out) is None and scratch.claim(out) is None  # ours now; idempotent
    assert (out / ".relax-owner").read_text().strip() == str(os.getpid())
