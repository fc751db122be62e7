"""Scale-out latency (POST to ACTIVE, per phase) and the router's overhead, on a local Ray cluster.

What it measures, with built-in engines on the tiny preset and one RolloutManager actor:

1. **Scale-out latency** for 1 and 2 new engines (``scale_out {"num_replicas": 2|3}`` from 1 initial
   engine): the request record's ``timings`` (``placement_wait_s``, ``start_s``, ``health_s``,
   ``weight_sync_s`` - per phase the slowest engine - and ``total_s``), each engine's own phase timings,
   and the wall time the caller saw from the POST until the record said ACTIVE. Weight version 1 is
   published first (buckets of the model's own state dict), so weight sync is a real pull + load, not a
   no-op. Each size is measured ``--reps`` times; every run and the per-key median are reported. The
   engines are scaled back in between runs (the scale-in records are reported too).
2. **Router overhead**: with 2 ACTIVE engines, the same bounded load (``--requests`` x
   ``--max-new-tokens`` fixed-length outputs, ``--concurrency`` in flight) (a) through the manager's
   dispatcher, inside the manager as the rollout loop drives it (``manager.generate_batch``: streamed, with
   routing, retries and prefix holding), (b) straight to the engines over HTTP
   (``relax.engines.loadgen.run_burst``, split evenly over the two URLs), and (c) as (a) but with one Ray actor
   call per request from this script. Tokens/s for each, the ratios to (b), and how evenly (a) split the load
   (``split_max_deviation``: the farthest engine's share from the mean); a, b, c alternate for ``--rounds``
   rounds in one run.

Why absolute numbers are noisy: this machine has few cores shared with other work, Ray's "GPUs" are
logical, engine start time is dominated by Python/torch import and process spawn (cold vs warm page
cache), and the tiny model makes per-request overhead large relative to compute. Compare the phases
with each other and a with b within one run; do not compare absolute figures across machines.

Known differences between the paths of the router comparison: (a) streams every generation (the manager
holds each prefix so a crash loses nothing, ``relax.rollout.dispatch.dispatcher``), sends token ids and asks for
log-probs, as rollout does, while (b) sends the same prompt as text, unstreamed, without log-probs; (c) adds a
Ray actor call per request, which training never pays (the rollout loop dispatches inside the manager).

    python benchmarks/scale_latency.py [--reps 2] [--requests 256] [--concurrency 32] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group  # noqa: E402
from report import machine, save_report  # noqa: E402

from relax.cluster.connect import start_local  # noqa: E402
from relax.engines.loadgen import run_burst  # noqa: E402
from relax.presets.tiny import build_tiny_preset  # noqa: E402
from relax.rollout.control.api import status_of  # noqa: E402
from relax.rollout.manager import spawn_rollout_manager  # noqa: E402
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec  # noqa: E402
from relax.rollout.settings import (  # noqa: E402
    DataSettings,
    DispatchSettings,
    FleetSettings,
    LaunchSettings,
    RolloutSettings,
    SamplingSettings,
    ScalingSettings,
)

PHASES = ("placement_wait_s", "start_s", "health_s", "weight_sync_s", "total_s")
ENDED = ("ACTIVE", "PARTIAL", "FAILED", "CANCELLED", "COMPLETED")
POLL_S = 0.05


def _call(manager: Any, method: str, *args: Any) -> tuple[int, Any]:
    """A control-API call as (status, body); scale bodies become the scaling core's specs."""
    specs = {"scale_out": ScaleOutSpec, "scale_in": ScaleInSpec}
    if method in specs:
        args = (specs[method](**args[0]), *args[1:])
    try:
        return 200, ray.get(getattr(manager, method).remote(*args), timeout=120)
    except ray.exceptions.RayTaskError as exc:
        return status_of(exc.cause) or 500, {"detail": str(exc.cause)}


def _wait_ended(manager: Any, direction: str, request_id: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, record = _call(manager, "get_scale_request", direction, request_id)
        if record["status"] in ENDED:
            return record
        if time.monotonic() > deadline:
            raise TimeoutError(f"{direction} {request_id} still {record['status']} after {timeout:.0f}s")
        time.sleep(POLL_S)


def _engines(manager: Any) -> list[dict]:
    return _call(manager, "engines_view")[1]["models"]["default"]["engines"]


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _publish_v1(manager: Any, model_dir: Path) -> dict:
    """Version 1 = the model's own weights, published the way the trainer does (object store buckets)."""
    from safetensors.torch import load_file

    from relax.training.publisher import publish_state

    began = time.monotonic()
    publication = publish_state(manager, 1, load_file(str(model_dir / "model.safetensors")))
    ray.get(publication.registered, timeout=60)
    if not ray.get(manager.wait_weights.remote(1, 120.0), timeout=150):
        raise RuntimeError("the initial engine did not load weight version 1")
    return {
        "version": 1,
        "buckets": len(publication.manifest.bucket_sizes),
        "tensors": publication.manifest.num_tensors,
        "bytes": publication.nbytes,
        "initial_engine_sync_s": round(time.monotonic() - began, 3),
        "_refs": publication.bucket_refs,
    }


def _scale_out(manager: Any, target: int) -> dict:
    began = time.monotonic()
    status, body = _call(manager, "scale_out", {"num_replicas": target})
    if status != 200 or body.get("status") != "PENDING":
        raise RuntimeError(f"scale_out to {target}: {status} {body}")
    record = _wait_ended(manager, "scale_out", body["request_id"])
    observed = time.monotonic() - began
    if record["status"] != "ACTIVE":
        raise RuntimeError(f"scale_out to {target} ended {record['status']}: {record.get('error')}")
    created = set(record["engine_ids"])
    versions = {e["engine_id"]: e["weight_version"] for e in _engines(manager) if e["engine_id"] in created}
    timings = record["timings"]
    return {
        "request_id": record["request_id"],
        "new_engines": len(created),
        "observed_post_to_active_s": round(observed, 3),
        **{key: _r(timings.get(key)) for key in PHASES},
        "in_status_s": {k: _r(v) for k, v in (timings.get("in_status_s") or {}).items()},
        "engines": [
            {
                "engine_id": e["engine_id"],
                "weight_version": versions.get(e["engine_id"]),
                **{key: _r(e.get(key)) for key in PHASES},
            }
            for e in record["engines"]
        ],
    }


def _scale_in(manager: Any, target: int) -> dict:
    began = time.monotonic()
    status, body = _call(manager, "scale_in", {"num_replicas": target})
    if status != 200 or "request_id" not in body:
        raise RuntimeError(f"scale_in to {target}: {status} {body}")
    record = _wait_ended(manager, "scale_in", body["request_id"])
    if record["status"] != "COMPLETED":
        raise RuntimeError(f"scale_in to {target} ended {record['status']}: {record.get('error')}")
    return {
        "request_id": record["request_id"],
        "observed_s": round(time.monotonic() - began, 3),
        "victims": [
            {"engine_id": v["engine_id"], "drain_s": _r(v.get("drain_s")), "shutdown_s": _r(v.get("shutdown_s"))}
            for v in record.get("victims", [])
        ],
    }


def _median(runs: list[dict]) -> dict:
    keys = ("observed_post_to_active_s", *PHASES)
    out = {}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    return out


async def _through_router(
    manager: Any, input_ids: list[int], tag: str, requests: int, concurrency: int, max_new_tokens: int
) -> dict:
    """The load through the manager's dispatcher, as the rollout loop drives it: inside the manager (one Ray call
    carries the whole load there and its answers back; a distinct group key per request: plain balancing)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    batch = [(f"bench-{tag}-{i}", input_ids, params) for i in range(requests)]
    began = time.perf_counter()
    gens = await manager.generate_batch.remote(batch, concurrency)
    seconds = time.perf_counter() - began
    return _summary(gens, seconds)


async def _through_ray_calls(
    manager: Any, input_ids: list[int], tag: str, requests: int, concurrency: int, max_new_tokens: int
) -> dict:
    """The same load as one Ray actor call per request (what a script outside the manager pays on top)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Any:
        async with gate:
            return await manager.generate.remote(f"bench-{tag}-{i}", input_ids, params)

    began = time.perf_counter()
    gens = await asyncio.gather(*(one(i) for i in range(requests)))
    return _summary(gens, time.perf_counter() - began)


def _summary(gens: list[Any], seconds: float) -> dict:
    tokens = sum(int(g.output["meta_info"]["completion_tokens"]) for g in gens)
    per_engine = Counter(g.engine_id for g in gens)
    return {
        "requests": len(gens),
        "completion_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1),
        "requests_per_engine": dict(sorted(per_engine.items())),
    }


async def _direct(urls: list[str], prompt: str, requests: int, concurrency: int, max_new_tokens: int) -> dict:
    n = len(urls)
    shares = [requests // n + (1 if i < requests % n else 0) for i in range(n)]
    slots = [concurrency // n + (1 if i < concurrency % n else 0) for i in range(n)]
    began = time.perf_counter()
    parts = await asyncio.gather(
        *(
            run_burst(url, prompt, requests=r, concurrency=c, max_new_tokens=max_new_tokens)
            for url, r, c in zip(urls, shares, slots, strict=True)
        )
    )
    seconds = time.perf_counter() - began
    tokens = sum(p.completion_tokens for p in parts)
    return {
        "requests": sum(p.requests for p in parts),
        "completion_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1),
        "requests_per_engine": dict(zip(urls, shares, strict=True)),
    }


def _router_overhead(manager: Any, tokenizer: Any, args: argparse.Namespace) -> dict:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 4 + 5?"}], tokenize=False, add_generation_prompt=True
    )
    input_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    urls = sorted(ray.get(manager.engine_urls.remote(), timeout=60).values())
    if len(urls) != 2:
        raise RuntimeError(f"expected 2 ACTIVE engines, found {urls}")

    async def measure() -> list[dict]:
        await _through_router(manager, input_ids, "warm", 16, 16, 8)  # warm-up every path
        await _through_ray_calls(manager, input_ids, "warm-calls", 16, 16, 8)
        await _direct(urls, prompt, 16, 16, 8)
        rounds = []
        for i in range(args.rounds):
            a = await _through_router(manager, input_ids, f"r{i}", args.requests, args.concurrency, args.max_new_tokens)
            b = await _direct(urls, prompt, args.requests, args.concurrency, args.max_new_tokens)
            c = await _through_ray_calls(manager, input_ids, f"c{i}", args.requests, args.concurrency,
                                         args.max_new_tokens)
            rounds.append(
                {
                    "round": i + 1,
                    "router": a,
                    "direct": b,
                    "ray_call_per_request": c,
                    "router_over_direct": round(a["tokens_per_second"] / b["tokens_per_second"], 3),
                    "ray_calls_over_direct": round(c["tokens_per_second"] / b["tokens_per_second"], 3),
                    "split_max_deviation": _split_deviation(a["requests_per_engine"]),
                }
            )
        return rounds

    rounds = asyncio.run(measure())
    ratios = [r["router_over_direct"] for r in rounds]
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": len(input_ids),
        "engine_urls": urls,
        "rounds": rounds,
        "router_over_direct_median": round(statistics.median(ratios), 3),
        "ray_calls_over_direct_median": round(statistics.median(r["ray_calls_over_direct"] for r in rounds), 3),
        "split_max_deviation_median": round(statistics.median(r["split_max_deviation"] for r in rounds), 3),
    }


def _split_deviation(per_engine: dict[str, int]) -> float:
    """How far the busiest or idlest engine's share is from the mean (0.1: within 10 %)."""
    mean = sum(per_engine.values()) / len(per_engine)
    return max(abs(n - mean) for n in per_engine.values()) / mean


def _run(args: argparse.Namespace, preset: Any, tmp: Path) -> dict:
    from transformers import AutoTokenizer

    settings = RolloutSettings(
        data=DataSettings(prompt_data=str(preset.train_path), num_rollout=1, rollout_batch_size=4,
                          sampling=SamplingSettings(n_samples=2, max_new_tokens=8), max_staleness=0,
                          apply_chat_template=True, rm_type="tiny"),
        fleet=FleetSettings(model_path=str(preset.model_dir), drain_timeout_s=30, shutdown_timeout_s=10),
        launch=LaunchSettings(backend="builtin", log_dir=str(tmp / "engine-logs")),
        dispatch=DispatchSettings(stream=args.stream != "off",
                                  stream_min_tokens=0 if args.stream == "all" else DispatchSettings.stream_min_tokens),
        scaling=ScalingSettings(max_engines=3, scale_out_timeout_s=180),
    )
    initial = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK", name="bench-initial")
    ray.get(initial.ready(), timeout=60)
    manager = None
    try:
        manager = spawn_rollout_manager(settings)
        began = time.monotonic()
        ray.get(manager.start_initial_engines.remote([(initial, 0)]), timeout=300)
        initial_start_s = round(time.monotonic() - began, 3)
        weights = _publish_v1(manager, preset.model_dir)
        refs = weights.pop("_refs")  # kept alive until the end: late-joining engines pull them
        runs: dict[str, list[dict]] = {"1": [], "2": []}
        scale_ins: list[dict] = []
        # 2 new engines first, then 1, so the last run leaves the 2 engines the router comparison needs.
        plan = [(rep, new) for rep in range(args.reps) for new in (2, 1)]
        for i, (rep, new) in enumerate(plan):
            run = _scale_out(manager, 1 + new)
            run["rep"] = rep + 1
            runs[str(new)].append(run)
            print(
                f"scale-out +{new} (rep {rep + 1}): {run['total_s']}s "
                f"(placement {run['placement_wait_s']}, start {run['start_s']}, health {run['health_s']}, "
                f"weights {run['weight_sync_s']})",
                flush=True,
            )
            if i < len(plan) - 1:
                scale_ins.append(_scale_in(manager, 1))
        router = _router_overhead(manager, AutoTokenizer.from_pretrained(str(preset.model_dir)), args)
        print(f"router/direct tokens/s ratio: {[r['router_over_direct'] for r in router['rounds']]} "
              f"(one Ray call per request: {[r['ray_calls_over_direct'] for r in router['rounds']]}; split "
              f"{[r['router']['requests_per_engine'] for r in router['rounds']]})", flush=True)
        del refs
        return {
            "initial_engine_start_s": initial_start_s,
            "weights": weights,
            "scale_out": {new: {"runs": rs, "median": _median(rs)} for new, rs in runs.items()},
            "scale_in": scale_ins,
            "router_overhead": router,
        }
    finally:
        if manager is not None:
            try:
                ray.get(manager.shutdown.remote(), timeout=120)
            finally:
                ray.kill(manager)
        remove_placement_group(initial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="scale-out runs per size (1 and 2 new engines)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="router/direct alternations")
    parser.add_argument("--stream", choices=("auto", "all", "off"), default="auto",
                        help="auto: the manager's rule (budgets of 64 tokens or fewer unstreamed); all: every request "
                             "streamed; off: none (no prefix held: a crash loses whole requests)")
    parser.add_argument("--out", default="benchmarks/results/scale_latency.json")
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        preset = build_tiny_preset(Path(tmp) / "tiny")
        start_local(num_gpus=8, num_cpus=8, log_to_driver=False,
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            results = _run(args, preset, Path(tmp))
            leftover = sorted(
                g["name"] for g in placement_group_table().values() if g.get("name") and g["state"] != "REMOVED"
            )
        finally:
            ray.shutdown()
    report = {
        "benchmark": "scale_latency",
        "model": "tiny preset",
        "engine": "builtin",
        "cluster": "local Ray, 8 logical GPUs",
        "machine": machine(),
        **results,
        "leftover_placement_groups": leftover,
        "run_seconds": round(time.monotonic() - began, 1),
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
