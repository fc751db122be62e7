"""A lost EngineActor is a lost engine: its server goes, its requests are retried, it is replaced.

The fault as Ray makes it when a raylet dies or the OOM killer picks a worker: the EngineActor's worker
process is SIGKILLed (by pid: the server runs in its own session, so only its guard can take it down).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from relax.rollout.generator import SamplingSettings
from relax.rollout.manager import ManagerConfig, RolloutManager


@pytest.fixture(scope="module")
def manager(ray_cluster, tiny_preset):
    groups = [placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK") for _ in range(2)]
    ray.get([g.ready() for g in groups], timeout=60)
    config = ManagerConfig(
        model_path=str(tiny_preset.model_dir), prompt_data=str(tiny_preset.train_path), num_rollout=1,
        rollout_batch_size=4, sampling=SamplingSettings(n_samples=4, max_new_tokens=8), rm_type="tiny",
        apply_chat_template=True,
    )
    handle = ray.remote(RolloutManager).options(max_concurrency=1000, num_cpus=0).remote(config)
    try:
        ray.get(handle.start_initial_engines.remote([(g, 0) for g in groups]), timeout=180)
        yield handle
    finally:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle)
        for g in groups:
            remove_placement_group(g)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_engine_actor_killed_under_load_is_replaced_and_no_request_is_lost(manager) -> None:
    engines = [e for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"]
    assert len(engines) == 2
    victim = engines[0]["engine_id"]
    info = ray.get(manager.engine_process.remote(victim))
    params = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}
    refs = [manager.generate.remote(f"loss-{i}", [1, 2, 3], params) for i in range(16)]
    deadline = time.monotonic() + 60
    while not all(e["in_flight"] > 0 for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"):
        assert time.monotonic() < deadline, "the requests never reached both engines"
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(info["actor_pid"], signal.SIGKILL)

    deadline = killed_at + 15
    while not (_gone(info["pid"])):  # the guard saw its owner go and stopped the server's process group
        assert time.monotonic() < deadline, f"the server (pid {info['pid']}) outlived its actor"
        time.sleep(0.1)
    server_gone_s = time.monotonic() - killed_at

    outs = ray.get(refs, timeout=180)
    assert len(outs) == 16
    assert all(o.output["meta_info"]["completion_tokens"] == 64 for o in outs)  # every one answered in full, once

    def states() -> dict[str, str]:
        return {e["engine_id"]: e["status"] for e in ray.get(manager.engines.remote())}

    detected = replaced = None
    deadline = killed_at + 120
    while replaced is None:
        assert time.monotonic() < deadline, f"not replaced within 120s: {states()}"
        now = states()
        if detected is None and now.get(victim) == "FAILED":
            detected = time.monotonic() - killed_at
        if sum(1 for s in now.values() if s == "ACTIVE") == 2 and now.get(victim) == "FAILED":
            replaced = time.monotonic() - killed_at
        time.sleep(0.2)
    events = ray.get(manager.recent_events.remote(50))
    assert any(e["kind"] == "engine_failed" and victim in e["engine_ids"] for e in events)
    assert any(e["kind"] == "engine_restarted" and victim in e["engine_ids"] for e in events)
    print(f"EngineActor SIGKILLed: server gone {server_gone_s:.1f}s, engine FAILED {detected or 0:.1f}s, "
          f"replacement ACTIVE {replaced:.1f}s")
