"""A local elastic cluster whose head misses Ray's fixed 30 s registration wait is stopped and started once more.

Seen in the suite on a slow two-core machine: `relax cluster up` beside a training test, and `ray start --head`
exited with "The current node timed out during startup". A real raylet cannot be made that late on purpose,
so the head command is a stand-in that exits the way `ray start` does (the same traceback line in its log);
what is checked is what ``ElasticCluster.start`` does about it, through its real start and clean-up path: the
failed head's directory is removed, a timed-out start is tried once more, anything else is raised at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax.cluster import local_elastic
from relax.cluster.local_elastic import ElasticCluster, ElasticClusterConfig, ElasticClusterError

TIMED_OUT = ("Exception: The current node timed out during startup. This could happen because some of the "
             "raylet failed to startup or the GCS has become overloaded.")


@pytest.fixture
def heads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Each start of the stand-in head takes the next line of ``heads`` and exits 1 with it in its log."""
    script = tmp_path / "fake_ray.py"
    calls = tmp_path / "calls"
    script.write_text(
        "import sys\n"
        f"calls = open({str(calls)!r}, 'a+'); calls.seek(0); n = len(calls.read().splitlines())\n"
        "import os; calls.write(os.getcwd() + '\\n'); calls.close()\n"
        f"lines = open({str(tmp_path / 'outcomes')!r}).read().splitlines()\n"
        "print('Traceback (most recent call last):'); print(lines[n]); sys.exit(1)\n"
    )
    outcomes: list[str] = []

    def fake_ray() -> list[str]:
        (tmp_path / "outcomes").write_text("\n".join(outcomes) + "\n")
        return [sys.executable, str(script)]

    monkeypatch.setattr(local_elastic, "ray_executable", fake_ray)
    return outcomes


def _roots(tmp_path: Path) -> list[Path]:
    """The directory of each start (the head runs in its cluster's root directory)."""
    return [Path(line) for line in (tmp_path / "calls").read_text().splitlines()]


def _start() -> None:
    ElasticCluster(ElasticClusterConfig(head_gpus=1, include_dashboard=False)).start(timeout=30)


def test_a_head_that_timed_out_is_stopped_and_started_once_more(heads: list[str], tmp_path: Path) -> None:
    heads += [TIMED_OUT, "RuntimeError: something else"]
    with pytest.raises(ElasticClusterError, match="something else"):
        _start()
    roots = _roots(tmp_path)
    assert len(roots) == 2 and roots[0] != roots[1]
    assert not any(root.exists() for root in roots)  # each failed head's directory is gone


def test_a_second_timeout_is_raised(heads: list[str], tmp_path: Path) -> None:
    heads += [TIMED_OUT, TIMED_OUT]
    with pytest.raises(ElasticClusterError, match="timed out during startup"):
        _start()
    assert len(_roots(tmp_path)) == 2


def test_any_other_failure_is_raised_at_once(heads: list[str], tmp_path: Path) -> None:
    heads += ["ValueError: bad resources", TIMED_OUT]
    with pytest.raises(ElasticClusterError, match="bad resources"):
        _start()
    assert len(_roots(tmp_path)) == 1
