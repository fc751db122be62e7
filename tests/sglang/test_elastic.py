"""The elastic pool with real SGLang engines: a scale-out adds an engine that serves the current weights before
it is ACTIVE (verified tensor by tensor), a scale-in drains it and stops it with SGLang's own shutdown (exit 0,
no SIGKILL), and the machine's /dev/shm is as it was once the run is over."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from relax.cluster.network import free_port
from relax.demo.elastic import RunApi, wait_until
from relax.demo.local import train_argv
from relax.engines.shm_leftovers import SHM_DIR
from relax.weights.digest import checksum_mismatches
from tests.e2e.test_elastic_training import post, request_done
from tests.sglang.test_training import RefitWatcher, expected_checksums

pytestmark = pytest.mark.timeout(900)


def test_scale_out_and_in_with_real_sglang_engines(tiny_preset, sglang_python: str, tmp_path: Path) -> None:
    shm_before = set(os.listdir(SHM_DIR))
    port = free_port()
    api = RunApi(f"http://127.0.0.1:{port}")
    out = tmp_path / "run"
    argv = train_argv(tiny_preset, out, num_rollout=400, max_staleness=1, trainer_gpus=1, rollout_gpus=2,
                      extra=("--rollout-backend", "sglang", "--sglang-python", sglang_python, "--api-port", str(port),
                             "--save", str(out / "ckpt"), "--save-interval", "1"))
    out.mkdir(parents=True)
    log_path = tmp_path / "driver.log"

    def alive(predicate):
        def checked():
            if driver.poll() is not None:
                raise AssertionError(f"the driver exited ({driver.returncode}):\n{log_path.read_text()[-3000:]}")
            return predicate()
        return checked

    with log_path.open("w") as log, RefitWatcher(out / "engines") as watcher:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(alive(lambda: api.training_step() >= 2), 420, "training on 2 real engines")
            request = post(api, "/rollout/scale_out", {"num_replicas": 3})
            record = wait_until(alive(lambda: request_done(api, "scale_out", request["request_id"])), 360,
                                "scale-out")
            assert record["status"] == "ACTIVE", record
            (joined,) = record["engine_ids"]
            events = httpx.get(f"{api.url}/rollout/events", params={"limit": 500}, timeout=5, trust_env=False,
                               headers=api.headers()).json()["events"]
            (active,) = [e for e in events if e["kind"] == "engine_state" and e["message"].startswith("ACTIVE")
                         and joined in e["engine_ids"]]
            # it joined the router only once it held the newest published version
            assert active["details"]["weight_version"] == active["details"]["latest_published"]
            joined_at = active["details"]["weight_version"]
            step = api.training_step()
            wait_until(alive(lambda: api.training_step() >= step + 2), 240, "training on 3 engines")
            request = post(api, "/rollout/scale_in", {"num_replicas": 2})
            record = wait_until(alive(lambda: request_done(api, "scale_in", request["request_id"])), 180, "scale-in")
            assert record["status"] == "COMPLETED", record
            assert len(api.active()) == 2
        finally:
            driver.send_signal(signal.SIGTERM)
            try:
                driver.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()
    text = log_path.read_text()
    assert driver.returncode == 0, text[-3000:]
    stopped = [line for line in text.splitlines() if "server pid=" in line and "stopped in" in line]
    assert any(joined in line and "exit code 0" in line for line in stopped), stopped  # SGLang's own shutdown
    assert "killing" not in text
    # what the joining engine served, version by version, is the trainer's checkpoint of that version
    assert watcher.seen.get(joined), f"{joined} was never observed serving"
    for version, served in watcher.seen[joined].items():
        assert not checksum_mismatches(expected_checksums(tiny_preset.model_dir, out / "ckpt", version), served)
    # (before ACTIVE it may hold the base weights it started from: it is not routed then, only the watcher sees it)
    assert max(watcher.seen[joined]) >= joined_at, (joined_at, sorted(watcher.seen[joined]))
    assert not watcher.keys_in_argv
    left = set(os.listdir(SHM_DIR)) - shm_before
    assert not left, f"left in /dev/shm by the run's engines: {sorted(left)}"
