"""What every benchmark does with its result: print it and save it as JSON (never a timed assertion)."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare two runs: cores and Python."""
    return {"cpus": os.cpu_count(), "python": platform.python_version()}


def save_report(report: dict[str, Any], out: str | Path) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    path.write_text(text + "\n")
    print(text)


def bench_model(model_path: str | None, tmp: str | Path, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """The benchmark's model: ``--model-path`` (a Hugging Face checkpoint directory), else the tiny preset built
    in ``tmp``; returns (directory, name for the report). A directory without config.json is a usage error."""
    if model_path:
        if not (Path(model_path) / "config.json").is_file():
            parser.error(f"--model-path {model_path}: no config.json there; pass a Hugging Face checkpoint "
                         f"directory (e.g. the model/ of `relax preset smollm2 --out DIR`)")
        return model_path, Path(model_path).resolve().as_posix()
    from relax.presets.tiny import build_tiny_preset

    return str(build_tiny_preset(Path(tmp) / "tiny").model_dir), "tiny preset"


def smollm2_preset(preset_dir: str | None, tmp: str | Path, benchmark: str) -> Any:
    """The smollm2 preset: ``--preset DIR`` when given, else built under ``tmp`` (~30 s); a missing dependency
    ends the benchmark with its one line and exit 2."""
    import sys

    from relax.presets.smollm2 import PresetDependencyError, build_smollm2_preset, load_smollm2_preset

    try:
        return load_smollm2_preset(Path(preset_dir)) if preset_dir else build_smollm2_preset(Path(tmp) / "p")
    except PresetDependencyError as exc:
        print(f"{benchmark}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
