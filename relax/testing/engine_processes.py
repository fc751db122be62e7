"""Finding a run's engine server processes from outside the run, to crash them the way the platform does.

Tests and benchmarks that SIGKILL an engine (``tests/e2e/test_elastic_training.py``, ``benchmarks/fault_soak.py``)
need the server behind an engine URL: a descendant of the driver whose argv names the URL's port. psutil is a
development dependency, imported here only when called.
"""

from __future__ import annotations


def engine_server_pid(driver_pid: int, url: str) -> int | None:
    """The pid of the engine server serving ``url`` among the driver's descendants; None when there is none."""
    import psutil

    port = url.rsplit(":", 1)[1]
    for proc in psutil.Process(driver_pid).children(recursive=True):
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return proc.pid
    return None
