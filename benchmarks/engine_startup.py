"""Built-in engine start-up: the native decoder beside transformers' model and tokenizer.

An elastic pool starts engines all the time (every scale-out, every replacement after a preemption), and the
test suite starts ~95 of them; what one costs before it can serve is wall time for the pool and CPU time for
the machine. Each round starts ``relax engine serve`` once per implementation (interleaved, so a machine that
speeds up or slows down affects both alike) and records:

- ``seconds_to_healthy``: from the launch (``ServerProcess``, as Relax starts engines) until the health
  probe answers 200;
- ``cpu_seconds``: the server process's user + system CPU at that moment (from ``/proc``);
- one greedy ``/generate`` afterwards, whose tokens must be the same for both implementations.

Prints and saves JSON (benchmarks/results/engine_startup.json); the ratios of the medians are the result,
absolute times are this machine's.

    python benchmarks/engine_startup.py [--model-path DIR] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from report import machine, save_report

from relax.cluster.network import free_port
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
from relax.presets.tiny import build_tiny_preset

IMPLS = ("transformers", "native")
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process (fields 14 and 15 of /proc/PID/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _start_once(model_dir: str, impl: str, log_path: Path) -> dict:
    """One start through the launcher Relax uses (the guard, then the server), to a healthy server."""
    options = BuiltinOptions(num_threads=1, model_impl=impl)
    server = ServerProcess(builtin_spec(model_dir, "127.0.0.1", free_port(), str(log_path), options=options,
                                        name=f"startup-{impl}"))
    began = time.perf_counter()
    server.start()
    try:
        server.wait_healthy(timeout=300, poll_interval=0.05)
        healthy_s = time.perf_counter() - began
        cpu_s = sum(_cpu_seconds(pid) for pid in _children(server.pid))  # the server, not its guard
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
            out = http.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {
                "temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
            out.raise_for_status()
            served_by = http.get("/server_info").json()["served_by"]
    finally:
        server.stop(grace_s=30)
    return {"seconds_to_healthy": round(healthy_s, 3), "cpu_seconds": round(cpu_s, 3), "served_by": served_by,
            "output_ids": out.json()["output_ids"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a Qwen3/Llama checkpoint directory (default: build the tiny preset)")
    parser.add_argument("--rounds", type=int, default=5, help="starts per implementation")
    parser.add_argument("--out", default="benchmarks/results/engine_startup.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        if args.model_path:
            model_dir = args.model_path
            if not (Path(model_dir) / "config.json").is_file():
                parser.error(f"--model-path {model_dir}: no config.json there; pass a Hugging Face checkpoint "
                             f"directory (e.g. the model/ of `relax preset smollm2 --out DIR`)")
        else:
            model_dir = str(build_tiny_preset(Path(tmp) / "tiny").model_dir)
        runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
        for round_ in range(args.rounds):
            for impl in IMPLS:
                runs[impl].append(_start_once(model_dir, impl, Path(tmp) / f"{impl}-{round_}.log"))
    outputs = {impl: {tuple(r["output_ids"]) for r in runs[impl]} for impl in IMPLS}
    summary = {impl: {
        "served_by": sorted({r["served_by"] for r in runs[impl]}),
        "median_seconds_to_healthy": round(statistics.median(r["seconds_to_healthy"] for r in runs[impl]), 3),
        "median_cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in runs[impl]), 3),
        "runs": [{k: v for k, v in r.items() if k != "output_ids"} for r in runs[impl]],
    } for impl in IMPLS}
    native, reference = summary["native"], summary["transformers"]
    report = {
        "benchmark": "engine_startup", "model": args.model_path or "tiny preset", "rounds": args.rounds,
        "machine": machine(), **summary,
        "cpu_seconds_saved_per_start": round(reference["median_cpu_seconds"] - native["median_cpu_seconds"], 3),
        "native_vs_transformers_seconds_to_healthy": round(
            native["median_seconds_to_healthy"] / reference["median_seconds_to_healthy"], 3),
        "native_vs_transformers_cpu_seconds": round(native["median_cpu_seconds"] / reference["median_cpu_seconds"], 3),
        "same_greedy_tokens": len(outputs["native"] | outputs["transformers"]) == 1,
    }
    save_report(report, args.out)


if __name__ == "__main__":
    main()
