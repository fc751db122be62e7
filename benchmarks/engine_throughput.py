"""Built-in engine throughput: 1 vs 16 concurrent requests on the tiny preset.

Prints and saves JSON (benchmarks/results/engine_throughput.json). Both figures come from one run
against one engine, so their ratio is meaningful even on a noisy machine; absolute numbers are not.
Then the 16-way burst once more while ``/health`` and ``/metrics`` are polled every 20 ms: how quickly
the server answers them under load, and what the polling costs (a control request must not queue behind
the generation loop; the autoscaler and the health checks depend on it).

    python benchmarks/engine_throughput.py [--requests 64] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx
from report import machine, save_report

from relax.cluster.network import free_port
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
from relax.engines.loadgen import run_burst
from relax.presets.tiny import build_tiny_preset


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _probe(url: str, path: str, stop: asyncio.Event, interval_s: float = 0.02) -> dict:
    """Latency of ``GET path`` every ``interval_s`` until ``stop``: what a health check or scraper sees."""
    seconds: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
        while not stop.is_set():
            began = time.perf_counter()
            (await http.get(path)).raise_for_status()
            seconds.append(time.perf_counter() - began)
            await asyncio.sleep(interval_s)
    return {"probes": len(seconds), "p50_ms": round(1000 * _quantile(seconds, 0.5), 2),
            "p99_ms": round(1000 * _quantile(seconds, 0.99), 2), "max_ms": round(1000 * max(seconds, default=0), 2)}


def _burst_summary(r) -> dict:
    return {
        "requests": r.requests, "completion_tokens": r.completion_tokens, "seconds": round(r.seconds, 3),
        "tokens_per_second": round(r.tokens_per_second, 1),
        "p50_latency_s": round(r.latency_quantile(0.5), 4), "p95_latency_s": round(r.latency_quantile(0.95), 4),
    }


async def _measure(url: str, prompt: str, requests: int, max_new_tokens: int) -> dict:
    await run_burst(url, prompt, requests=8, concurrency=8, max_new_tokens=8)  # warm-up
    results: dict = {}
    for concurrency in (1, 16):
        n = requests if concurrency > 1 else max(8, requests // 4)
        r = await run_burst(url, prompt, requests=n, concurrency=concurrency, max_new_tokens=max_new_tokens)
        results[str(concurrency)] = _burst_summary(r)
    # the 16-way burst again, with /health and /metrics polled every 20 ms meanwhile
    stop = asyncio.Event()
    probes = [asyncio.create_task(_probe(url, path, stop)) for path in ("/health", "/metrics")]
    r = await run_burst(url, prompt, requests=requests, concurrency=16, max_new_tokens=max_new_tokens)
    stop.set()
    health, metrics = await asyncio.gather(*probes)
    results["control_latency_during_burst"] = {"burst": _burst_summary(r), "/health": health, "/metrics": metrics}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        preset = build_tiny_preset(Path(tmp) / "tiny")
        spec = builtin_spec(str(preset.model_dir), "127.0.0.1", free_port(), str(Path(tmp) / "engine.log"),
                            options=BuiltinOptions(max_running_requests=64, num_threads=1), name="bench-engine")
        server = ServerProcess(spec)
        server.start()
        try:
            server.wait_healthy(timeout=120)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(preset.model_dir))
            prompt = tok.apply_chat_template([{"role": "user", "content": "What is 4 + 5?"}], tokenize=False,
                                             add_generation_prompt=True)
            results = asyncio.run(_measure(spec.url, prompt, args.requests, args.max_new_tokens))
        finally:
            server.stop(grace_s=10)
    report = {
        "benchmark": "engine_throughput", "model": "tiny preset", "max_new_tokens": args.max_new_tokens,
        "machine": machine(),
        "control_latency_during_burst": results.pop("control_latency_during_burst"),
        "concurrency": results,
        "speedup_16_vs_1": round(results["16"]["tokens_per_second"] / results["1"]["tokens_per_second"], 2),
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
