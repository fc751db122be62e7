"""An engine's server SIGKILLed mid-generation while the tiny run trains: no notice, nothing lost.

What a crash without notice (OOM killer, a GPU fault) does to a run: the engine's streams break; each of its
requests continues on the surviving engine from the last chunk the manager held (``relax.rollout.dispatcher``);
the dead initial engine is replaced in its own bundle. The rollout temperature is high so that the tiny model's
responses run to the length limit (it would otherwise answer in 4 tokens): long generations, as in the recipe.

Checked: the run ends normally; every step has exactly its batch of samples, each group its n samples, none
twice; every migrated token kept (none regenerated) and every sample's log-probs match its tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax.cluster.network import free_port
from relax.demo.elastic import RunApi, wait_until
from relax.demo.local import train_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_NEW_TOKENS = 96
BATCH, N = 4, 4


def relax_metrics(api: RunApi) -> dict[str, float]:
    text = httpx.get(f"{api.url}/metrics", timeout=5, trust_env=False).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("relax_")}


def server_pid(driver_pid: int, url: str) -> int:
    """The built-in engine server serving ``url``: a descendant of the driver whose argv names its port."""
    port = url.rsplit(":", 1)[1]
    for proc in psutil.Process(driver_pid).children(recursive=True):
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return proc.pid
    raise AssertionError(f"no engine server on port {port} under the driver")


def test_an_engine_killed_mid_generation_loses_no_sample_and_keeps_its_tokens(tiny_preset, tmp_path: Path) -> None:
    port = free_port()
    api = RunApi(f"http://127.0.0.1:{port}")
    out = tmp_path / "run"
    grpo = {"rollout_batch_size": BATCH, "n_samples_per_prompt": N, "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 25.0, "lr": 1e-4, "eps_clip": 0.2, "eps_clip_high": 0.28}
    argv = train_argv(tiny_preset, out, num_rollout=6, max_staleness=1, trainer_gpus=1, grpo=grpo,
                      extra=("--api-port", str(port), "--record-samples"))
    log_path = tmp_path / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: driver.poll() is None and api.training_step() >= 1, 420, "training to start")
        victim = next(e for e in api.active() if e["engine_id"] == "engine_1")
        pid = server_pid(driver.pid, victim["url"])
        before = relax_metrics(api)
        # mid-generation: requests on the victim (a step's 16 requests take ~1 s to generate on it)
        wait_until(lambda: next(e["in_flight"] for e in api.engines() if e["engine_id"] == "engine_1") >= 2, 120,
                   "requests in flight on engine_1")
        os.killpg(pid, signal.SIGKILL)
        after = wait_until(lambda: (m := relax_metrics(api))["relax_migrated_requests"]
                           > before["relax_migrated_requests"] and m, 120, "a request continued elsewhere")
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    text = log_path.read_text(errors="replace")
    assert driver.returncode == 0, text[-4000:]
    assert "engine_1 failed" in text

    kept = after["relax_migration_tokens_kept"] - before["relax_migration_tokens_kept"]
    assert kept > 0 and after["relax_migration_tokens_regenerated"] == before["relax_migration_tokens_regenerated"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    by_step: dict[int, list[dict]] = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s)
    assert sorted(by_step) == list(range(6))
    for step, rows in by_step.items():  # every sample exactly once: BATCH groups of N, no duplicate
        assert len(rows) == BATCH * N, step
        groups: dict[int, int] = {}
        for s in rows:
            groups[s["prompt_index"]] = groups.get(s["prompt_index"], 0) + 1
        assert sorted(groups.values()) == [N] * BATCH, (step, groups)
        for s in rows:  # stitched samples are whole: a log-prob per token, within the budget
            assert 0 < len(s["response_token_ids"]) <= MAX_NEW_TOKENS
            assert len(s["rollout_log_probs"]) == len(s["response_token_ids"])
    print(f"engine crash mid-generation: {after['relax_migrated_requests'] - before['relax_migrated_requests']:.0f} "
          f"request(s) continued elsewhere, {kept:.0f} token(s) kept, 0 regenerated")
