"""How `make test` spreads the suite over its pytest-xdist workers.

One unit of work is one test file (its tests share module fixtures, and some rely on their order), except the
e2e group, which is one unit for all its files: those tests each run a training job, an elastic cluster or
both, and two of them side by side on two cores slow each other down about threefold (measured: the REST
scaling test 66 s alone, 208 s beside the recipe's jobs). One worker runs them in turn while the other works
through the integration and unit files, which are short and take what the e2e tests leave of the CPU (they
wait on deadlines, drains and joining nodes about half their time). Units go out in collection order, the e2e
unit first; a worker takes the next unit when it has two tests or fewer left, so the e2e worker joins in on
the remaining files as it finishes.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

E2E_DIR = "tests/e2e/"


def unit_of_work(nodeid: str) -> str:
    """The scheduling unit of a test: ``e2e`` for the e2e group, else its file."""
    path = nodeid.split("::", 1)[0]
    return "e2e" if path.startswith(E2E_DIR) else path


class FilesWithE2ETogether(LoadScopeScheduling):
    """xdist's per-scope scheduling with :func:`unit_of_work` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of_work(nodeid)
