"""Checks of what a run is given, made before anything starts (no Ray, no model load).

A corrupted checkpoint or a port another process holds would otherwise surface a minute into start-up,
as a traceback from deep inside transformers or uvicorn. Each check returns one line per problem, naming
the file or port and what to do.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunDirDecision", "RunOutputs", "check_api_host", "check_hf_checkpoint", "check_load", "check_model_type",
           "check_port_free", "check_sglang_python", "check_wandb", "check_weight_shapes", "find_run_outputs",
           "is_loopback_host", "run_dir_decision", "safetensors_problem", "wandb_key_warning"]


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
    unknown = check_model_type(config, parsed)
    if unknown:
        return [unknown]
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


WANDB_INSTALL = "pip install 'relax[wandb]'"


def check_wandb(use_wandb: bool) -> str | None:
    """``--use-wandb`` needs the ``wandb`` package: None when it is installed (or not asked for), else the fix."""
    import importlib.util

    if not use_wandb or importlib.util.find_spec("wandb") is not None:
        return None
    return f"--use-wandb needs the wandb package, which is not installed: {WANDB_INSTALL}"


def wandb_key_warning(wandb_key: str | None) -> str | None:
    """``--wandb-key`` works, but a command line is public: every user of the machine reads it with ``ps`` for
    as long as the driver runs. None without the flag, else the warning with the better ways."""
    if not wandb_key:
        return None
    return ("--wandb-key: the command line is readable by every user of this machine (ps, /proc) for the whole "
            "run; prefer WANDB_API_KEY in the driver's environment (Relax keeps it out of Ray's and the engines' "
            "processes) or `wandb login` (~/.netrc)")


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


def check_sglang_python(path: str | None, flag: str = "--sglang-python") -> str | None:
    """None when ``path`` (the SGLang interpreter, if one is given) is an executable file, else why not.

    Checked on the driver's node: the engine nodes are expected to share its image (or its file system);
    whether SGLang is installed for it is asked on an engine's node when the engines start.
    """
    if not path:
        return None
    target = Path(path)
    if not target.exists():
        return (f"{flag} {path}: no such file; give the Python of SGLang's environment (e.g. /opt/sglang/bin/python)"
                ", or leave it out to run SGLang with Relax's own interpreter")
    if target.is_dir() or not os.access(target, os.X_OK):
        return f"{flag} {path}: not an executable file; give the Python of SGLang's environment (e.g. .../bin/python)"
    return None


_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback_host(host: str) -> bool:
    """Whether a listener on ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: loopback only when every address it resolves to is
        try:
            infos = socket.getaddrinfo(name, None)
        except OSError:
            return False
        addresses = {info[4][0] for info in infos}
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_api_host(host: str, environ: Mapping[str, str] = os.environ,
                   token_env: str = "RELAX_API_TOKEN") -> str | None:
    """A control plane on a non-loopback host needs an operator's token (``RELAX_API_TOKEN``), else why not.

    Every run has a token (a random one when none is set), but a random one is written on the driver's node
    only: from another machine nobody could use the API it opens to the network.
    """
    if is_loopback_host(host) or (environ.get(token_env) or "").strip():
        return None
    return (f"--api-host {host} opens the control plane beyond this machine, which needs a token you know: set "
            f"{token_env} (e.g. export {token_env}=$(openssl rand -hex 32)), or keep --api-host 127.0.0.1 and "
            "reach it with ssh -L (docs/elastic.md, \"Reaching the control plane\")")


def check_model_type(config: Path, parsed: dict) -> str | None:
    """Why transformers cannot build the model ``config.json`` describes (an unknown ``model_type``), or None.

    A config that brings its own code (``auto_map``) is left to ``--trust-remote-code`` and the model's load.
    """
    model_type = parsed.get("model_type")
    if not isinstance(model_type, str) or "auto_map" in parsed:
        return None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return None
    return (f"{config}: model_type {model_type!r} is not a model type transformers {transformers.__version__} "
            "knows; fix config.json, or use a transformers release that has this model")


def check_weight_shapes(path: str | Path, expected: Mapping[str, Sequence[int]] | None = None,
                        flag: str = "--hf-checkpoint") -> list[str]:
    """Tensors of the weights files whose shape is not the one the model of ``config.json`` has (one line each).

    ``expected`` gives every weight's shape by name (the built-in engine's decoder knows them for Qwen3/Llama
    in milliseconds); without it the model is built by transformers on torch's meta device (no memory, no
    weights read; ~2 s of imports). Compared with the safetensors headers, a file whose header is valid but
    whose tensors belong to another model size fails here, not when the trainer and every engine load it.
    Names the model does not have are left to the load.
    """
    from safetensors import safe_open

    p = Path(path)
    if expected is None:
        expected = _transformers_shapes(p)
        if expected is None:
            return []
    problems = []
    for weights in sorted(p.glob("*.safetensors")):
        with safe_open(str(weights), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = tuple(f.get_slice(name).get_shape())
                want = expected.get(name)
                if want is not None and shape != tuple(want):
                    problems.append(f"{weights}: tensor {name} has shape {list(shape)}, the model of config.json "
                                    f"needs {list(want)}; the weights and config.json are of different models")
                    if len(problems) >= 3:
                        return [*problems, f"({flag}: further mismatches not listed)"]
    return problems


def _transformers_shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a model transformers cannot build here is reported by the load itself
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_load(load: str | None, save: str | None) -> str | None:
    """Why ``--load`` cannot resume anything, or None (one line, before anything starts).

    ``--load`` pointing at ``--save`` on a run's first start (slime's idiom) is fine: there is nothing there yet
    and the run starts from ``--hf-checkpoint``.
    """
    if not load:
        return None
    p = Path(load)
    same_as_save = save is not None and p.resolve() == Path(save).resolve()
    if not p.exists():
        if same_as_save:
            return None
        return (f"--load {load}: no such directory; give a checkpoint directory or the --save directory of an earlier "
                "run (or leave --load out to start from --hf-checkpoint)")
    if not p.is_dir():
        return f"--load {load} is not a directory (give a checkpoint directory or a --save directory)"
    has_checkpoints = (p / "trainer_state.json").is_file() or any(c.name.startswith("step_") for c in p.iterdir())
    is_hf_model = (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))
    if is_hf_model and not has_checkpoints:
        return (f"--load {load} is a Hugging Face model directory, not a Relax checkpoint: give it as "
                "--hf-checkpoint (--load resumes a run from its --save directory or one of its checkpoints)")
    return None


# --------------------------------------------------------------------------------------------------
# One output directory, one run

#: Files of an output directory that hold one row per step (``metrics.jsonl`` counts steps from 1, the per-sample
#: records from 0): a second run appending to them would log its steps a second time.
STEP_FILES = ("metrics.jsonl", "sample_versions.jsonl", "samples.jsonl")
EVENT_FILE_PREFIX = "events.out.tfevents."


@dataclass(frozen=True)
class RunOutputs:
    """What an earlier run logged in an output directory: the files with step rows in them (display names) and
    the last step of ``metrics.jsonl`` (None when it has no readable row)."""

    files: tuple[str, ...] = ()
    last_step: int | None = None


@dataclass(frozen=True)
class RunDirDecision:
    """``fresh`` (nothing logged there yet), ``resume`` (the run there goes on from the checkpoint's step: what it
    logged after that step is dropped, the rest kept) or ``refuse`` (``problem`` says why, in one line)."""

    action: str
    problem: str | None = None


def run_dir_decision(outputs: RunOutputs, resume_step: int | None, output_dir: str,
                     load: str | None = None) -> RunDirDecision:
    """What a start into ``output_dir`` does, given what is there and the step ``--load`` resumes from.

    ``resume_step`` is the step of the complete checkpoint ``--load`` resumes from (None: the run starts from
    ``--hf-checkpoint``). A resume continues the run directory whatever it holds (its rows after the step are
    dropped, so no step is logged twice); a start from step 0 into a directory where another run logged steps
    is refused: its rows would be logged again beside theirs.
    """
    if resume_step is not None:
        return RunDirDecision("resume")
    if not outputs.files:
        return RunDirDecision("fresh")
    held = ", ".join(outputs.files)
    if outputs.last_step is not None:
        held += f"; metrics up to step {outputs.last_step}"
    why = (f"--load {load} holds no complete checkpoint to resume it from" if load
           else "this run would log its steps again beside them")
    return RunDirDecision("refuse", (
        f"--output-dir {output_dir} holds another run's outputs ({held}) and {why}: give this run a fresh "
        "--output-dir, or resume that run with --load <its --save directory>"))


def find_run_outputs(output_dir: str | Path, tensorboard_dir: str | Path | None = None) -> RunOutputs:
    """The step rows an earlier run left in ``output_dir`` (and its TensorBoard directory): non-empty
    ``STEP_FILES`` and event files holding more than their header record."""
    out = Path(output_dir)
    files: list[str] = []
    last_step: int | None = None
    for name in STEP_FILES:
        path = out / name
        if not _has_a_row(path):
            continue
        files.append(name)
        if name == "metrics.jsonl":
            last_step = _last_step(path)
    if tensorboard_dir is not None:
        tb = Path(tensorboard_dir)
        try:
            events = [p for p in tb.iterdir() if p.name.startswith(EVENT_FILE_PREFIX) and _holds_events(p)]
        except OSError:
            events = []
        if events:
            try:
                where = str(tb.resolve().relative_to(out.resolve()))
            except ValueError:
                where = str(tb)
            files.append(f"{len(events)} TensorBoard event file{'s' if len(events) > 1 else ''} in {where}")
    return RunOutputs(tuple(files), last_step)


def _has_a_row(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return any(line.strip() for line in iter(lambda: fh.readline(1 << 16), b""))
    except OSError:
        return False


def _last_step(path: Path) -> int | None:
    last = None
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            last = step if last is None else max(last, step)
    return last


def _holds_events(path: Path) -> bool:
    """Whether a TensorBoard event file holds more than the version record every writer starts it with.

    The file is TFRecords: an 8-byte little-endian length, a 4-byte CRC, the data, a 4-byte CRC. A run that
    stopped before its first step leaves only the first record; a second complete record means logged values.
    """
    try:
        with path.open("rb") as fh:
            for _ in range(2):
                head = fh.read(12)
                if len(head) < 12:
                    return False
                (n,) = struct.unpack("<Q", head[:8])
                body = fh.read(n + 4)
                if len(body) < n + 4:
                    return False
    except OSError:
        return False
    return True
