"""Engine keys (relax.engines.keys): SGLang 0.5.23's two-key rule, per-engine derivation; and the pieces that keep
keys and leftovers off the machine: the launch error's own error line, the /dev/shm ledger."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax.engines.keys import EngineKeys, authorized, engine_keys, is_admin_route
from relax.engines.launcher import last_error_line
from relax.engines.shm_leftovers import KMP_PREFIX, SHM_DIR, ShmLedger, group_pids
from relax.weights.pause_mode import PauseMode

GEN, ADMIN = "gen-key", "admin-key"


@pytest.mark.parametrize("path,header,expected", [
    ("/generate", f"Bearer {GEN}", True),
    ("/generate", f"Bearer {ADMIN}", False),  # the admin key does not generate
    ("/pause_generation", f"Bearer {GEN}", False),  # the generation key does not control
    ("/pause_generation", f"Bearer {ADMIN}", True),
    ("/update_weights_from_distributed", f"Bearer {GEN}", False),
    ("/abort_request", None, False),
    ("/health_generate", None, True),  # probes and scrapes are open
    ("/metrics", None, True),
    ("/model_info", f"Bearer {GEN}", True),
])
def test_two_keys_as_sglang_decides(path: str, header: str | None, expected: bool) -> None:
    assert authorized(path, header, GEN, ADMIN) is expected


def test_one_key_opens_both_sides_and_no_key_opens_everything() -> None:
    assert authorized("/pause_generation", f"Bearer {GEN}", GEN, None)
    assert authorized("/generate", None, None, ADMIN)  # an admin key alone leaves generation open, as on SGLang
    assert authorized("/flush_cache", None, None, None)


def test_keys_for_routes_and_per_engine_derivation() -> None:
    keys = engine_keys("secret", "engine_3")
    assert keys.generation and keys.admin and keys.generation != keys.admin
    assert keys == engine_keys("secret", "engine_3") and keys != engine_keys("secret", "engine_4")
    assert is_admin_route("/end_weight_update") and is_admin_route("/weights_checker/")
    assert not is_admin_route("/generate")
    assert "secret" not in repr(keys) and keys.generation not in repr(keys)
    assert EngineKeys.single("k") == EngineKeys("k", "k") and not EngineKeys()


def test_pause_mode_in_place_asks_for_no_cache_flush() -> None:
    assert [m for m in PauseMode if not m.flushes_cache] == [PauseMode.IN_PLACE]


@pytest.mark.parametrize("tail,expected", [
    ("[..] Initialization failed. warmup error: Traceback (most recent call last):\n  File \"x.py\", line 1\n"
     "    assert res.status_code == 200\n           ^^^^\nAssertionError: {\"error\": \"too long\"}\n\n"
     "[..] kill_process_tree called: parent_pid=1", "AssertionError: {\"error\": \"too long\"}"),
    ("RuntimeError: invalid head_size 16\nrelax guard: server pid 7 was killed by SIGKILL",
     "RuntimeError: invalid head_size 16"),
    ("[..] Ignore import error when loading sglang.srt.models.mamba: nope\n[..] INFO ready", None),
    ("", None),
])
def test_the_last_error_line_is_the_servers_own(tail: str, expected: str | None) -> None:
    assert last_error_line(tail) == expected


def test_the_ledger_removes_only_what_the_group_made(tmp_path: Path) -> None:
    """Pids and held files are read from /proc while a child group runs; after it is gone, only its files go."""
    shm = tmp_path / "shm"
    shm.mkdir()
    held = shm / "held-by-child"
    held.write_bytes(b"x" * 4096)
    child = subprocess.Popen([sys.executable, "-c", f"import mmap,sys,time\nf=open({str(held)!r},'r+b')\n"
                              "m=mmap.mmap(f.fileno(), 0)\nprint('ready', flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        ledger = ShmLedger(tags=("_4242_",))
        ledger.note(child.pid, shm=shm)
        assert child.pid in group_pids(child.pid)
    finally:
        child.kill()
        child.wait()
    (shm / f"{KMP_PREFIX}{child.pid}_0").write_text("")  # the OpenMP registration of a process of the group
    (shm / "deepspeed_allreduce_buffer_0_127.0.0.1_4242_0").write_text("")  # tagged by the server's port
    (shm / f"{KMP_PREFIX}{os.getpid()}_0").write_text("")  # someone else's
    (shm / "someone-elses").write_text("")
    assert sorted(ledger.sweep(shm)) == sorted([held.name, f"{KMP_PREFIX}{child.pid}_0",
                                                "deepspeed_allreduce_buffer_0_127.0.0.1_4242_0"])
    assert sorted(p.name for p in shm.iterdir()) == sorted([f"{KMP_PREFIX}{os.getpid()}_0", "someone-elses"])


def test_a_killed_groups_named_semaphore_is_swept_by_its_inode() -> None:
    """The soak's leak: each SIGKILLed SGLang group left a ``sem.mp-*`` in /dev/shm. A multiprocessing lock made the
    way SGLang's processes make theirs (spawn context: its name stays until the resource tracker unlinks it, and
    the tracker dies with the group) maps ``sem.XXXXXX (deleted)``; only the inode leads to ``sem.mp-…``."""
    before = {p.name for p in SHM_DIR.glob("sem.mp-*")}
    code = ("import multiprocessing as mp, sys, time\n"
            "if __name__ == '__main__':\n"
            "    lock = mp.get_context('spawn').Lock()\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        made = {p.name for p in SHM_DIR.glob("sem.mp-*")} - before
        assert len(made) == 1  # the live name, which no maps line of the child names
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        assert next(iter(made)) not in maps and "/dev/shm/sem." in maps
        ledger = ShmLedger()
        ledger.note(child.pid)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the whole group, the resource tracker with it
        child.wait()
    assert {p.name for p in SHM_DIR.glob("sem.mp-*")} - before == made  # left behind, as in the soak
    assert set(ledger.sweep()) >= made
    assert {p.name for p in SHM_DIR.glob("sem.mp-*")} - before == set()


def test_derived_keys_never_look_like_a_flag() -> None:
    """SGLang re-reads its --config file as arguments: a key starting with '-' would be taken for a flag."""
    for n in range(500):
        keys = engine_keys(f"secret-{n}", f"engine_{n % 7}")
        assert keys.generation and keys.admin
        assert not keys.generation.startswith("-") and not keys.admin.startswith("-")
        assert all(c in "0123456789abcdef" for c in keys.generation + keys.admin)
