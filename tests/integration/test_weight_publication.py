"""Weights are right: after publication v every ACTIVE engine serves v, and its log-probs equal the trainer's.

Real Ray: a RolloutManager with two built-in engines in their own placement groups, a one-rank trainer
group, one rollout step, one training step; each publication goes both ways a run can send it: broadcast
from the trainer's rank 0 (SGLang's distributed update over gloo) and through the object store.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from relax.rollout.manager import spawn_rollout_manager
from relax.rollout.settings import DataSettings, FleetSettings, RolloutSettings, SamplingSettings
from relax.training.actor import TrainerConfig
from relax.training.group import TrainerGroup
from relax.training.publisher import publish as publish_version


def publish(manager, trainer, version: int, path: str) -> None:
    """Publish the trainer's weights as ``version`` the way a run with ``--weight-sync path`` does, and wait for
    the manager to register them."""
    ray.get(publish_version(trainer, manager, version, path).registered)


@pytest.fixture(scope="module")
def stack(ray_cluster, tiny_preset):
    bundle = {"GPU": 1, "CPU": 1}
    groups = [placement_group([bundle], strategy="PACK") for _ in range(3)]
    ray.get([g.ready() for g in groups], timeout=60)
    manager = spawn_rollout_manager(RolloutSettings(
        data=DataSettings(prompt_data=str(tiny_preset.train_path), num_rollout=1, rollout_batch_size=4,
                          sampling=SamplingSettings(n_samples=4, max_new_tokens=8), max_staleness=0,
                          apply_chat_template=True, rm_type="tiny"),
        fleet=FleetSettings(model_path=str(tiny_preset.model_dir)),
    ))
    trainer = None
    try:
        ray.get(manager.start_initial_engines.remote([(groups[1], 0), (groups[2], 0)]), timeout=180)
        trainer = TrainerGroup(TrainerConfig(hf_checkpoint=str(tiny_preset.model_dir), lr=5e-3), groups[0])
        yield manager, trainer
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)
        ray.kill(manager)
        if trainer is not None:
            trainer.shutdown()
        for g in groups:
            remove_placement_group(g)


def _generate(url: str, prompt_ids: list[int]) -> dict:
    r = httpx.post(f"{url}/generate", json={"input_ids": prompt_ids, "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}},
                   timeout=60, trust_env=False)
    r.raise_for_status()
    return r.json()


def test_published_version_is_served_by_every_engine_with_the_trainers_log_probs(stack) -> None:
    """Both paths on the same engines: v1 through the object store, v2 (after a second step) by broadcast."""
    manager, trainer = stack
    ray.get(manager.start_generation.remote(0, None))
    step = ray.get(manager.take_step.remote(0, trainer.batch_plan(), 120), timeout=150)  # as the driver takes it
    samples = [s for shard in ray.get(step["shards"]) for s in shard]
    assert {s["weight_version"] for s in samples} == {0}
    prompt_ids = samples[0]["prompt_token_ids"]
    for version, path in ((1, "object-store"), (2, "broadcast")):
        metrics = trainer.train_step(samples)
        assert metrics["num_samples"] == 16
        publish(manager, trainer, version, path)
        assert ray.get(manager.wait_weights.remote(version, 60), timeout=90)

        engines = ray.get(manager.engines.remote())
        active = [e for e in engines if e["status"] == "ACTIVE"]
        assert len(active) == 2 and all(e["weight_version"] == version for e in active)
        syncs = ray.get(manager.status.remote())["weight_syncs"]
        assert {t["path"] for t in syncs.values()} == {path}
        for engine in active:
            info = httpx.get(f"{engine['url']}/model_info", timeout=10, trust_env=False).json()
            assert info["weight_version"] == str(version)
            out = _generate(engine["url"], prompt_ids)
            assert out["meta_info"]["weight_version"] == str(version)
            engine_lps = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
            sample = {"prompt_token_ids": prompt_ids, "response_token_ids": out["output_ids"], "group_id": "probe",
                      "sample_index": 0}
            trainer_lps = trainer.compute_log_probs([sample])[0]
            assert max(abs(a - b) for a, b in zip(engine_lps, trainer_lps, strict=True)) < 1e-4, path


def _running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sglang:num_running_reqs")


def test_the_run_listens_on_loopback_only(stack) -> None:
    """After a broadcast publication (the trainer's process group and one weight group per engine are open): no
    process of the run — Ray's, the trainer's, the manager's, the engines' — listens outside loopback."""
    import ipaddress

    import psutil

    def loopback(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    manager, trainer = stack
    assert trainer.sender is not None  # rank 0 holds open weight groups from the broadcast above
    outside = []
    for proc in psutil.Process().children(recursive=True):
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and not loopback(conn.laddr.ip):
                    outside.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]} on {conn.laddr.ip}:{conn.laddr.port}")
        except psutil.NoSuchProcess:
            continue
    assert not outside, "\n".join(outside)


def test_publication_under_load_pauses_only_for_the_load_and_loses_nothing(stack) -> None:
    """Pause -> load -> continue under continuous generation: every request answered once and in full, no
    engine FAILED, the pause lasts about the load, and a request that crossed the load counts as its
    oldest version (SGLang reports the newest plus spans)."""
    from relax.rollout.dispatch.generator import sample_version

    manager, trainer = stack
    path = "broadcast"
    active = [e for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"]
    version = max(e["weight_version"] for e in active)
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    refs = [manager.generate.remote(f"load-{i}", [1, 2, 3], params) for i in range(16)]
    # freeze every engine with requests running, so the publication lands mid-request by construction; how many
    # of the 16 are running then depends on the machine's speed, and the spans below are checked against it
    deadline = time.monotonic() + 60
    while not all(_running(e["url"]) > 0 for e in active):
        assert time.monotonic() < deadline, "the requests never reached both engines"
        time.sleep(0.01)
    for e in active:
        httpx.post(f"{e['url']}/pause_generation", json={"mode": "in_place"}, timeout=10, trust_env=False)
    crossing = sum(_running(e["url"]) for e in active)  # frozen mid-request: these must cross the load
    assert crossing >= 1

    new = version + 1
    publish(manager, trainer, new, path)
    assert ray.get(manager.wait_weights.remote(new, 60), timeout=90)  # the sync's own continue lifts the freeze
    outs = ray.get(refs, timeout=120)

    assert len(outs) == 16 and all(o.output["meta_info"]["completion_tokens"] == 200 for o in outs)
    assert all(o.output["meta_info"]["finish_reason"]["type"] == "length" for o in outs)  # none aborted, none retried
    spans = [[sp["version"] for sp in o.output["meta_info"]["weight_versions"]] for o in outs]
    # finished before the freeze, crossed the load (in order), or started after it: nothing else
    assert all(s in ([str(version)], [str(version), str(new)], [str(new)]) for s in spans), spans
    assert sum(s == [str(version), str(new)] for s in spans) == crossing
    for o, s in zip(outs, spans, strict=True):
        assert o.output["meta_info"]["weight_version"] == s[-1]  # SGLang's field: the newest
        assert sample_version(o.output["meta_info"], o.dispatch_version)[0] == int(s[0])  # ours: the oldest
    status = ray.get(manager.status.remote())
    assert {e["status"] for e in ray.get(manager.engines.remote())} == {"ACTIVE"}
    syncs = status["weight_syncs"]
    assert {eid for eid, t in syncs.items() if t["version"] == new} == {e["engine_id"] for e in active}
    for timings in syncs.values():
        # the pause holds the whole load and is only part of the sync (the version's pin on the sender is taken
        # before it); how much longer than the load it lasts (pause, retract + re-encode, continue) is the
        # machine's speed, printed below, not asserted (a 1 s margin failed on a loaded CI machine: 1.22 s)
        assert 0 < timings["load_s"] <= timings["paused_s"] < timings["total_s"]
        assert timings["path"] == path
    print(f"publication under load ({path}): paused", {eid: round(t["paused_s"], 3) for eid, t in syncs.items()},
          "load", {eid: round(t["load_s"], 3) for eid, t in syncs.items()})


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_requests_survive_an_engine_dying(stack) -> None:
    """A request whose engine dies is retried on another engine: nothing is lost, the dead one is FAILED.

    The EngineActor's Ray worker is SIGKILLed by pid (as a raylet dying or the OOM killer does it): its
    server must go with it (a dead server alone is tests/integration/test_fleet.py's case).
    """
    manager, _ = stack
    engines = [e for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"]
    victim = engines[0]["engine_id"]
    info = ray.get(manager.engine_process.remote(victim))
    params = {"max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True}
    refs = [manager.generate.remote(f"g{i}", [1, 2, 3], params) for i in range(8)]
    deadline = time.monotonic() + 60
    while not all(e["in_flight"] > 0 for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"):
        assert time.monotonic() < deadline, "the requests never reached both engines"
        time.sleep(0.02)
    killed_at = time.monotonic()
    os.kill(info["actor_pid"], signal.SIGKILL)
    while not _gone(info["pid"]):  # a dead actor's server goes with it (relax.engines.guard)
        assert time.monotonic() - killed_at < 15, f"the server (pid {info['pid']}) outlived its actor"
        time.sleep(0.05)
    server_gone_s = time.monotonic() - killed_at
    outs = ray.get(refs, timeout=120)
    assert len(outs) == 8 and all(o.output["meta_info"]["completion_tokens"] == 32 for o in outs)
    while (state := {e["engine_id"]: e["status"] for e in ray.get(manager.engines.remote())}[victim]) == "ACTIVE":
        assert time.monotonic() - killed_at < 30, "the dead engine was never taken out"
        time.sleep(0.1)
    failed_s = time.monotonic() - killed_at
    assert state == "FAILED"
    events = ray.get(manager.recent_events.remote(20))
    assert any(e["kind"] == "engine_failed" and victim in e["engine_ids"] for e in events)

    # an initial engine that dies is restarted in its own bundle, with the current weights
    def restarted() -> list:
        return [e for e in ray.get(manager.engines.remote()) if e["status"] == "ACTIVE"]

    deadline = time.monotonic() + 120
    while len(restarted()) < 2:
        assert time.monotonic() < deadline, "the failed initial engine was not replaced"
        time.sleep(0.2)
    print("EngineActor worker SIGKILLed: server gone "
          f"{server_gone_s:.1f}s, FAILED {failed_s:.1f}s, replacement ACTIVE {time.monotonic() - killed_at:.1f}s")
    replacement = next(e for e in restarted() if e["engine_id"] not in {x["engine_id"] for x in engines})
    latest = ray.get(manager.status.remote())["latest_published"]
    assert replacement["kind"] == "initial" and replacement["weight_version"] == latest >= 1
    info = httpx.get(f"{replacement['url']}/server_info", timeout=10, trust_env=False).json()
    assert info["weight_version"] == str(latest) and info["weight_loads"] == 0
    # a broadcast version has no object-store copy: it received the latest by broadcast before it was ACTIVE
    assert info["distributed_buckets_loaded"] > 0 and len(info["weight_update_groups"]) == 1
    events = ray.get(manager.recent_events.remote(50))
    assert any(e["kind"] == "engine_restarted" and victim in e["engine_ids"] for e in events)
