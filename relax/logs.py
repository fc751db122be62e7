"""One logging set-up for every Relax process: operator-facing lines, no per-request noise.

And ``failure_cause``: an exception (Ray's included) as the one line an operator needs.
"""

from __future__ import annotations

import logging
import os
import re
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log every HTTP request at INFO: thousands of lines per training step.
QUIET = ("httpx", "httpcore", "urllib3", "matplotlib", "filelock")


#: The run's ``--log-level``, handed to every process it starts (Ray workers get it in their runtime env).
LOG_LEVEL_ENV = "RELAX_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level() -> int:
    """The level of this process: ``RELAX_LOG_LEVEL`` (``--log-level``), INFO when unset or unknown."""
    name = os.environ.get(LOG_LEVEL_ENV, "info").strip().lower()
    return getattr(logging, name.upper()) if name in LOG_LEVELS else logging.INFO


def setup_logging(level: int | None = None) -> None:
    """Relax's format at the run's level. Per-step lines of actors are DEBUG: the driver's one line per step is
    what an operator follows (``--log-level debug`` shows the rest)."""
    level = log_level() if level is None else level
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger("relax").setLevel(level)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


# --------------------------------------------------------------------------------------------------
# Failure causes in one line
#
# Why here: an operator reads an engine's failure in a log line, an event and the engine's ``error`` field,
# and Ray's errors are written for a terminal: their first line is an ANSI-coloured task name
# ("\x1b[36mray::EngineActor.start()\x1b[39m (pid=..., ip=...)") or a generic sentence ("The actor died
# unexpectedly before finishing this task."), with the cause at the end of a traceback or after the actor's
# context lines. ``failure_cause`` digs the cause out. It is pure and does not import Ray (every Relax process
# imports this module): an exception can only be one of Ray's if ``ray.exceptions`` is already loaded.

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# An unindented "pkg.mod.SomeError: message" (or "RayTaskError(ValueError): ...") line: how a traceback ends.
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault)\w*(?:\([\w.]+\))?)(?::\s*(?P<message>.*))?$"
)
# The context lines ActorDiedError puts between its generic sentence and the cause ("\tpid: 1234").
_ACTOR_CONTEXT_LINE = re.compile(r"^\t(?:class_name|actor_id|pid|name|namespace|ip): ")
_ACTOR_DIED = "The actor died unexpectedly before finishing this task."
_CREATION_TASK = "raised in its creation task"


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, cursor moves, OSC titles)."""
    return _ANSI.sub("", text)


def _one_line(text: str, limit: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: max(0, limit - 3)] + "..."


def _last_exception_line(text: str) -> str | None:
    """The last "Type: message" line of a traceback-like text, e.g. the innermost error Ray printed."""
    for line in reversed(text.splitlines()):
        match = _EXCEPTION_LINE.match(line.rstrip())
        if match:
            name = re.sub(r"^[\w.]*\.", "", match.group("type"))  # ray.exceptions.X(Y) -> X(Y), builtins.E -> E
            message = (match.group("message") or "").strip()
            return f"{name}: {message}" if message else name
    return None


def _plain(exc: BaseException) -> str:
    text = strip_ansi(str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failure_cause(exc: BaseException, limit: int = 500) -> str:
    """Why ``exc`` happened, in one line of at most ``limit`` characters, without ANSI codes.

    * ``RayTaskError`` (a remote call raised): the innermost exception, ``Type: message``, from ``.cause``
      (followed through nested task errors) or, when Ray could not keep the cause, from the last
      ``Type: message`` line of its traceback.
    * ``ActorDiedError`` / ``RayActorError`` (the actor is gone): ``ActorDiedError: <Ray's death cause>``
      ("The actor is dead because its worker process has died. ...", "... its node has died", "killed by
      `ray.kill`"), without the generic sentence and the pid/ip context lines; for an actor whose constructor
      raised, that error. When Ray gave no cause the generic sentence is kept and says so.
    * Anything else: ``Type: message``.
    """
    ray_exceptions = sys.modules.get("ray.exceptions")
    if ray_exceptions is not None:
        for _ in range(16):  # follow nested task errors; a bound, not a loop over a cycle
            if not isinstance(exc, ray_exceptions.RayTaskError):
                break
            cause = getattr(exc, "cause", None)
            if not isinstance(cause, BaseException) or cause is exc:
                inner = _last_exception_line(strip_ansi(str(exc)))
                return _one_line(inner or _plain(exc), limit)
            exc = cause
        if type(exc) is ray_exceptions.RayError:  # a cause Ray could not pickle: its text ends with the traceback
            return _one_line(_last_exception_line(strip_ansi(str(exc))) or _plain(exc), limit)
        if isinstance(exc, ray_exceptions.RayActorError):
            return _one_line(_actor_death(exc), limit)
    return _one_line(_plain(exc), limit)


def _actor_death(exc: BaseException) -> str:
    name = type(exc).__name__
    text = strip_ansi(str(exc))
    if _CREATION_TASK in text:
        inner = _last_exception_line(text)
        return f"{name}: its constructor raised {inner}" if inner else _plain(exc)
    lines = [line for line in text.splitlines() if line.strip() and not _ACTOR_CONTEXT_LINE.match(line)]
    cause = " ".join(line.strip() for line in lines if line.strip() != _ACTOR_DIED)
    if cause:
        return f"{name}: {cause}"
    if lines:
        return f"{name}: {' '.join(line.strip() for line in lines)} (Ray gave no cause)"
    return name
