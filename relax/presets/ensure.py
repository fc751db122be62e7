"""Build (or rebuild, byte-identically) the tiny preset under a work directory, saying what was built."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from relax.presets.tiny import TinyPreset, build_tiny_preset, describe


def ensure_preset(workdir: Path, *, console: Console | None = None) -> TinyPreset:
    """The tiny preset under ``workdir/tiny``; prints its location and description on ``console``."""
    console = console or Console()
    preset_dir = workdir / "tiny"
    console.print(f"[bold]1. tiny preset[/] → {preset_dir}")
    preset = build_tiny_preset(preset_dir)
    console.print(describe(preset))
    return preset
