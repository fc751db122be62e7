"""`relax demo --local`: fully-asynchronous GRPO through the real entrypoint on an embedded Ray cluster.

2 trainer ranks and 2 built-in engines on logical GPUs; prints where the metrics and the plot are.
:func:`train_argv` (the recipe's flags sized for a preset: the tiny one by default, or smollm2's with its
own GRPO settings) also drives the end-to-end tests and the benchmarks.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from rich.console import Console

from relax.presets.ensure import ensure_preset
from relax.presets.tiny import GRPO_DEFAULTS


class Preset(Protocol):
    """What a run needs of a preset (TinyPreset and SmolLM2Preset both have it)."""

    @property
    def model_dir(self) -> Path: ...
    @property
    def train_path(self) -> Path: ...


def train_argv(
    preset: Preset,
    out_dir: Path,
    *,
    num_rollout: int,
    max_staleness: int = 1,
    trainer_gpus: int = 2,
    rollout_gpus: int = 2,
    grpo: Mapping[str, float | int] = GRPO_DEFAULTS,
    rm_type: str = "tiny",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The recipe's entrypoint and flags, sized for a preset on a CPU machine (default: the tiny one)."""
    d = grpo
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
        rm_type,
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


def set_aside(path: Path, console: Console) -> None:
    """A demo starts a new run each time: a previous run's directory is renamed (kept), not reused.

    One output directory belongs to one run (the driver refuses another run's outputs), and a demo is not a resume.
    """
    if path.exists() and any(path.iterdir()):
        kept = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(kept)
        console.print(f"   the previous run's {path.name}/ is kept as {kept}", style="dim")


def run_training_demo(workdir: Path, *, num_rollout: int, console: Console | None = None) -> int:
    console = console or Console()
    workdir.mkdir(parents=True, exist_ok=True)
    preset = ensure_preset(workdir, console=console)
    out = workdir / "run"
    set_aside(out, console)
    set_aside(workdir / "checkpoints", console)
    argv = train_argv(
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
