"""`relax demo`: the main job end to end on the tiny preset.

- `relax demo` (what `make demo` runs): the recipe's flow on a local elastic Ray cluster
  (:mod:`relax.demo.elastic`).
- `relax demo --local`: fully-asynchronous GRPO through the real entrypoint on an embedded Ray cluster
  (2 trainer ranks, 2 built-in engines on logical GPUs); prints where the metrics and the plot are
  (:mod:`relax.demo.local`).
- `relax demo --engine-only`: the rollout engine alone under a burst of concurrent requests
  (:mod:`relax.demo.engine_only`).

This module only dispatches; each flavour's (heavy) imports happen when it runs.
"""

from __future__ import annotations

from pathlib import Path


def run_demo(workdir: Path, *, concurrency: int, requests: int, engine_only: bool = False, local: bool = False,
             num_rollout: int | None = None) -> int:
    from rich.console import Console

    console = Console()
    if engine_only:
        from relax.demo.engine_only import run_engine_demo

        return run_engine_demo(workdir, concurrency=concurrency, requests=requests, console=console)
    if local:
        from relax.demo.local import run_training_demo

        return run_training_demo(workdir, num_rollout=num_rollout or 60, console=console)
    from relax.demo.elastic import DEMO_NUM_ROLLOUT, run_elastic_demo

    return run_elastic_demo(workdir, num_rollout=num_rollout or DEMO_NUM_ROLLOUT, console=console)
