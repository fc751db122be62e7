"""CPU the rollout side spends per engine call: Relax's EngineClient (aiohttp) against the httpx client it replaced.

The rollout manager keeps one ``/generate`` in flight per sample, so an engine sees tens to hundreds of
concurrent connections from one client. What this measures is the *client's* CPU per request (process time of
the benchmark process over a fixed number of requests) at several concurrencies, against a stand-in server in
its own process that answers like SGLang's ``/generate`` (``text``, ``output_ids``, ``meta_info`` with per-token
logprobs) after a fixed delay, so the server's own speed does not enter the client's figure.

The two clients alternate for ``--rounds`` rounds in one run: compare them with each other within a run, not
across machines. The httpx client is built as EngineClient built it before (``max_connections=1024``,
``max_keepalive_connections=64``, ``trust_env=False``); its pool walks every pooled connection (and polls its
socket) on each request, so its CPU per request grows with the number in flight.

    python benchmarks/engine_client.py [--requests 2000] [--concurrency 8,64,256] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from report import machine, save_report

from relax.cluster.network import free_port
from relax.engines.client import EngineClient

SERVER = """
import asyncio, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

DELAY_S, TOKENS = float(sys.argv[2]), int(sys.argv[3])

async def generate(request):
    await request.json()
    await asyncio.sleep(DELAY_S)
    return JSONResponse({"text": "x" * TOKENS, "output_ids": list(range(TOKENS)), "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": TOKENS}, "completion_tokens": TOKENS,
        "output_token_logprobs": [[-0.5, i, None] for i in range(TOKENS)], "weight_version": "0"}})

async def health(request):
    return JSONResponse({})

app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

PAYLOAD = {"input_ids": list(range(64)), "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
           "return_logprob": True}


async def _relax(url: str, concurrency: int, total: int) -> float:
    async with EngineClient(url, timeout=60) as client:
        return await _drive(lambda: client.generate(**PAYLOAD), concurrency, total)


async def _httpx(url: str, concurrency: int, total: int) -> float:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False, limits=limits) as client:
        async def one() -> Any:
            response = await client.post("/generate", json=PAYLOAD)
            response.raise_for_status()
            return response.json()
        return await _drive(one, concurrency, total)


async def _drive(call, concurrency: int, total: int) -> float:
    """CPU milliseconds per request over ``total`` requests with ``concurrency`` in flight (after a warm-up)."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await call()

    await asyncio.gather(*(one() for _ in range(min(total, 2 * concurrency))))  # the pool fills first
    began = time.process_time()
    await asyncio.gather(*(one() for _ in range(total)))
    return (time.process_time() - began) / total * 1000


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the stand-in server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the stand-in server at {url} did not answer in {timeout}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement (default 2000)")
    parser.add_argument("--concurrency", default="8,64,256", help="comma-separated in-flight counts")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two clients (default 2)")
    parser.add_argument("--delay", type=float, default=0.05, help="the server's answer delay in s (default 0.05)")
    parser.add_argument("--quick", action="store_true", help="500 requests, 1 round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_client.json"))
    args = parser.parse_args()
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if args.requests < 1 or args.rounds < 1 or not levels or min(levels) < 1:
        parser.error("--requests, --rounds and every --concurrency must be at least 1")
    requests, rounds = (500, 1) if args.quick else (args.requests, args.rounds)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.delay), "16"])
    try:
        _wait_healthy(url, server)
        runs: dict[str, dict[int, list[float]]] = {"relax_aiohttp": {}, "httpx": {}}
        for _ in range(rounds):
            for level in levels:
                for name, fn in (("relax_aiohttp", _relax), ("httpx", _httpx)):
                    runs[name].setdefault(level, []).append(round(asyncio.run(fn(url, level, requests)), 3))
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows = []
    for level in levels:
        ours = round(statistics.median(runs["relax_aiohttp"][level]), 3)
        theirs = round(statistics.median(runs["httpx"][level]), 3)
        rows.append({"concurrency": level, "relax_cpu_ms_per_request": ours, "httpx_cpu_ms_per_request": theirs,
                     "httpx_over_relax": round(theirs / ours, 1)})
        print(f"concurrency {level:4d}: EngineClient {ours:.2f} ms CPU/request, httpx {theirs:.2f} ms "
              f"({theirs / ours:.1f}x)")
    report = {"benchmark": "engine_client", "machine": machine(), "requests": requests, "rounds": rounds,
              "server_delay_s": args.delay, "runs": {k: {str(c): v for c, v in r.items()} for k, r in runs.items()},
              "results": rows}
    save_report(report, args.out)
    print(json.dumps({"results": rows}))


if __name__ == "__main__":
    main()
