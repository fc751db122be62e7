"""An engine's server SIGKILLed mid-generation while the tiny run trains: no notice, nothing lost.

What a crash without notice (OOM killer, a GPU fault) does to a run: the engine's streams break; each of its
requests continues on the surviving engine from the last chunk the manager held (``relax.rollout.dispatch.dispatcher``);
the dead initial engine is replaced in its own bundle. The rollout temperature is high so that the tiny model's
responses run to the length limit (it would otherwise answer in 4 tokens): long generations, as in the recipe.

Checked: the run ends normally; every step has exactly its batch of samples, each group its n samples, none
twice; every migrated token kept (none regenerated) and every sample's version spans cover its tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax.cluster.network import free_port
from relax.demo.elastic import RunApi, wait_until
from relax.demo.local import train_argv
from relax.testing.engine_processes import engine_server_pid

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_NEW_TOKENS = 96
BATCH, N = 4, 4
ENGINE_KEY = "crash-e2e-engine-key"


def batch(engine: httpx.Client) -> tuple[int, int]:
    """(requests running, tokens they hold: prompts + outputs), from the engine's open ``/metrics``."""
    text = engine.get("/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return int(values["sglang:num_running_reqs"]), int(values["sglang:num_used_tokens"])


def server_pid(driver_pid: int, url: str) -> int:
    """The built-in engine server serving ``url``: a descendant of the driver whose argv names its port."""
    pid = engine_server_pid(driver_pid, url)
    assert pid is not None, f"no engine server for {url} under the driver"
    return pid


def assert_crash_lost_nothing(text: str, run_dir: Path, *, steps: int) -> int:
    """After an engine died mid-generation: its requests continued from their prefixes (no token regenerated),
    every step has its BATCH groups of N samples exactly once, and stitched samples' version spans cover every
    token in order. Returns how many requests continued on another engine.

    The continuations are read from the run's own summary (the manager's migration counters, per step in
    metrics.jsonl): durable files, unlike an actor's log lines that Ray may not have forwarded when the run ends
    seconds after the crash."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["migrated_requests"] >= 1 and summary["migration_tokens_kept"] >= 1, (summary, text[-3000:])
    assert summary["migration_tokens_regenerated"] == 0, summary  # every streamed token kept
    samples_path = run_dir / "samples.jsonl"
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    by_step: dict[int, list[dict]] = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s)
    assert sorted(by_step) == list(range(steps))
    for step, rows in by_step.items():  # every sample exactly once: BATCH groups of N, no duplicate
        assert len(rows) == BATCH * N, step
        groups: dict[int, set[int]] = {}
        for s in rows:
            groups.setdefault(s["prompt_index"], set()).add(s["sample_index"])
        assert sorted(map(sorted, groups.values())) == [list(range(N))] * BATCH, (step, groups)
        for s in rows:  # stitched samples are whole: their version spans cover every token, in order
            ids = s["response_token_ids"]
            assert 0 < len(ids) <= MAX_NEW_TOKENS
            spans = s["weight_version_spans"]
            assert spans[0][1] == 0 and spans[-1][2] == len(ids)
            assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
    return int(summary["migrated_requests"])


def test_an_engine_killed_mid_generation_loses_no_sample_and_keeps_its_tokens(tiny_preset, tmp_path: Path) -> None:
    port = free_port()
    api = RunApi(f"http://127.0.0.1:{port}")
    out = tmp_path / "run"
    grpo = {"rollout_batch_size": BATCH, "n_samples_per_prompt": N, "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 25.0, "lr": 1e-4, "eps_clip": 0.2, "eps_clip_high": 0.28}
    argv = train_argv(tiny_preset, out, num_rollout=12, max_staleness=1, trainer_gpus=1, grpo=grpo,
                      extra=("--api-port", str(port), "--record-samples"))
    log_path = tmp_path / "driver.log"
    env = {**os.environ, "RELAX_ENGINE_API_KEY": ENGINE_KEY}  # the engines' generation key: the test reads one
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_until(lambda: driver.poll() is None and api.training_step() >= 1, 420, "training to start")
        victim = next(e for e in api.active() if e["engine_id"] == "engine_1")
        pid = server_pid(driver.pid, victim["url"])
        # mid-generation: a step's requests take a fraction of a second on the tiny model, so the victim's load
        # is watched closely (its /metrics, with the engines' generation key); once at least 2 requests run
        # holding 64 tokens each on average (past their first chunks of 8, about 32 tokens still to go: several
        # engine steps), the server is SIGKILLed at once. The summary's migration counters then prove requests
        # were cut mid-way (the run's /pause_generation needs the admin key, which only the run holds, so the
        # test does not freeze it first).
        engine = httpx.Client(base_url=victim["url"], headers={"Authorization": f"Bearer {ENGINE_KEY}"},
                              timeout=10, trust_env=False)
        try:
            wait_until(lambda: (load := batch(engine))[0] >= 2 and load[1] >= 64 * load[0], 240,
                       "engine_1 part-way through requests", poll_s=0.002)
        finally:
            engine.close()
        os.killpg(pid, signal.SIGKILL)
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    text = log_path.read_text(errors="replace")
    assert driver.returncode == 0, text[-4000:]
    assert "engine_1 failed (server process was killed by SIGKILL" in text  # the signal, not a connection error
    continued = assert_crash_lost_nothing(text, out, steps=12)
    print(f"engine crash mid-generation: {continued} request(s) continued elsewhere, 0 tokens regenerated")
