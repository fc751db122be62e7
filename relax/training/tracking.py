"""Experiment tracking with Weights & Biases: ``--use-wandb`` (docs/training.md, "Experiment tracking (W&B)").

One concept: a W&B run that mirrors the run's ``metrics.jsonl``. The driver starts it once (after it knows
whether it resumes), hands it every row it writes (``step=`` the row's training step), gives it the summary and
the training plot at the end, and finishes it at shutdown. A resumed run (``--load`` with a checkpoint) goes on
in the same W&B run: the id the first segment used is kept in ``<output-dir>/wandb-run-id`` (one output
directory holds one run) unless ``--wandb-run-id`` names one.

Tracking never stops training: a failure to start W&B, or one while logging (a full disk, a dead W&B service),
is one warning line, after which the run goes on without W&B. ``wandb`` is imported only when ``--use-wandb``
is given, so a run without it pays nothing.

The run's config is its parsed flags with every secret removed (``run_config``): ``--wandb-key``, and any flag
or passthrough named like a key, token, secret or password. W&B also records the command line
(``sys.argv``) in the run's metadata; it is scrubbed the same way while the run starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import string
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from enum import Enum
from pathlib import Path
from typing import Any

from relax.logs import failure_cause

log = logging.getLogger("relax.train")

MODES = ("online", "offline")
RUN_ID_FILE = "wandb-run-id"
"""In ``--output-dir``: the W&B run id of the run that directory holds, reused when it resumes."""
PLOT_KEY = "training_plot"
MASK = "***"

# A secret by its name (a flag, a TrainArgs field, an ``--sglang-*`` passthrough): names ending in these words.
# Not "key" alone: --input-key, --label-key and --reward-key name data columns.
_SECRET_NAME = re.compile(r"(^|_)(api_key|wandb_key|access_key|secret_key|private_key|token|secret|password|passwd|"
                          r"credentials?)$")
_OMITTED_FIELDS = frozenset({"argv", "sglang_passthrough"})  # replaced by their scrubbed forms below


def is_secret_name(name: str) -> bool:
    """Whether a flag (``--wandb-key``, ``--sglang-api-key=x``) or field name (``wandb_key``) holds a secret."""
    normalized = name.split("=", 1)[0].lstrip("-").replace("-", "_").lower()
    return bool(_SECRET_NAME.search(normalized))


def scrub_argv(argv: Sequence[str], secret_values: Sequence[str] = ()) -> list[str]:
    """``argv`` with the value of every secret flag (``--wandb-key K``, ``--sglang-api-key=K``) masked, and any
    token equal to a known secret value masked too."""
    values = {v for v in secret_values if v}
    shown: list[str] = []
    previous_secret = False
    for token in argv:
        name, has_value, _ = token.partition("=")
        if previous_secret and not token.startswith("--"):
            shown.append(MASK)
        elif token.startswith("--") and is_secret_name(name) and has_value:
            shown.append(f"{name}={MASK}")
        else:
            shown.append(MASK if token in values else token)
        previous_secret = token.startswith("--") and is_secret_name(name) and not has_value
    return shown


def _plain(value: Any) -> Any:
    """A config value as W&B stores it: enums by value, tuples as lists."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def run_config(args: Any) -> dict[str, Any]:
    """The W&B run config: every parsed flag (a ``TrainArgs``), without secrets.

    Secret fields are left out, not masked; the command line (``argv``) is kept with secret values masked; the
    ``--sglang-*`` passthroughs are kept except the secret ones.
    """
    config = {f.name: _plain(getattr(args, f.name)) for f in dataclasses.fields(args)
              if f.name not in _OMITTED_FIELDS and not is_secret_name(f.name)}
    hidden = [str(getattr(args, f.name)) for f in dataclasses.fields(args)
              if is_secret_name(f.name) and getattr(args, f.name)]
    config["argv"] = scrub_argv(args.argv, hidden)
    config["sglang_passthrough"] = {name: list(values) for name, values in args.sglang_passthrough
                                    if not is_secret_name(name)}
    return config


def resolve_mode(flag: str | None, environ: Mapping[str, str]) -> str:
    """``--wandb-mode`` wins; else ``WANDB_MODE`` (online, offline, or disabled; ``dryrun`` is offline); else
    online."""
    if flag:
        return flag
    env = environ.get("WANDB_MODE", "").strip().lower()
    if env == "dryrun":
        return "offline"
    return env if env in (*MODES, "disabled") else "online"


def choose_run_id(flag_id: str | None, stored_id: str | None, resuming: bool, new_id: str) -> str:
    """The W&B run id: ``--wandb-run-id`` when given; on a resume, the id the run stored at its first start;
    else a new one."""
    if flag_id:
        return flag_id
    if resuming and stored_id:
        return stored_id
    return new_id


def new_run_id() -> str:
    """A fresh W&B run id: 8 characters of [a-z0-9], as W&B makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def read_run_id(run_dir: Path) -> str | None:
    """The id stored in ``run_dir`` (``RUN_ID_FILE``), or None when there is none or it cannot be read."""
    try:
        text = (run_dir / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text or None


def scalars(row: Mapping[str, Any]) -> dict[str, float | int | bool]:
    """The per-step values of a ``metrics.jsonl`` row that W&B charts: numbers and booleans, ``step`` and
    ``kind`` left out (``step`` is the W&B step)."""
    return {k: v for k, v in row.items() if k not in ("step", "kind") and isinstance(v, int | float)}


class Tracking:
    """No tracking (a run without ``--use-wandb``): every call does nothing."""

    def log(self, row: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` row (train or eval), at its step."""

    def end(self, summary: Mapping[str, Any], plot: Path | None) -> None:
        """The run ended normally (also on a SIGTERM's clean stop): its summary and its training plot."""

    def finish(self) -> None:
        """Shutdown; a run that never reached ``end`` is marked failed."""


NO_TRACKING = Tracking()


class WandbTracking(Tracking):
    """A live W&B run. The first failure of any call is logged in one line and turns tracking off."""

    def __init__(self, wandb: Any, run: Any) -> None:
        self._wandb = wandb
        self._run = run
        self.run_id: str = run.id
        self._step = 0
        self._ended = False

    def _failed(self, what: str, exc: BaseException) -> None:
        log.warning("W&B %s failed (%s); training goes on without W&B", what, failure_cause(exc, 200))
        run, self._run = self._run, None
        with suppress(Exception):  # already reported; nothing more to say
            run.finish(exit_code=1)
        self._teardown()

    def _teardown(self) -> None:
        """Stop W&B's service process (wandb-core), so that nothing of W&B outlives the run."""
        with suppress(Exception):  # best effort at shutdown
            self._wandb.teardown()

    def log(self, row: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        try:
            step = int(row["step"])
            self._run.log(scalars(row), step=step)
            self._step = max(self._step, step)
        except Exception as exc:  # noqa: BLE001 - tracking never stops training
            self._failed("logging", exc)

    def end(self, summary: Mapping[str, Any], plot: Path | None) -> None:
        self._ended = True
        if self._run is None:
            return
        try:
            self._run.summary.update({f"summary/{k}": v for k, v in summary.items() if v is not None})
            if plot is not None and Path(plot).is_file():
                self._run.log({PLOT_KEY: self._wandb.Image(str(plot))}, step=self._step)
        except Exception as exc:  # noqa: BLE001
            self._failed("logging the summary", exc)

    def finish(self) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish(exit_code=0 if self._ended else 1)
        except Exception as exc:  # noqa: BLE001
            log.warning("W&B finish failed (%s)", failure_cause(exc, 200))
        self._teardown()


@contextmanager
def _argv_scrubbed(secret_values: Sequence[str]) -> Iterator[None]:
    """W&B records ``sys.argv`` in the run's metadata when the run starts: show it the masked command line."""
    original = sys.argv
    sys.argv = [*original[:1], *scrub_argv(original[1:], secret_values)]
    try:
        yield
    finally:
        sys.argv = original


def start(args: Any, run_dir: Path, resuming: bool, environ: Mapping[str, str] | None = None,
          api_key: str | None = None) -> Tracking:
    """Start the W&B run of ``args`` (a ``TrainArgs``) when ``--use-wandb`` is given, else ``NO_TRACKING``.

    ``api_key``: ``--wandb-key``, or the ``WANDB_API_KEY`` the driver took out of its environment before Ray
    started (``relax.cluster.secret_env``); None leaves W&B to its own login (``~/.netrc``).

    ``resuming``: this segment continues from a checkpoint (the W&B run continues too). Offline runs write under
    ``<run_dir>/wandb/`` (``wandb sync`` uploads them later); online ones keep their local copy there too.
    """
    if not args.use_wandb:
        return NO_TRACKING
    environ = os.environ if environ is None else environ
    mode = resolve_mode(args.wandb_mode, environ)
    if mode == "disabled":
        log.warning("--use-wandb: WANDB_MODE=disabled; this run logs nothing to W&B")
        return NO_TRACKING
    try:
        import wandb
    except ImportError as exc:  # pre-flight (relax.config.checks.check_wandb) says so before Ray starts
        log.warning("--use-wandb: %s; training goes on without W&B (pip install 'relax[wandb]')", exc)
        return NO_TRACKING
    try:
        run_id = choose_run_id(args.wandb_run_id, read_run_id(run_dir), resuming, new_run_id())
        settings: dict[str, Any] = {}
        if args.wandb_host:
            settings["base_url"] = args.wandb_host
        if api_key and mode == "online":  # used for this run only: not written to ~/.netrc
            settings["api_key"] = api_key
        run_dir.mkdir(parents=True, exist_ok=True)
        with _argv_scrubbed([args.wandb_key] if args.wandb_key else []):
            run = wandb.init(
                project=args.wandb_project or "relax", entity=args.wandb_team, group=args.wandb_group,
                id=run_id, name=Path(args.output_dir).resolve().name, resume="allow", mode=mode,
                dir=str(run_dir), config=run_config(args), allow_val_change=True,  # a resume may change flags
                settings=wandb.Settings(**settings),
            )
    except Exception as exc:  # noqa: BLE001 - tracking never stops training
        log.warning("--use-wandb: W&B could not start (%s); training goes on without W&B", failure_cause(exc, 200))
        with suppress(Exception):
            wandb.teardown()
        return NO_TRACKING
    from relax.training.durable import atomic_write_text

    try:
        atomic_write_text(run_dir / RUN_ID_FILE, run.id + "\n")
    except OSError as exc:
        log.warning("W&B run %s: cannot store its id in %s (%s); a resume will start a new W&B run unless given "
                    "--wandb-run-id %s", run.id, run_dir / RUN_ID_FILE, exc, run.id)
    log.info("W&B run %s %s (%s mode, project %s)", run.id, "continues" if resuming else "started", mode,
             args.wandb_project or "relax")
    return WandbTracking(wandb, run)
