"""`relax demo --engine-only`: the built-in engine alone under a burst of concurrent requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console
from rich.table import Table

from relax.cluster.network import free_port
from relax.engines.client import EngineClient
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
from relax.engines.loadgen import run_burst, scrape_metrics
from relax.presets.ensure import ensure_preset


async def _measure(url: str, prompt: str, requests: int, concurrency: int, console: Console) -> None:
    seq = await run_burst(url, prompt, requests=max(4, requests // 8), concurrency=1, max_new_tokens=64)
    burst = await run_burst(url, prompt, requests=requests, concurrency=concurrency, max_new_tokens=64)
    table = Table(title="built-in engine throughput (64 new tokens per request)")
    for col in ("concurrency", "requests", "tokens", "seconds", "tokens/s", "p50 latency s", "p95 latency s"):
        table.add_column(col, justify="right")
    for r in (seq, burst):
        table.add_row(
            str(r.concurrency),
            str(r.requests),
            str(r.completion_tokens),
            f"{r.seconds:.2f}",
            f"{r.tokens_per_second:.0f}",
            f"{r.latency_quantile(0.5):.3f}",
            f"{r.latency_quantile(0.95):.3f}",
        )
    console.print(table)
    console.print(f"batching speed-up: [bold]{burst.tokens_per_second / seq.tokens_per_second:.1f}x[/]")
    async with EngineClient(url) as client:
        metrics = scrape_metrics(await client.metrics_text())
    shown = Table(title="engine /metrics after the burst")
    shown.add_column("metric")
    shown.add_column("value", justify="right")
    for name in sorted(metrics):
        if name.startswith(("sglang:", "relax:")):
            shown.add_row(name, f"{metrics[name]:.4g}")
    console.print(shown)


def run_engine_demo(workdir: Path, *, concurrency: int, requests: int, console: Console | None = None) -> int:
    console = console or Console()
    workdir.mkdir(parents=True, exist_ok=True)
    preset = ensure_preset(workdir, console=console)
    spec = builtin_spec(
        str(preset.model_dir),
        "127.0.0.1",
        free_port(),
        str(workdir / "engine.log"),
        options=BuiltinOptions(max_running_requests=64, num_threads=1),
        name="demo-engine",
    )
    server = ServerProcess(spec)
    console.print(f"[bold]2. built-in engine[/] → {spec.url} (log {spec.log_path})")
    server.start()
    try:
        server.wait_healthy(timeout=120)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(preset.model_dir))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is 4 + 5?"}], tokenize=False, add_generation_prompt=True
        )
        console.print(f"[bold]3. burst[/] of {requests} requests, {concurrency} at a time")
        asyncio.run(_measure(spec.url, prompt, requests, concurrency, console))
    finally:
        server.stop(grace_s=10)
    return 0
