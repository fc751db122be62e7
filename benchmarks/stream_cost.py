"""What streaming costs on the built-in engine: 16 concurrent requests, streamed vs not, side by side in one run.

One engine serves every mode; the modes alternate within each round (their order rotates from round to round),
so a disturbance on the machine hits them alike and the per-round ratio stays meaningful:

- ``plain``: ``EngineClient.generate`` (one JSON answer per request);
- ``stream_<interval>``: ``EngineClient.generate_stream`` with ``sampling_params.stream_interval`` =
  ``--interval`` (default 16), and ``stream_1``, SGLang's default chunk size (a chunk per token).

Each mode sends ``--requests`` requests (default 64), 16 in flight, of ``--max-new-tokens`` (default 64) with
``ignore_eos``, ``return_logprob`` and temperature 1. Reported per round and as the median over ``--rounds``:
tokens/s, streamed/plain tokens/s, chunks received (complete events, ``[DONE]`` excluded), and the CPU
seconds the engine's processes spent (a chunk is built and sent on the server's event loop, which shares the
GIL with the generation loop: what streaming costs shows up there first).

    python benchmarks/stream_cost.py [--model-path DIR] [--rounds 3] [--requests 64] [--max-new-tokens 64]
                                     [--interval 16] [--threads N] [--out FILE]

Without ``--model-path`` the tiny preset is built and used; ``relax preset smollm2 --out DIR`` gives a real
135M model (``--model-path DIR/model``). Prints and saves JSON (benchmarks/results/stream_cost.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from report import bench_model, machine, save_report

from relax.cluster.network import free_port
from relax.engines.client import EngineClient
from relax.engines.event_stream import EventStream
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec

PROMPT = "What is 4 + 5?"
CONCURRENCY = 16


def _engine_cpu_seconds(pid: int) -> float:
    """User + system CPU of the engine's process group (the guard and the server under it)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in (root, *root.children(recursive=True)):
            times = proc.cpu_times()
            total += times.user + times.system
    except psutil.NoSuchProcess:
        pass
    return total


async def _one(client: EngineClient, mode: str, input_ids: list[int], params: dict) -> tuple[int, int]:
    """(completion tokens, chunks) of one request in ``mode``."""
    if mode == "plain":
        out = await client.generate(input_ids=input_ids, sampling_params=params, return_logprob=True, timeout=300)
        return out["meta_info"]["completion_tokens"], 0
    held = EventStream()
    interval = int(mode.removeprefix("stream_"))
    out = await client.generate_stream(held, input_ids=input_ids, return_logprob=True, timeout=300,
                                       sampling_params={**params, "stream_interval": interval})
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    return out["meta_info"]["completion_tokens"], held.chunks


async def _run_mode(client: EngineClient, mode: str, input_ids: list[int], requests: int, params: dict,
                    engine_pid: int) -> dict:
    """``requests`` requests, ``CONCURRENCY`` in flight (each worker sends its next one when the last answered)."""
    left = list(range(requests))
    tokens = chunks = 0

    async def worker() -> None:
        nonlocal tokens, chunks
        while left:
            left.pop()
            t, c = await _one(client, mode, input_ids, params)
            tokens += t
            chunks += c

    cpu_before = _engine_cpu_seconds(engine_pid)
    began = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(CONCURRENCY)])
    seconds = time.perf_counter() - began
    cpu = _engine_cpu_seconds(engine_pid) - cpu_before
    return {"completion_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2),
            "chunks": chunks, "engine_cpu_s": round(cpu, 2)}


async def _measure(url: str, input_ids: list[int], modes: list[str], rounds: int, requests: int, params: dict,
                   engine_pid: int) -> list[dict]:
    async with EngineClient(url, timeout=300) as client:
        for mode in modes:  # warm-up: every path once, 16 wide
            await _run_mode(client, mode, input_ids, CONCURRENCY, {**params, "max_new_tokens": 8}, engine_pid)
        results = []
        for r in range(rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]  # each mode takes each position in turn
            round_result = {"order": order}
            for mode in order:
                round_result[mode] = await _run_mode(client, mode, input_ids, requests, params, engine_pid)
                print(f"round {r + 1} {mode}: {round_result[mode]}", flush=True)
            plain = round_result["plain"]["tokens_per_second"]
            round_result["streamed_over_plain"] = {
                m: round(round_result[m]["tokens_per_second"] / plain, 3) for m in modes if m != "plain"}
            results.append(round_result)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a Hugging Face checkpoint directory (default: build the tiny preset)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64, help="requests per mode and round (16 in flight)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--interval", type=int, default=16, help="stream_interval of the streamed mode "
                                                                 "(stream_1, SGLang's default, is run too)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the engine's torch threads")
    parser.add_argument("--out", default="benchmarks/results/stream_cost.json")
    args = parser.parse_args()
    modes = ["plain", *dict.fromkeys([f"stream_{args.interval}", "stream_1"])]
    params = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        model_dir, model_name = bench_model(args.model_path, tmp, parser)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        input_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                            return_dict=False)
        spec = builtin_spec(model_dir, "127.0.0.1", free_port(), str(Path(tmp) / "engine.log"),
                            options=BuiltinOptions(max_running_requests=64, num_threads=args.threads),
                            name="bench-engine")
        server = ServerProcess(spec)
        server.start()
        try:
            server.wait_healthy(timeout=300)
            rounds = asyncio.run(_measure(spec.url, input_ids, modes, args.rounds, args.requests, params, server.pid))
        finally:
            server.stop(grace_s=10)
    streamed = [m for m in modes if m != "plain"]
    report = {
        "benchmark": "stream_cost", "model": model_name, "concurrency": CONCURRENCY, "requests": args.requests,
        "max_new_tokens": args.max_new_tokens, "threads": args.threads, "machine": machine(),
        "rounds": rounds,
        "median": {
            "tokens_per_second": {m: statistics.median(r[m]["tokens_per_second"] for r in rounds) for m in modes},
            "streamed_over_plain": {m: statistics.median(r["streamed_over_plain"][m] for r in rounds)
                                    for m in streamed},
            "chunks_per_request": {m: statistics.median(r[m]["chunks"] / args.requests for r in rounds)
                                   for m in streamed},
            "engine_cpu_s": {m: statistics.median(r[m]["engine_cpu_s"] for r in rounds) for m in modes},
        },
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
