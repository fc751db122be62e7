"""Durable file writes: after a crash a reader finds the old file or the new one, never a torn one.

Run outputs are rewritten in place when a run resumes (the metrics and per-sample logs lose the steps done
again) and checkpoints are named by a one-line pointer; a half-written file in either place would turn a
crash into lost state. Write to a temporary file beside the target, fsync it, ``os.replace`` it over the
target (atomic on POSIX within one filesystem), then fsync the directory so the rename itself survives.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> Path:
    """Replace ``path``'s contents with ``text`` atomically; the temporary file never outlives the call."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable where the platform allows it (best effort: not on every filesystem)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
