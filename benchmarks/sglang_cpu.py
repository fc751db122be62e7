"""The real SGLang 0.5.23 on this machine's CPU beside Relax's built-in engine and the bare floors, in one run.

Each engine is started, measured and stopped before the next one starts (one engine at a time, every core
its own), then the transport floor is measured with no engine running. Prints and saves JSON
(benchmarks/results/sglang_cpu.json):

- ``startup_s`` (per engine): from ``ServerProcess.start()`` to the first healthy answer. SGLang is launched
  exactly as Relax launches it on a node without CUDA (``SGLangBackend().prepare(..., cuda=False)`` then
  ``launch_spec``: its CPU platform, bf16, the node's cores); the built-in engine with ``BuiltinOptions``
  (fp32, ``--threads`` torch threads, 16 running requests).
- ``throughput`` (per engine): ``tokens_per_s`` of 16 concurrent ``/generate`` requests of the same prompt,
  ``max_new_tokens`` each with ``ignore_eos`` (one shorter warm-up burst of 16 first), and of a few requests
  sent one at a time. ``sglang16_vs_builtin16`` is SGLang's 16-way figure over the built-in engine's.
- ``refit`` (SGLang only): the trainer's side of a broadcast weight update (``WeightSender`` holding the whole
  model's state dict in bf16, flattened buckets of ``--bucket-mib``) driven into the real server by the
  rollout side's ``open_group`` / ``send_version`` over gloo, as a run with SGLang engines does. Every
  version carries the whole model, scaled so consecutive versions differ. One warm-up version, then
  ``--refits`` timed: ``refit_s`` (``send_version`` end to end: pause, begin, every bucket, end, continue),
  ``paused_s`` (what ``send_version`` reports: how long the engine did not generate), ``transfer_s`` and
  ``hold_s`` (the trainer's stall: the hold returns once its buffers are chosen and copies behind it, so the
  copy is inside ``refit_s``), medians of the timed refits. Then one more version refitted as
  ``--verify-weights every`` does it (``verified_refit``): checked before the engine continues, SGLang's
  ``/weights_checker`` against the trainer's checksums (``WeightSender.checksums``), both hashing at once;
  its ``verify_s`` is inside its ``paused_s``. After it, ``verified``: the same answer compared with
  ``relax.weights.digest.sglang_checksums`` (fused copies, the independent reference), tensor by tensor.
- ``floor``: ``benchmarks/weight_sync.py``'s ``raw_broadcast_seconds`` — a bare gloo broadcast of the same bytes
  in the same buckets to one other process over loopback (no HTTP, no pause, no load into a model), the
  transport's floor here; ``refit_over_floor`` = ``refit_s`` / ``floor_s``.
- ``stop_s`` and ``stop_exit_code`` (per engine): ``ServerProcess.stop()``, SIGTERM then a drain (0: SGLang
  stopped its scheduler and detokenizer itself).

The machine's load average at start and end is recorded: other jobs on a 2-core machine make every figure
noisy, the ratios (measured minutes apart in one run) less so.

    python benchmarks/sglang_cpu.py [--model-path DIR] [--sglang-python PATH] [--threads N]
                                    [--max-new-tokens 64] [--refits 3] [--bucket-mib 512] [--out FILE]

Without ``--model-path`` the tiny preset is built and used; ``relax preset smollm2 --out DIR`` gives a real
135M model (``--model-path DIR/model``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
import torch
from report import bench_model, machine, save_report
from weight_sync import raw_broadcast_seconds  # also puts the repository root on sys.path

from relax.cluster.network import free_port
from relax.engines.backends import SGLangBackend
from relax.engines.client import EngineClient
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
from relax.engines.loadgen import BurstResult, run_burst
from relax.engines.sglang import SGLangOptions
from relax.rollout.refit.broadcast import ThreadWeightSource, close_group, open_group, send_version
from relax.rollout.refit.weight_sync import check_served_weights
from relax.rollout.settings import BroadcastSettings
from relax.training.sender import WeightSender
from relax.weights.digest import checksum_mismatches, sglang_checksums
from relax.weights.pause_mode import PauseMode

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What is 4 + 5?"
CONCURRENCY = 16
#: SGLang's start-up on this machine: 19-41 s when quiet, up to ~2 min under load (tests/sglang/conftest.py).
STARTUP_TIMEOUT_S = 300.0
SETTINGS = BroadcastSettings(backend="gloo", timeout_s=120.0)


def _burst(r: BurstResult) -> dict[str, Any]:
    return {"requests": r.requests, "concurrency": r.concurrency, "completion_tokens": r.completion_tokens,
            "seconds": round(r.seconds, 3), "tokens_per_s": round(r.tokens_per_second, 2),
            "p50_latency_s": round(r.latency_quantile(0.5), 3), "max_latency_s": round(max(r.latencies), 3)}


async def _throughput(url: str, prompt: str, max_new_tokens: int, warmup_tokens: int, sequential: int) -> dict:
    began = time.perf_counter()
    await run_burst(url, prompt, requests=CONCURRENCY, concurrency=CONCURRENCY, max_new_tokens=warmup_tokens)
    warmup_s = time.perf_counter() - began
    many = await run_burst(url, prompt, requests=CONCURRENCY, concurrency=CONCURRENCY, max_new_tokens=max_new_tokens)
    one = await run_burst(url, prompt, requests=sequential, concurrency=1, max_new_tokens=max_new_tokens)
    return {"warmup_s": round(warmup_s, 3), str(CONCURRENCY): _burst(many), "1": _burst(one),
            f"speedup_{CONCURRENCY}_vs_1": round(many.tokens_per_second / one.tokens_per_second, 2)}


def _version_state(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The whole model, scaled by 1.01 or 0.99 (alternating): every version differs from the one before in bf16."""
    scale = 1.01 if version % 2 else 0.99
    return {name: t * scale if t.is_floating_point() else t for name, t in base.items()}


async def _refit(url: str, model_dir: str, refits: int, bucket_bytes: int) -> dict[str, Any]:
    """One warm-up and ``refits`` timed broadcast refits of the whole model into the engine at ``url``."""
    from safetensors.torch import load_file

    base = load_file(str(Path(model_dir) / "model.safetensors"))
    sender = WeightSender("127.0.0.1")
    runs: list[dict[str, Any]] = []
    out: dict[str, Any] = {"dtype": "bfloat16", "bucket_mib": bucket_bytes / 2**20, "pause_mode": "retract"}
    state: dict[str, torch.Tensor] = {}
    try:
        async with EngineClient(url, timeout=SETTINGS.timeout_s) as client:
            began = time.perf_counter()
            group = await open_group("bench-sglang", client, ThreadWeightSource(sender), SETTINGS)
            out["open_group_s"] = round(time.perf_counter() - began, 3)
            try:
                for version in range(1, refits + 3):
                    state = _version_state(base, version)
                    began = time.perf_counter()
                    manifest = sender.hold(version, state, dtype=torch.bfloat16, bucket_bytes=bucket_bytes,
                                           layout="sglang")
                    hold_s = time.perf_counter() - began
                    check = None
                    if version == refits + 2:  # the last one as --verify-weights every refits

                        async def check(attempt: int, v: int = version) -> Any:
                            return await check_served_weights("bench-sglang", v, client, lambda: asyncio.to_thread(
                                sender.checksums, v), attempt=attempt)

                    began = time.perf_counter()
                    timings = await send_version("bench-sglang", client, group, version, manifest, PauseMode.RETRACT,
                                                 SETTINGS.timeout_s, check)
                    refit_s = time.perf_counter() - began
                    if timings["bytes"] != manifest.total_bytes:
                        raise RuntimeError(f"v{version}: sent {timings['bytes']} of {manifest.total_bytes} bytes")
                    runs.append({"version": version, "refit_s": round(refit_s, 3),
                                 "paused_s": round(timings["paused_s"], 3),
                                 "transfer_s": round(timings["transfer_s"], 3), "hold_s": round(hold_s, 3),
                                 "verify_s": round(timings["verify_s"], 3),
                                 "verification": [v.result.value for v in timings["verifications"]],
                                 "bytes": timings["bytes"], "buckets": timings["buckets"]})
                    print(f"  refit v{version}: {refit_s:.2f}s (paused {timings['paused_s']:.2f}s, "
                          f"{timings['buckets']} bucket(s), {timings['bytes'] / 2**20:.0f} MiB)", flush=True)
                out["served_version"] = await client.get_weight_version()
            finally:
                await close_group(group, client)
        timed, out["verified_refit"] = runs[1:-1], runs[-1]
        out.update({"bytes": runs[0]["bytes"], "buckets": runs[0]["buckets"], "warmup": runs[0], "runs": timed,
                    **{key: round(statistics.median(r[key] for r in timed), 3)
                       for key in ("refit_s", "paused_s", "transfer_s", "hold_s")}})
        out.update(await _verify(url, state, str(refits + 2)))
    finally:
        sender.shutdown()
    return out


async def _verify(url: str, state: dict[str, torch.Tensor], version: str) -> dict[str, Any]:
    """SGLang's own per-tensor checksums of what it serves against the trainer's last version, and a generation."""
    expected = sglang_checksums(state, torch.bfloat16)
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        began = time.perf_counter()
        answer = await http.post("/weights_checker", json={"action": "checksum"})
        verify_s = time.perf_counter() - began
        answer.raise_for_status()
        served = answer.json()["ranks"][0]["checksums"]
        wrong = checksum_mismatches(expected, served)
        gen = (await http.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}})).json()
    return {"verified": not wrong, "verify_s": round(verify_s, 3), "tensors_checked": len(expected),
            "mismatches": wrong[:10], "serves_after_refit": gen.get("meta_info", {}).get("weight_version") == version}


def _stop(server: ServerProcess, result: dict[str, Any], grace_s: float | None = None) -> None:
    began = time.perf_counter()
    code = server.stop(grace_s)
    result["stop_s"] = round(time.perf_counter() - began, 3)
    result["stop_exit_code"] = code


def _start(server: ServerProcess, result: dict[str, Any]) -> None:
    began = time.perf_counter()
    server.start()
    server.wait_healthy(STARTUP_TIMEOUT_S)
    result["startup_s"] = round(time.perf_counter() - began, 3)
    print(f"  {server.spec.name}: healthy in {result['startup_s']:.1f}s", flush=True)


def _error(result: dict[str, Any], exc: BaseException, server: ServerProcess | None) -> None:
    result["error"] = f"{type(exc).__name__}: {exc}"[:800]
    print(f"  failed: {result['error']}\n{traceback.format_exc()}", flush=True)
    if server is not None:
        result["log_tail"] = server.log_tail(20)[-3000:]


def measure_sglang(model_dir: str, logs: Path, python: str, prompt: str, args: argparse.Namespace) -> dict:
    backend = SGLangBackend()
    prepared = backend.prepare(SGLangOptions(python=python, cpu_engines_per_node=1), model_dir, {}, cuda=False)
    port = free_port()
    spec = backend.launch_spec("bench-sglang", model_dir, "127.0.0.1", port, str(logs / f"sglang-{port}.log"),
                               weight_version=0, options=prepared.options, env=prepared.env, nccl_port=free_port())
    server = ServerProcess(spec)
    result: dict[str, Any] = {"launch": prepared.summary}
    try:
        _start(server, result)
        result["throughput"] = _measure_throughput(spec.url, prompt, args)
        result["refit"] = asyncio.run(_refit(spec.url, model_dir, args.refits, args.bucket_mib * 2**20))
    except Exception as exc:  # noqa: BLE001 - reported in the JSON; the other engine still runs
        _error(result, exc, server)
    finally:
        _stop(server, result)
        prepared.release()
    return result


def _measure_throughput(url: str, prompt: str, args: argparse.Namespace) -> dict:
    throughput = asyncio.run(_throughput(url, prompt, args.max_new_tokens, args.warmup_tokens, args.sequential))
    print(f"  throughput: {throughput[str(CONCURRENCY)]['tokens_per_s']} tok/s at {CONCURRENCY}, "
          f"{throughput['1']['tokens_per_s']} at 1", flush=True)
    return throughput


def measure_builtin(model_dir: str, logs: Path, prompt: str, args: argparse.Namespace) -> dict:
    port = free_port()
    spec = builtin_spec(model_dir, "127.0.0.1", port, str(logs / f"builtin-{port}.log"),
                        options=BuiltinOptions(num_threads=args.threads, max_running_requests=CONCURRENCY),
                        name="bench-builtin")
    server = ServerProcess(spec)
    result: dict[str, Any] = {"threads": args.threads}
    try:
        _start(server, result)
        result["throughput"] = _measure_throughput(spec.url, prompt, args)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        _error(result, exc, server)
    finally:
        _stop(server, result, grace_s=10)
    return result


def _tok_per_s(result: dict[str, Any]) -> float | None:
    return result.get("throughput", {}).get(str(CONCURRENCY), {}).get("tokens_per_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a Hugging Face checkpoint directory (default: build the tiny preset)")
    parser.add_argument("--sglang-python", default=os.environ.get("RELAX_SGLANG_PYTHON")
                        or str(REPO_ROOT / ".venv-sglang" / "bin" / "python"),
                        help="the interpreter with SGLang 0.5.23 installed (make sglang-cpu)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the built-in engine's threads")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=16, help="new tokens per request of the warm-up burst")
    parser.add_argument("--sequential", type=int, default=3, help="requests sent one at a time")
    parser.add_argument("--refits", type=int, default=3, help="timed refits (after one warm-up)")
    parser.add_argument("--bucket-mib", type=int, default=512, help="broadcast bucket (Relax's default: 512)")
    parser.add_argument("--out", default="benchmarks/results/sglang_cpu.json")
    args = parser.parse_args()
    if not os.path.exists(args.sglang_python):
        parser.error(f"no SGLang interpreter at {args.sglang_python}: run `make sglang-cpu` or pass --sglang-python")
    began = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="relax-bench-sglang-") as tmp:
        model_dir, model_name = bench_model(args.model_path, tmp, parser)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        print("SGLang", flush=True)
        sglang = measure_sglang(model_dir, logs, args.sglang_python, prompt, args)
        refit = sglang.get("refit", {})
        floor: dict[str, Any] = {}
        if "bytes" in refit:
            print("floor: bare gloo broadcast", flush=True)
            floor_s = raw_broadcast_seconds(refit["bytes"], args.bucket_mib * 2**20, repeats=7, receivers=1)
            floor = {"floor_s": round(floor_s, 3), "bytes": refit["bytes"], "bucket_mib": args.bucket_mib}
            refit["floor_s"] = floor["floor_s"]
            refit["refit_over_floor"] = round(refit["refit_s"] / floor_s, 2)
        print("built-in engine", flush=True)
        builtin = measure_builtin(model_dir, logs, prompt, args)
    s16, b16 = _tok_per_s(sglang), _tok_per_s(builtin)
    report = {
        "benchmark": "sglang_cpu", "model": model_name, "max_new_tokens": args.max_new_tokens,
        "concurrency": CONCURRENCY, "machine": machine(),
        "load_average": {"start": load_at_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "sglang16_vs_builtin16": round(s16 / b16, 2) if s16 and b16 else None,
        "refit_over_floor": refit.get("refit_over_floor"),
        "verified": refit.get("verified"),
        "verified_refit": refit.get("verified_refit"),
        "sglang": sglang, "builtin": builtin, "floor": floor,
        "total_s": round(time.perf_counter() - began, 1),
    }
    save_report(report, args.out)
    checked = (refit.get("verified_refit") or {}).get("verification") == ["verified"]
    return 1 if "error" in sglang or "error" in builtin or not refit.get("verified") or not checked else 0


if __name__ == "__main__":
    raise SystemExit(main())
