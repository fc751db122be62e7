"""A real SGLang server SIGKILLed in the middle of long generations while the tiny run trains: its streamed
prefixes (SGLang's own server-sent events) continue on the other real engine, and nothing is lost.

The built-in engine's version of this test is in tests/e2e/test_elastic_training.py; what differs here is SGLang:
its gauges refresh every ``--decode-log-interval`` decode steps (40 by default), so the run passes
``--sglang-decode-log-interval 1`` for the test to see the victim part-way through its requests; and pausing it
takes its admin key, which the test reads from the engine's private keys file, as the run's user may.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from relax.cluster.network import free_port
from relax.demo.elastic import RunApi, wait_until
from relax.demo.local import train_argv
from tests.e2e.engine_crash import BATCH, MAX_NEW_TOKENS, N, assert_crash_lost_nothing, batch

pytestmark = pytest.mark.timeout(900)

STEPS = 8
GENERATION_KEY = "crash-sglang-generation-key"


def sglang_server_pid(driver_pid: int, port: str) -> int:
    """The SGLang server (not its guard) serving ``port``: a descendant of the driver."""
    for proc in psutil.Process(driver_pid).children(recursive=True):
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if argv[1:3] == ["-m", "sglang.launch_server"] and argv[argv.index("--port") + 1] == port:
            return proc.pid
    raise AssertionError(f"no SGLang server on port {port} under the driver")


def test_a_real_engine_killed_mid_generation_loses_no_sample_and_keeps_its_streamed_tokens(
        tiny_preset, sglang_python: str, tmp_path: Path) -> None:
    port = free_port()
    api = RunApi(f"http://127.0.0.1:{port}")
    out = tmp_path / "run"
    grpo = {"rollout_batch_size": BATCH, "n_samples_per_prompt": N, "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 25.0, "lr": 1e-4, "eps_clip": 0.2, "eps_clip_high": 0.28}
    argv = train_argv(tiny_preset, out, num_rollout=STEPS, max_staleness=1, trainer_gpus=1, grpo=grpo,
                      extra=("--api-port", str(port), "--record-samples", "--rollout-backend", "sglang",
                             "--sglang-python", sglang_python, "--sglang-decode-log-interval", "1"))
    log_path = tmp_path / "driver.log"
    env = {**os.environ, "RELAX_ENGINE_API_KEY": GENERATION_KEY}
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_until(lambda: driver.poll() is None and api.training_step() >= 1, 420, "training to start")
        victim = next(e for e in api.active() if e["engine_id"] == "engine_1")
        victim_port = victim["url"].rsplit(":", 1)[1]
        pid = sglang_server_pid(driver.pid, victim_port)
        keys = yaml.safe_load((out / "engines" / f"engine_1-{victim_port}.log.keys.yaml").read_text())
        engine = httpx.Client(base_url=victim["url"], timeout=10, trust_env=False)
        admin = {"Authorization": f"Bearer {keys['admin-api-key']}"}

        def frozen_mid_generation() -> bool:
            wait_until(lambda: (load := batch(engine))[0] >= 2 and load[1] >= 64 * load[0], 120,
                       "engine_1 part-way through requests", poll_s=0.002)
            assert engine.post("/pause_generation", json={"mode": "in_place"}, headers=admin).status_code == 200
            if batch(engine)[0] >= 1:
                return True
            engine.post("/continue_generation", json={}, headers=admin)  # they finished meanwhile
            return False

        wait_until(frozen_mid_generation, 240, "engine_1 frozen with requests running", poll_s=0.0)
        engine.close()
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # the server's whole process group: no notice at all
        driver.wait(timeout=400)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    text = log_path.read_text(errors="replace")
    assert driver.returncode == 0, text[-4000:]
    assert "engine_1 failed" in text
    continued = assert_crash_lost_nothing(text, out, steps=STEPS)
    print(f"real SGLang crash mid-generation: {continued} request(s) continued elsewhere, 0 regenerated")
