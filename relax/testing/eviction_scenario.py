"""A preemption notice on a local elastic cluster, with generations in flight: what is kept, what is lost.

Used by ``tests/e2e/test_preemption.py`` and ``benchmarks/eviction.py``. Real parts: a local elastic cluster
(``relax.cluster.local_elastic``: a Ray head plus fake nodes its autoscaler adds), a ``RolloutManager`` with
one initial engine on the head and one elastic engine on an autoscaled node, built-in engines on the tiny
preset, and the notice sent through Ray's GCS drain API with reason PREEMPTION and a deadline, exactly as a
provider's hook would (``relax.cluster.drain.drain_node``).

Generation on the tiny model is far too fast to still be running when a notice lands, so the elastic engine
is frozen (``/pause_generation`` in place) once it has produced part of its requests: it stands in for an
engine in the middle of long responses. Modes:

* ``migrate``: budget = deadline − margin; what is unfinished then is aborted and continued elsewhere;
* ``retry``: the same budget, then the unfinished requests start again from their prompts;
* ``abort``: a deadline already past: everything on the engine is aborted at once and started again
  (what a framework without drain handling does);
* ``sigterm``: as ``migrate``, but the engine's node is a ``ray start --block`` worker
  (``relax.cluster.worker_node``) and the notice is a SIGTERM to that process: Ray marks its own node
  DRAINING with ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` = the deadline, as on a pod deletion;
* ``crash``: no notice at all: once the engine is half-way through its (long) responses, its server's process
  group is SIGKILLed, as the OOM killer or a GPU fault ends it. What survives is what the manager held of each
  stream (``rollout.dispatch.dispatcher``); ``tokens_kept_fraction`` is then the share of the tokens the engine had
  generated before the kill that the samples kept.

Run ``python -m relax.testing.eviction_scenario --modes migrate --json`` (one JSON line per mode, last).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

N_REQUESTS = 8
MAX_NEW_TOKENS = 200


def _wait(predicate: Any, timeout: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f}s")
        time.sleep(poll_s)


MODES = ("migrate", "retry", "abort", "sigterm", "crash")
#: crash: the engine is killed once its requests have generated this many tokens each on average (of 200)
CRASH_AFTER_TOKENS = 100


class Pool:
    """A rollout manager with one initial engine on the head, shared by the modes that use the same handling
    of unfinished requests (migrate, or retry from the prompt): each mode adds its own elastic engine and
    evicts it, so only the first pays for the initial engine."""

    def __init__(self, preset: Any, migrate: bool) -> None:
        import ray
        from ray.util.placement_group import placement_group

        from relax.rollout.manager import spawn_rollout_manager
        from relax.rollout.settings import (
            DataSettings,
            DispatchSettings,
            FleetSettings,
            RolloutSettings,
            SamplingSettings,
            ScalingSettings,
        )

        self.migrate = migrate
        self.baseline = placement_group([{"GPU": 1, "CPU": 1, "stable_gpu": 1, "stable_cpu": 1}], strategy="PACK")
        ray.get(self.baseline.ready(), timeout=60)
        self.manager = spawn_rollout_manager(RolloutSettings(
            data=DataSettings(prompt_data=str(preset.train_path), num_rollout=1, rollout_batch_size=1,
                              sampling=SamplingSettings(n_samples=1, max_new_tokens=8), apply_chat_template=True,
                              rm_type="tiny"),
            fleet=FleetSettings(model_path=str(preset.model_dir), drain_timeout_s=30, shutdown_timeout_s=5),
            dispatch=DispatchSettings(migrate=migrate),
            scaling=ScalingSettings(max_engines=2, scale_out_timeout_s=120),
        ), resources={"stable_cpu": 0.01})
        began = time.monotonic()
        ray.get(self.manager.start_initial_engines.remote([(self.baseline, 0)]), timeout=180)
        self.startup_s = time.monotonic() - began

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        ray.get(self.manager.shutdown.remote(), timeout=120)
        ray.kill(self.manager)
        remove_placement_group(self.baseline)


def migrates(mode: str) -> bool:
    return mode in ("migrate", "sigterm", "crash")


def run_mode(mode: str, cluster: Any, pool: Pool, deadline_s: float, workdir: Path) -> dict[str, Any]:
    import httpx
    import ray

    from relax.cluster.drain import drain_node, node_departure
    from relax.rollout.scaling import ScaleOutSpec

    phases: dict[str, float] = {}
    manager = pool.manager
    worker = None
    if mode == "sigterm":  # the elastic engine's node: the only free GPU, so its group lands there at once
        from relax.cluster.worker_node import WorkerNode, WorkerNodeConfig

        worker = WorkerNode(cluster.address, workdir / f"worker-node-{mode}.log", WorkerNodeConfig(
            num_cpus=2, num_gpus=1, drain_timeout_s=deadline_s, env=cluster.info.env()))
        worker.start(timeout=90)
    try:
        began = time.monotonic()
        request = ray.get(manager.scale_out.remote(ScaleOutSpec(num_replicas=2)), timeout=60)

        def elastic() -> dict[str, Any] | None:
            return next((e for e in ray.get(manager.engines.remote())
                         if e["kind"] == "elastic" and e["status"] == "ACTIVE"), None)

        victim = _wait(elastic, 180, f"the elastic engine of {request['request_id']}", poll_s=0.5)
        url = victim["url"]
        phases["elastic_engine_up_s"] = time.monotonic() - began

        def generated() -> int:
            return int(httpx.get(f"{url}/server_info", timeout=10, trust_env=False).json()["stats"]["generated_tokens"])

        def pause() -> None:
            httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=10, trust_env=False)

        params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
        base = generated()
        if mode == "crash":  # frozen from the start, then let go in short steps until half-way through
            pause()
        refs = [manager.generate.remote(f"evict-{mode}-{i}", [1, 2, 3, 4], params) for i in range(N_REQUESTS)]
        if mode == "crash":
            def on_victim() -> int:
                engines = ray.get(manager.engines.remote())
                placed = sum(e["in_flight"] for e in engines) == N_REQUESTS
                return next(e["in_flight"] for e in engines if e["engine_id"] == victim["engine_id"]) if placed else 0

            target = CRASH_AFTER_TOKENS * _wait(on_victim, 60, "the requests to be placed")
            while generated() - base < target:  # the tiny model generates ~100 tokens/request in a blink
                httpx.post(f"{url}/continue_generation", timeout=10, trust_env=False)
                pause()
        else:
            _wait(lambda: generated() - base >= 40, 60, "the elastic engine to start generating", poll_s=0.01)
            pause()
        before_notice = generated() - base
        before = ray.get(manager.status.remote())["migration"]
        notice_at = time.monotonic()
        if mode == "crash":
            server = ray.get(manager.engine_process.remote(victim["engine_id"]))
            os.killpg(server["pid"], signal.SIGKILL)  # no notice: the server and its whole process group
        elif worker is not None:
            if victim["node_id"] != worker.node_id:
                raise RuntimeError(f"the elastic engine landed on {victim['node_id']}, not the worker node")
            worker.terminate()  # Ray's own marking: DRAINING, deadline now + RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
        else:
            accepted, why = drain_node(victim["node_id"], -1.0 if mode == "abort" else deadline_s,
                                       message=f"relax eviction scenario ({mode})")
            if not accepted:
                raise RuntimeError(f"the drain request was refused: {why}")
        lost = 0
        outs = []
        for ref in refs:
            try:
                outs.append(ray.get(ref, timeout=300))
            except Exception:  # noqa: BLE001 - a lost sample is what is measured
                lost += 1
        affected_done_s = time.monotonic() - notice_at
        _wait(lambda: victim["engine_id"] not in {e["engine_id"] for e in ray.get(manager.engines.remote())
                                                  if e["status"] in ("ACTIVE", "DRAINING")}, 60, "the engine to go")
        status = ray.get(manager.status.remote())
        eviction = status["evictions"].get(victim["engine_id"], {})
        after = status["migration"]
        if mode == "crash":  # the node stays: only the engine died; the fleet released its placement group
            node_gone = None
        elif worker is not None:  # `ray start --block` exits once its node is idle (or at the deadline)
            node_gone = _wait(lambda: worker.wait(0.5) is not None, 120, "the worker node's `ray start` to exit")
        else:
            node_gone = _wait(lambda: not cluster.status().elastic_nodes, 120, "the drained node to leave",
                              poll_s=0.5)
        node_gone_s = time.monotonic() - notice_at
        # how the node left, as the GCS recorded it (a preempted node: AUTOSCALER_DRAIN_PREEMPTED)
        left_as = (None if mode == "crash" else
                   _wait(lambda: node_departure(victim["node_id"]), 30, "the GCS to record the node's departure"))
        groups = [g for g in ray.util.placement_group_table().values()
                  if g.get("name") == f"relax-{victim['engine_id']}"]
        kept = after["tokens_kept"] - before["tokens_kept"]
        regenerated = after["tokens_regenerated"] - before["tokens_regenerated"]
        complete = sum(1 for o in outs if o.output["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS)
        phases["notice_to_node_recorded_gone_s"] = time.monotonic() - notice_at
        return {
            "mode": mode, "phases": phases, "requests": N_REQUESTS, "lost_samples": lost, "complete_samples": complete,
            "tokens_before_notice_on_engine": before_notice, "tokens_kept": kept, "tokens_regenerated": regenerated,
            # crash: of what the engine generated before the kill (the tail after the last streamed chunk is lost
            # without being counted as regenerated); the other modes: of what the abort handed back
            "tokens_kept_fraction": (kept / before_notice if before_notice else None) if mode == "crash" else
            (kept / (kept + regenerated) if kept + regenerated else None),
            "migrated_requests": after["migrated_requests"] - before["migrated_requests"],
            "notice_to_engine_gone_s": eviction.get("notice_to_gone_s"),
            "gone_before_deadline": eviction.get("gone_before_deadline"), "budget_s": eviction.get("budget_s"),
            "deadline_s": None if mode == "abort" else deadline_s,
            "affected_samples_done_s": affected_done_s, "node_gone_s": node_gone_s if node_gone else None,
            "node_left_as": left_as, "placement_group_states": sorted(g["state"] for g in groups),
            "events": [e["message"] for e in ray.get(manager.recent_events.remote(30))
                       if victim["engine_id"] in e["engine_ids"] and e["kind"] in ("engine_evicted", "engine_state")],
        }
    finally:
        if worker is not None:
            worker.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="migrate,retry,abort", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--deadline", type=float, default=20.0, help="seconds from the notice to the node's deadline")
    parser.add_argument("--preset", help="a tiny preset directory (default: build one)")
    parser.add_argument("--json", action="store_true", help="print each mode's result as one JSON line")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    from relax.cluster import ray_auth

    # The sigterm mode adds a real `ray start --address` node, which a loopback-only head cannot take in Ray
    # 2.60 (relax.cluster.ray_auth): that cluster binds the routable address, token auth still on.
    loopback = "sigterm" not in modes
    if not loopback:
        os.environ.pop(ray_auth.LOOPBACK_ENV, None)  # before Ray is imported: it reads the switch then
    import ray

    from relax.cluster.local_elastic import ElasticCluster, ElasticClusterConfig
    from relax.presets.tiny import build_tiny_preset

    results = []
    with tempfile.TemporaryDirectory(prefix="relax-evict-") as tmp:
        preset = build_tiny_preset(Path(args.preset or tmp) / "tiny") if not args.preset else _load(args.preset)
        # A slot per mode that evicts from an added node: a preempted node leaves by itself, but the autoscaler
        # counts it until its own idle check, and the next mode's node should not wait for that.
        added_nodes = max(1, sum(m != "sigterm" for m in modes))
        cluster = ElasticCluster(ElasticClusterConfig(head_gpus=1, max_elastic=added_nodes, idle_timeout_minutes=0.5,
                                                      loopback=loopback,
                                                      include_dashboard=False,
                                                      env={"OMP_NUM_THREADS": "1"}))
        info = cluster.start(timeout=120)
        try:
            ray.init(address=info.address, log_to_driver=False, logging_level="ERROR",
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            pool: Pool | None = None  # one at a time: the modes are sorted so each handling's pool is built once
            try:
                for mode in sorted(modes, key=lambda m: not migrates(m)):
                    started = time.monotonic()
                    if pool is not None and pool.migrate != migrates(mode):
                        pool.close()
                        pool = None  # closed: the finally below must not close it again if the next fails
                    fresh = pool is None
                    if fresh:
                        pool = Pool(preset, migrates(mode))
                    result = run_mode(mode, cluster, pool, args.deadline, Path(tmp))
                    # the first mode on a pool paid for its initial engine; the others found it up
                    result["phases"]["initial_engine_up_s"] = pool.startup_s if fresh else 0.0
                    result["phases"]["mode_s"] = time.monotonic() - started
                    results.append(result)
                    print(json.dumps(result) if args.json else f"{mode}: {result}", flush=True)
            finally:
                if pool is not None:
                    pool.close()
        finally:
            ray.shutdown()
            cluster.stop(timeout=30)
    return 0 if all(r["lost_samples"] == 0 for r in results) else 1


def _load(path: str) -> Any:
    from relax.presets.tiny import TinyPreset

    p = Path(path)
    return TinyPreset(root=p, model_dir=p / "model", train_path=p / "data" / "train.jsonl",
                      eval_path=p / "data" / "eval.jsonl")


if __name__ == "__main__":
    sys.exit(main())
