"""One logging set-up for every Relax process: operator-facing lines, no per-request noise."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log every HTTP request at INFO: thousands of lines per training step.
QUIET = ("httpx", "httpcore", "urllib3", "matplotlib", "filelock")


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
