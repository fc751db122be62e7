"""What every benchmark does with its result: print it and save it as JSON (never a timed assertion)."""

from __future__ import annotations

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
