"""A joining engine's decision → ACTIVE, phase by phase, with and without the checkpoint read (--joiner-weights).

One run, on real built-in engine processes and the real broadcast from a real ``WeightSender`` (no Ray: the
launcher port starts local processes, so the phases are the engine's own and Relax's, not Ray's scheduling):

1. one initial engine comes up and the trainer's side publishes weight version 1 by broadcast (the model's own
   weights, perturbed), as a run does after its first step;
2. then, alternating ``--reps`` times, an elastic engine joins (a) with ``dummy`` weights (``--load-format
   dummy``: no weight file read; its first refit verified) and (b) from the ``checkpoint``; each joiner is
   retired before the next;
3. beside each, the floor: the same server started bare (spawn → ``/health`` answers), its own start with no
   Relax around it.

Reported per join: decision → ACTIVE and every phase (``rollout.fleet.bringup``); per mode, Relax's share (every phase
of the join but its server's own start: capacity, actor, first answer, weight sync, verify) beside the bare start
of the same kind (dummy or checkpoint). Medians per mode, and the ratio dummy / checkpoint.
A warm page cache makes the checkpoint read nearly free here; ``--cold`` evicts the weight files from the page
cache (``posix_fadvise(DONTNEED)``) before every start, so a checkpoint start reads them from disk as a fresh node
does. On a GPU node the read is the checkpoint's bytes from (often network) storage: the report gives the bytes.

    python benchmarks/join_latency.py [--model-path DIR | --smollm2] [--reps 3] [--cold] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from report import bench_model, machine, save_report, smollm2_preset  # noqa: E402

from relax.cluster.network import free_port  # noqa: E402
from relax.engines.client import EngineClient  # noqa: E402
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec  # noqa: E402
from relax.rollout.assembly import build_fleet  # noqa: E402
from relax.rollout.pool.engines import EngineKind, EnginePool  # noqa: E402
from relax.rollout.pool.events import EventLog  # noqa: E402
from relax.rollout.pool.launcher import EngineSlot  # noqa: E402
from relax.rollout.refit.broadcast import ThreadWeightSource  # noqa: E402
from relax.rollout.routing.router import Router  # noqa: E402
from relax.rollout.settings import FleetSettings  # noqa: E402
from relax.training.sender import WeightSender  # noqa: E402
from relax.weights.publication import WeightRegistry  # noqa: E402


class LocalLauncher:
    """The launcher port over local built-in engine processes; reports spawn → healthy as the actor does."""

    def __init__(self, model_dir: str, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.procs: dict[str, ServerProcess] = {}

    cold = False

    def spawn(self, name: str, load_format: str | None) -> tuple[ServerProcess, float]:
        if self.cold:
            evict(self.model_dir)
        spec = builtin_spec(self.model_dir, "127.0.0.1", free_port(), str(self.logs / f"{name}.log"), name=name,
                            options=BuiltinOptions(num_threads=1, load_format=load_format))
        proc = ServerProcess(spec)
        began = time.monotonic()
        proc.start()
        proc.wait_healthy(timeout=300)
        return proc, time.monotonic() - began

    def reserve(self, engine_id: str, gpus: int) -> EngineSlot:
        return EngineSlot(placement_group=f"pg-{engine_id}", bundle_index=0, owns_group=True)

    async def wait_placed(self, slot: EngineSlot) -> None:
        return None

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None, *,
                    dummy_weights: bool = False) -> dict[str, Any]:
        began = time.monotonic()
        proc, healthy = await asyncio.to_thread(self.spawn, engine_id, "dummy" if dummy_weights else None)
        self.procs[engine_id] = proc
        return {"url": proc.url, "node_id": "local", "startup_s": time.monotonic() - began, "healthy_after_s": healthy}

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool | None:
        proc = self.procs.get(engine_id)
        return None if proc is None else proc.alive

    async def info(self, engine_id: str) -> dict[str, Any]:
        return {}

    async def stop(self, engine_id: str, grace_s: float) -> None:
        proc = self.procs.pop(engine_id, None)
        if proc is not None:
            await asyncio.to_thread(proc.stop, grace_s)

    def release(self, slot: EngineSlot) -> None:
        return None

    def engine_ids(self) -> list[str]:
        return list(self.procs)


def evict(model_dir: str) -> None:
    """Drop the weight files' pages from the page cache: the next read comes from disk."""
    for path in Path(model_dir).glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def perturbed_state(model_dir: str) -> dict[str, Any]:
    """Version 1: the model's own weights, each nudged (what a training step publishes)."""
    import torch

    from relax.engines.builtin.model_runner import load_model

    model = load_model(model_dir, torch.device("cpu"))
    return {name: tensor.detach().clone() + 1e-3 for name, tensor in model.state_dict().items()
            if not name.endswith("lm_head.weight") or not getattr(model.config, "tie_word_embeddings", False)}


async def measure(model_dir: str, reps: int, logs: Path, cold: bool) -> dict[str, Any]:
    weights, events = WeightRegistry(), EventLog()
    pool = EnginePool(time.time)
    launcher = LocalLauncher(model_dir, logs)
    launcher.cold = cold
    fleet = build_fleet(pool, Router(), events, weights, launcher,
                        FleetSettings(model_path=model_dir, request_timeout_s=300, health_timeout_s=300,
                                      shutdown_timeout_s=5, dummy_joins=True),
                        client_factory=lambda url, timeout, keys: EngineClient(url, timeout=timeout))
    sender = WeightSender("127.0.0.1", keep=2)
    joins: list[dict[str, Any]] = []
    bare: list[dict[str, Any]] = []
    try:
        await fleet.start_initial([("pg", 0)])
        fleet.weight_sync.publish(1, [], sender.hold(1, perturbed_state(model_dir)), source=ThreadWeightSource(sender))
        await fleet.weight_sync.settle()
        for rep in range(reps):
            for mode in ("dummy", "checkpoint"):
                fleet.settings = _with_dummy(fleet.settings, mode == "dummy")
                engine_id = pool.add(EngineKind.ELASTIC).engine_id
                await fleet.bring_up_elastic(engine_id, timeout_s=600, cancelled=lambda: False)
                view = fleet.bring_ups.view(engine_id) or {}
                joins.append({"rep": rep, "mode": mode, "engine_id": engine_id, "outcome": view.get("outcome"),
                              "decision_to_active_s": view.get("total_s"), "phases": view.get("phases"),
                              "verified": pool.get(engine_id).weights_verified})
                await fleet.retire(engine_id, force=True, drain_timeout_s=0.0, reason="benchmark")
                proc, healthy = await asyncio.to_thread(launcher.spawn, f"bare-{mode}-{rep}",
                                                        "dummy" if mode == "dummy" else None)
                await asyncio.to_thread(proc.stop, 5.0)
                bare.append({"rep": rep, "mode": mode, "start_to_healthy_s": round(healthy, 3)})
                print(f"rep {rep} {mode}: decision -> ACTIVE {view.get('total_s')}s, bare start {healthy:.2f}s")
    finally:
        await fleet.shutdown()
        sender.shutdown()
    return {"joins": joins, "bare_starts": bare}


def _with_dummy(settings: FleetSettings, dummy: bool) -> FleetSettings:
    import dataclasses

    return dataclasses.replace(settings, dummy_joins=dummy)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in ("dummy", "checkpoint"):
        totals = [j["decision_to_active_s"] for j in result["joins"] if j["mode"] == mode]
        starts = [b["start_to_healthy_s"] for b in result["bare_starts"] if b["mode"] == mode]
        phases: dict[str, list[float]] = {}
        for join in (j for j in result["joins"] if j["mode"] == mode):
            for phase, seconds in (join["phases"] or {}).items():
                phases.setdefault(phase, []).append(seconds)
        total, start = statistics.median(totals), statistics.median(starts)
        # Relax's share: what the join spent beside its own server's start (every phase but server_start), taken
        # from the same join, so the noise of two separate starts does not enter it
        share = statistics.median(sum(s for p, s in (j["phases"] or {}).items() if p != "server_start")
                                  for j in result["joins"] if j["mode"] == mode)
        summary[mode] = {"decision_to_active_s_median": total, "bare_start_s_median": start,
                         "relax_share_s": round(share, 3), "relax_share_of_bare_start": round(share / start, 4),
                         "phases_median_s": {p: round(statistics.median(v), 3) for p, v in phases.items()}}
    summary["dummy_over_checkpoint"] = round(summary["dummy"]["decision_to_active_s_median"]
                                             / summary["checkpoint"]["decision_to_active_s_median"], 3)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="a Hugging Face checkpoint (default: the tiny preset)")
    parser.add_argument("--smollm2", action="store_true", help="the smollm2 preset's SmolLM2-135M (built if needed)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="evict the weight files from the page cache before "
                        "every start (a node that has not read them yet)")
    parser.add_argument("--out", default="benchmarks/results/join_latency.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-join-latency-") as tmp:
        if args.smollm2:
            model_dir, name = str(smollm2_preset(None, tmp, "join_latency").model_dir), "SmolLM2-135M-Instruct"
        else:
            model_dir, name = bench_model(args.model_path, tmp, parser)
        weight_bytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
        logs = Path(tmp) / "logs"
        logs.mkdir()
        result = asyncio.run(measure(model_dir, args.reps, logs, args.cold))
    save_report({"benchmark": "join_latency", "machine": machine(), "model": name, "weight_file_bytes": weight_bytes,
                 "reps": args.reps, "cold": args.cold, "summary": summarise(result), **result}, args.out)


if __name__ == "__main__":
    main()
