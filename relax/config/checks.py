"""Checks of what a run is given, made before anything starts (no Ray, no model load).

A corrupted checkpoint or a port another process holds would otherwise surface a minute into start-up,
as a traceback from deep inside transformers or uvicorn. Each check returns one line per problem, naming
the file or port and what to do.
"""

from __future__ import annotations

import errno
import json
import socket
import struct
from pathlib import Path

__all__ = ["check_hf_checkpoint", "check_port_free", "safetensors_problem"]


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None.

    The format is an 8-byte little-endian header length, a JSON header giving each tensor's byte range, then
    the data: a file shorter than the largest range is truncated (an interrupted copy or download).
    """
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{path} is not a safetensors file ({size} bytes, shorter than its header)"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            return f"{path} is not a safetensors file (its header length {n} does not fit the file's {size} bytes)"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return f"{path} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (its header is not a JSON object)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"{path} is not a safetensors file (tensor {name!r} has no data_offsets)"
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size < expected:
        return (f"{path} is truncated: {size} bytes, its header needs {expected}; the copy or download did not "
                "finish, copy it again")
    return None


def check_hf_checkpoint(path: str | None, flag: str = "--hf-checkpoint") -> list[str]:
    """Problems of a Hugging Face model directory: config.json parses, every weights file is complete."""
    if not path:
        return [f"{flag} is required (a Hugging Face model directory)"]
    p = Path(path)
    if not p.exists():
        return [f"{flag}: no such file or directory: {path}"]
    if not p.is_dir():
        return [f"{flag} {path} is not a directory (give the Hugging Face model directory)"]
    config = p / "config.json"
    if not config.is_file():
        return [f"{flag} {path} has no config.json (is it a Hugging Face model directory?)"]
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"{config} is not valid JSON ({exc}); re-save the model or restore the file"]
    if not isinstance(parsed, dict) or "model_type" not in parsed and "architectures" not in parsed:
        return [f"{config} has neither model_type nor architectures: not a Hugging Face model config"]
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        if any(p.glob("*.bin")):
            return []
        return [f"{flag} {path} holds no weights (*.safetensors)"]
    problems = []
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return [f"{index} is not a valid safetensors index (no weight_map)"]
        problems += [f"{index} names {s}, which is missing" for s in sorted(shards) if not (p / s).is_file()]
    problems += [m for m in (safetensors_problem(f) for f in weights) if m]
    return problems


def check_port_free(host: str, port: int, flag: str = "--api-port") -> str | None:
    """None when ``host:port`` can be bound now, else why not (checked again, for real, when the server binds)."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"{flag} {port}: {host}:{port} is already in use by another process (another run?); "
                        f"pick a free port with {flag} or stop that process")
            return f"{flag} {port}: cannot bind {host}:{port}: {exc.strerror or exc}"
    return None
