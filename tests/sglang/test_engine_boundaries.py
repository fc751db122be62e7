"""The real SGLang 0.5.23 at the boundaries Relax owns: keys, argv, logs, start failures, stops, /dev/shm.

Every engine here is set up exactly as an EngineActor sets it up (``relax.engines.backends.SGLangBackend``):
SGLang's CPU platform chosen by Relax, its keys in a private ``--config`` file.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import httpx
import pytest

from relax.engines.keys import EngineKeys, engine_keys
from relax.engines.launcher import ServerLaunchError
from relax.engines.shm_leftovers import SHM_DIR, group_pids
from tests.sglang.conftest import start_sglang

CONTROL_CALLS = [
    ("/pause_generation", {"mode": "abort"}),
    ("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "9"}),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[1]],
                                          "group_name": "g"}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "gloo"}),
    ("/begin_weight_update", {}),
    ("/flush_cache", {}),
]


def _post(url: str, path: str, body: dict, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60, trust_env=False).status_code


@pytest.mark.parametrize("path,body", CONTROL_CALLS, ids=[p for p, _ in CONTROL_CALLS])
def test_the_generation_key_cannot_pause_or_load_weights(sglang_engine, sglang_keys: EngineKeys, path: str,
                                                          body: dict) -> None:
    """SGLang with both keys: control routes refuse the generation key (and no key) before doing anything."""
    assert _post(sglang_engine.url, path, body, sglang_keys.generation) == 401
    assert _post(sglang_engine.url, path, body, None) == 401


def test_the_admin_key_controls_and_cannot_generate(sglang_engine, sglang_keys: EngineKeys) -> None:
    url = sglang_engine.url
    generate = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}
    assert _post(url, "/generate", generate, sglang_keys.generation) == 200
    assert _post(url, "/generate", generate, sglang_keys.admin) == 401  # the admin key only controls
    assert _post(url, "/pause_generation", {"mode": "abort"}, sglang_keys.admin) == 200
    assert _post(url, "/continue_generation", {}, sglang_keys.admin) == 200
    assert _post(url, "/generate", generate, sglang_keys.generation) == 200  # serving again
    other = engine_keys("tests-sglang-run-secret", "engine_1")  # another engine's keys open nothing here
    assert _post(url, "/generate", generate, other.generation) == 401
    assert _post(url, "/pause_generation", {"mode": "abort"}, other.admin) == 401


def test_no_key_in_any_argv_and_the_log_and_keys_file_are_private(sglang_engine, sglang_keys: EngineKeys) -> None:
    """``ps`` shows no key of the engine's (guard, server, scheduler, detokenizer); SGLang logs its server_args
    with the keys, so its log is the run user's alone, and so is the keys file."""
    pids = group_pids(sglang_engine.pid)
    assert len(pids) >= 3, pids  # the guard, SGLang's server and at least its scheduler
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert sglang_keys.generation not in cmdline and sglang_keys.admin not in cmdline, cmdline
    log = Path(sglang_engine.spec.log_path)
    assert sglang_keys.admin in log.read_text()  # why the mode matters: SGLang prints its keys at start
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    (keys_file,) = sglang_engine.spec.secret_files
    assert stat.S_IMODE(os.stat(keys_file).st_mode) == 0o600


def test_a_server_that_dies_in_warm_up_is_reported_with_its_own_error_line(tiny_preset, tmp_path: Path) -> None:
    """SGLang kills its own process tree (SIGKILL) after an error in its warm-up, which looks like the OOM
    killer; the launch error names SGLang's own last error line instead (here a context length the warm-up
    prompt does not fit; on AMX machines the tiny preset's head size 16 fails the same way with intel_amx)."""
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(ServerLaunchError) as caught:
        start_sglang(tiny_preset.model_dir, tmp_path, name="engine_bad", extra_args=("--context-length", "16"))
    # what its processes made went with them; but for the name of a multiprocessing semaphore (32 bytes) that no
    # process maps, which SGLang's resource tracker would unlink had SGLang's own SIGKILL not taken it down too
    left = {name for name in set(os.listdir(SHM_DIR)) - before if not name.startswith("sem.mp-")}
    assert left == set(), left
    first_line = str(caught.value).splitlines()[0]
    assert "longer than the model's context length (16 tokens)" in first_line, first_line
    assert "out of memory" not in first_line
    assert caught.value.exit_code == -9  # SGLang's own kill_process_tree, not ours


def test_a_stop_is_sglangs_own_graceful_shutdown_and_leaves_dev_shm_as_it_was(tiny_preset, tmp_path: Path) -> None:
    """Scale-in's stop: SIGTERM to the server alone, which drains, stops its scheduler and exits 0 — not a
    SIGKILL after a wait for nothing — and every /dev/shm file its processes made goes with it."""
    before = set(os.listdir(SHM_DIR))
    server, prepared = start_sglang(tiny_preset.model_dir, tmp_path, name="engine_stop",
                                    keys=engine_keys("s", "engine_stop"))
    made = set(os.listdir(SHM_DIR)) - before
    assert made, "SGLang made no /dev/shm file: this test would prove nothing"
    assert len(group_pids(server.pid)) >= 3
    began = time.monotonic()
    code = server.stop()
    took = time.monotonic() - began
    prepared.release()
    assert code == 0, f"exit code {code}: the stop was not SGLang's own shutdown"
    assert took < server.spec.stop_grace_s
    assert group_pids(server.pid) == set()  # the scheduler and detokenizer went with it (zombies aside)
    assert set(os.listdir(SHM_DIR)) - before == set(), f"left in /dev/shm: {set(os.listdir(SHM_DIR)) - before}"
    assert not Path(next(iter(server.spec.secret_files))).exists()  # the keys file goes with the server
