"""`relax demo`: the main job end to end on the tiny preset.

- `relax demo` (what `make demo` runs): the recipe's flow on a local elastic Ray cluster — see
  `relax.elastic_demo`.
- `relax demo --local`: fully-asynchronous GRPO through the real entrypoint on an embedded Ray cluster
  (2 trainer ranks, 2 built-in engines on logical GPUs); prints where the metrics and the plot are.
- `relax demo --engine-only`: the rollout engine alone under a burst of concurrent requests.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from relax.cluster.network import free_port
from relax.engines.client import EngineClient
from relax.engines.launcher import BuiltinOptions, ServerProcess, builtin_spec
from relax.engines.loadgen import run_burst, scrape_metrics
from relax.presets.tiny import GRPO_DEFAULTS, TinyPreset, build_tiny_preset, describe

console = Console()


def ensure_preset(workdir: Path) -> TinyPreset:
    preset_dir = workdir / "tiny"
    console.print(f"[bold]1. tiny preset[/] → {preset_dir}")
    preset = build_tiny_preset(preset_dir)
    console.print(describe(preset))
    return preset


async def _measure(url: str, prompt: str, requests: int, concurrency: int) -> None:
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


def run_engine_demo(workdir: Path, *, concurrency: int, requests: int) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    preset = ensure_preset(workdir)
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
        asyncio.run(_measure(spec.url, prompt, requests, concurrency))
    finally:
        server.stop(grace_s=10)
    return 0


def tiny_train_argv(
    preset: TinyPreset,
    out_dir: Path,
    *,
    num_rollout: int,
    max_staleness: int = 1,
    trainer_gpus: int = 2,
    rollout_gpus: int = 2,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The recipe's entrypoint and flags, sized for the tiny preset on a CPU machine (GRPO_DEFAULTS)."""
    d = GRPO_DEFAULTS
    batch = int(d["rollout_batch_size"]) * int(d["n_samples_per_prompt"])
    return [
        sys.executable,
        "-m",
        "relax.entrypoints.train",
        "--fully-async",
        "--resource",
        f'{{"actor": [1, {trainer_gpus}], "rollout": [1, {rollout_gpus}]}}',
        "--rollout-num-gpus-per-engine",
        "1",
        "--hf-checkpoint",
        str(preset.model_dir),
        "--prompt-data",
        str(preset.train_path),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--rollout-shuffle",
        "--rm-type",
        "tiny",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        str(d["rollout_batch_size"]),
        "--n-samples-per-prompt",
        str(d["n_samples_per_prompt"]),
        "--rollout-max-response-len",
        str(d["max_new_tokens"]),
        "--rollout-temperature",
        str(d["temperature"]),
        "--global-batch-size",
        str(batch),
        "--lr",
        str(d["lr"]),
        "--adam-beta2",
        "0.98",
        "--eps-clip",
        str(d["eps_clip"]),
        "--eps-clip-high",
        str(d["eps_clip_high"]),
        "--use-tis",
        "--calculate-per-token-loss",
        "--max-staleness",
        str(max_staleness),
        "--output-dir",
        str(out_dir),
        *extra,
    ]


def run_training_demo(workdir: Path, *, num_rollout: int) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    preset = ensure_preset(workdir)
    out = workdir / "run"
    argv = tiny_train_argv(
        preset,
        out,
        num_rollout=num_rollout,
        extra=(
            "--eval-prompt-data",
            "tiny",
            str(preset.eval_path),
            "--eval-interval",
            str(num_rollout),
            "--n-samples-per-eval-prompt",
            "4",
            "--save",
            str(workdir / "checkpoints"),
            "--save-interval",
            str(num_rollout),
        ),
    )
    console.print(
        f"[bold]2. fully-async GRPO[/]: {num_rollout} steps, 2 trainer ranks + 2 engines on an embedded Ray cluster"
    )
    console.print("   " + " ".join(argv[1:]), style="dim", soft_wrap=True)
    return subprocess.call(argv)


def run_demo(workdir: Path, *, concurrency: int, requests: int, engine_only: bool = False, local: bool = False,
             num_rollout: int | None = None) -> int:
    if engine_only:
        return run_engine_demo(workdir, concurrency=concurrency, requests=requests)
    if local:
        return run_training_demo(workdir, num_rollout=num_rollout or 60)
    from relax.elastic_demo import DEMO_NUM_ROLLOUT, run_elastic_demo

    return run_elastic_demo(workdir, num_rollout=num_rollout or DEMO_NUM_ROLLOUT, console=console)
