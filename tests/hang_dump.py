"""A test that hangs says where, and ends: every thread's stack on the process's real stderr, even in an xdist
worker, then the process exits.

pyproject.toml runs pytest-timeout with its thread method: past a test's limit it ends the whole worker, so
neither a blocked call nor a cleanup that blocks in turn can hold CI until its own deadline. Two gaps remain,
closed here with faulthandler, which works from C: pytest-timeout's dump goes to the worker's stdout, which an
xdist worker does not have (that is the channel to the controller), so a log would say only "worker crashed";
and its timer is a Python thread, which cannot run while a C call holds the GIL. faulthandler fires a moment
before pytest-timeout would: it writes every stack to the stderr saved before capture began and exits the
process. Loaded by tests/conftest.py as a plugin (and by its test, on its own).
"""

from __future__ import annotations

import faulthandler
from typing import Any

import pytest


def _real_stderr(config: pytest.Config) -> int | None:
    """The file descriptor of this process's stderr before pytest captured it (None if capture is off)."""
    capture = getattr(config.pluginmanager.getplugin("capturemanager"), "_global_capturing", None)
    return getattr(getattr(capture, "err", None), "targetfd_save", None)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Arm faulthandler's dump-and-exit a second before pytest-timeout's own timer (which still runs: it
    covers a run with capture off, where there is no saved stderr). Returns None, so pytest-timeout arms it."""
    fd = _real_stderr(item.config)
    if settings.timeout and settings.timeout > 0 and fd is not None:
        faulthandler.dump_traceback_later(max(settings.timeout - 1.0, settings.timeout * 0.5), exit=True, file=fd)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    faulthandler.cancel_dump_traceback_later()
