"""Engines with several GPUs (--rollout-num-gpus-per-engine 2): the server process sees all of them.

SGLang started with --tp-size N puts TP rank r on local GPU r: it must see N GPUs. Each engine gets one
bundle holding its N GPUs and its EngineActor takes all N, so Ray's CUDA_VISIBLE_DEVICES for the actor
(inherited by the server it starts) names N devices. Logical GPUs: the ids are Ray's, no hardware needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from relax.rollout.manager import spawn_rollout_manager
from relax.rollout.scaling import ScaleOutSpec
from relax.rollout.settings import (
    DataSettings,
    FleetSettings,
    RolloutSettings,
    SamplingSettings,
    ScalingSettings,
)

pytestmark = pytest.mark.timeout(300)


def visible_gpus(pid: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES as the engine's *server* process sees it (read from /proc, not from Ray)."""
    env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
               if "=" in item)
    return [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]


def test_two_gpu_engines_see_two_gpus_initial_and_elastic(ray_cluster, tiny_preset) -> None:
    initial = placement_group([{"GPU": 2, "CPU": 1}], strategy="PACK", name="test-2gpu-initial")
    ray.get(initial.ready(), timeout=60)
    manager = spawn_rollout_manager(RolloutSettings(
        data=DataSettings(prompt_data=str(tiny_preset.train_path), num_rollout=1, rollout_batch_size=2,
                          sampling=SamplingSettings(n_samples=2, max_new_tokens=4), max_staleness=0,
                          apply_chat_template=True, rm_type="tiny"),
        fleet=FleetSettings(model_path=str(tiny_preset.model_dir), gpus_per_engine=2),
        scaling=ScalingSettings(max_engines=2, scale_out_timeout_s=120),
    ))
    try:
        (first,) = ray.get(manager.start_initial_engines.remote([(initial, 0)]), timeout=180)
        record = ray.get(manager.scale_out.remote(ScaleOutSpec(num_replicas=2)), timeout=60)
        active = _wait_active(manager, 2)
        seen = {}
        for engine in active:
            pid = ray.get(manager.engine_process.remote(engine["engine_id"]))["pid"]
            seen[engine["engine_id"]] = visible_gpus(pid)
        assert all(len(ids) == 2 for ids in seen.values()), seen
        assert len({i for ids in seen.values() for i in ids}) == 4  # four distinct logical GPUs in all
        assert {e["kind"] for e in active} == {"initial", "elastic"}
        assert first["engine_id"] in seen and record["request_id"]
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.kill(manager)
        remove_placement_group(initial)


def _wait_active(manager, n: int) -> list[dict]:
    import time

    deadline = time.monotonic() + 180
    while True:
        active = [e for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"]
        if len(active) >= n:
            return active
        assert time.monotonic() < deadline, f"only {len(active)} engine(s) ACTIVE: {active}"
        time.sleep(0.2)
