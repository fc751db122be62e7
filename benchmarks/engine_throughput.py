"""Built-in engine throughput: 1 vs 16 concurrent requests, beside transformers' own batched generate().

Prints and saves JSON (benchmarks/results/engine_throughput.json). Every figure comes from one run on one
machine, so the ratios are meaningful even where absolute numbers are noisy:

- ``speedup_16_vs_1``: the engine at 16 concurrent requests over the engine answering one at a time
  (continuous batching must pay for itself);
- ``engine16_vs_hf_generate16``: the engine at 16 concurrent requests over ``model.generate()`` with a
  static batch of 16 of the same prompt, same number of new tokens, same threads — what a user gets for
  free from transformers, so the engine must at least match it;
- ``memory_bandwidth``: bytes of weights read per decode step (every parameter once; a tied embedding is
  read whole by the LM head) × decode steps per second, beside a plain ``torch`` copy of the same bytes:
  how close a decode step is to the floor that memory bandwidth sets. ``engine16_gb_per_s`` counts the whole
  burst (prefills, joins, HTTP); ``engine_decode_step_gb_per_s`` times the engine's 16-row decode step alone,
  in this process (its ``ModelRunner``, no HTTP, no sampling).

Then the 16-way burst once more while ``/health`` and ``/metrics`` are polled every 20 ms: how quickly the
server answers them under load (the autoscaler and the health checks depend on it).

    python benchmarks/engine_throughput.py [--model-path DIR] [--threads N] [--requests 64]
                                           [--max-new-tokens 64] [--model-impl auto] [--out FILE]

Without ``--model-path`` the tiny preset is built and used; ``relax preset smollm2 --out DIR`` gives a
real 135M model (``--model-path DIR/model``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx
from report import bench_model, machine, save_report

from relax.cluster.network import free_port
from relax.engines.builtin.model_impl import MODEL_IMPL_CHOICES
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
from relax.engines.loadgen import run_burst

PROMPT = "What is 4 + 5?"


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
        "tokens_per_second": round(r.tokens_per_second, 2),
        "p50_latency_s": round(r.latency_quantile(0.5), 4), "p95_latency_s": round(r.latency_quantile(0.95), 4),
    }


async def _measure_engine(url: str, prompt: str, requests: int, max_new_tokens: int) -> dict:
    await run_burst(url, prompt, requests=4, concurrency=4, max_new_tokens=8)  # warm-up
    results: dict = {}
    for concurrency in (1, 16):
        n = requests if concurrency > 1 else max(2, requests // 8)
        r = await run_burst(url, prompt, requests=n, concurrency=concurrency, max_new_tokens=max_new_tokens)
        results[str(concurrency)] = _burst_summary(r)
    stop = asyncio.Event()
    probes = [asyncio.create_task(_probe(url, path, stop)) for path in ("/health", "/metrics")]
    r = await run_burst(url, prompt, requests=min(requests, 32), concurrency=16, max_new_tokens=max_new_tokens)
    stop.set()
    health, metrics = await asyncio.gather(*probes)
    results["control_latency_during_burst"] = {"burst": _burst_summary(r), "/health": health, "/metrics": metrics}
    return results


def _hf_generate(model_dir: str, prompt: str, batch: int, max_new_tokens: int, threads: int) -> dict:
    """transformers' static batching: one generate() call for ``batch`` copies of the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tok([prompt] * batch, return_tensors="pt")
    kwargs = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "pad_token_id": tok.pad_token_id,
              "min_new_tokens": max_new_tokens, "max_new_tokens": max_new_tokens}
    with torch.inference_mode():
        model.generate(**inputs, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})  # warm-up
        began = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
        seconds = time.perf_counter() - began
    new_tokens = int((out.shape[1] - inputs["input_ids"].shape[1]) * batch)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    copy_gbps = _copy_bandwidth(weight_bytes)
    return {"batch": batch, "completion_tokens": new_tokens, "seconds": round(seconds, 3),
            "tokens_per_second": round(new_tokens / seconds, 2), "weight_bytes": weight_bytes,
            "copy_gb_per_s": round(copy_gbps, 2)}


def _decode_step(model_dir: str, prompt: str, impl: str, rows: int, threads: int, steps: int = 32) -> dict:
    """Seconds of one ``rows``-row decode step of the engine's own model runner, halfway through 64 new tokens."""
    import torch
    from transformers import AutoTokenizer

    from relax.engines.builtin.model_impl import ModelImpl
    from relax.engines.builtin.model_runner import ModelRunner, load_model

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    runner = ModelRunner(load_model(model_dir, device, ModelImpl(impl)), device, pad_token_id=0)
    # distinct rows: the runner encodes identical prompts once, and the step must not depend on that
    runner.prefill([[*ids, row] for row in range(rows)])
    for _ in range(16):
        runner.decode([1] * rows)
    began = time.perf_counter()
    for _ in range(steps):
        runner.decode([1] * rows)
    return {"rows": rows, "ms": round(1000 * (time.perf_counter() - began) / steps, 2)}


def _copy_bandwidth(nbytes: int) -> float:
    """GB/s of a plain tensor copy of ``nbytes`` (read + write counted as the bytes read): the machine's ceiling."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a Hugging Face checkpoint directory (default: build the tiny preset)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for the engine and for transformers alike (default: every core)")
    parser.add_argument("--requests", type=int, default=64, help="requests of the 16-way burst")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model-impl", default="auto", choices=MODEL_IMPL_CHOICES,
                        help="which model code the engine serves with (relax engine serve --model-impl)")
    parser.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        model_dir, model_name = bench_model(args.model_path, tmp, parser)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
        spec = builtin_spec(model_dir, "127.0.0.1", free_port(), str(Path(tmp) / "engine.log"),
                            options=BuiltinOptions(max_running_requests=64, num_threads=args.threads,
                                                   model_impl=args.model_impl),
                            name="bench-engine")
        server = ServerProcess(spec)
        server.start()
        try:
            server.wait_healthy(timeout=300)
            results = asyncio.run(_measure_engine(spec.url, prompt, args.requests, args.max_new_tokens))
        finally:
            server.stop(grace_s=10)
        hf = _hf_generate(model_dir, prompt, 16, args.max_new_tokens, args.threads)
        step = _decode_step(model_dir, prompt, args.model_impl, 16, args.threads)
    engine16 = results["16"]["tokens_per_second"]
    steps_per_s = engine16 / 16  # the burst keeps 16 rows running: one decode step yields 16 tokens
    report = {
        "benchmark": "engine_throughput", "model": model_name, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "model_impl": args.model_impl, "machine": machine(),
        "concurrency": {k: results[k] for k in ("1", "16")},
        "hf_generate": hf,
        "speedup_16_vs_1": round(engine16 / results["1"]["tokens_per_second"], 2),
        "engine16_vs_hf_generate16": round(engine16 / hf["tokens_per_second"], 2),
        "memory_bandwidth": {
            "weight_bytes_per_decode_step": hf["weight_bytes"],
            "engine16_gb_per_s": round(hf["weight_bytes"] * steps_per_s / 1e9, 2),
            "hf_generate16_gb_per_s": round(hf["weight_bytes"] * hf["tokens_per_second"] / 16 / 1e9, 2),
            "engine_decode_step_ms": step["ms"],
            "engine_decode_step_gb_per_s": round(hf["weight_bytes"] / (step["ms"] / 1000) / 1e9, 2),
            "copy_gb_per_s": hf["copy_gb_per_s"],
        },
        "control_latency_during_burst": results["control_latency_during_burst"],
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
