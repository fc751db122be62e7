"""A preemption notice through Ray's drain API, on the local elastic cluster (relax.testing.eviction_scenario).

The scenario runs in a subprocess (this pytest process may hold its own local Ray): a head, one fake node the
autoscaler adds for an elastic engine, a notice with reason PREEMPTION and a deadline while that engine is
mid-way through its requests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def run(tiny_preset, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "relax.testing.eviction_scenario", "--json", "--preset",
                           str(tiny_preset.root), *args], capture_output=True, text=True, timeout=400)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines


def test_a_notice_with_a_deadline_keeps_the_work_and_beats_the_deadline(tiny_preset) -> None:
    """(a) of the preemption issue; a deadline already past (c) runs in benchmarks/eviction.py (mode ``abort``),
    and its budget of 0 is tests/unit/test_eviction.py's case: the suite's time goes to the case that keeps work."""
    (migrate,) = run(tiny_preset, "--modes", "migrate", "--deadline", "15")
    # every request completes exactly once, in full, and what was generated before the notice is kept
    assert migrate["lost_samples"] == 0 and migrate["complete_samples"] == migrate["requests"]
    assert migrate["migrated_requests"] > 0 and migrate["tokens_regenerated"] == 0
    before = migrate["tokens_before_notice_on_engine"]  # the engine's counter: health probes add a token each
    assert 0 < migrate["tokens_kept"] <= before and migrate["tokens_kept"] >= before - 3
    # the engine and its placement group are gone before the deadline, and the node leaves (as preempted)
    assert migrate["gone_before_deadline"] is True and migrate["notice_to_engine_gone_s"] < 15
    assert migrate["node_gone_s"] is not None
    print("preemption:", json.dumps({k: migrate[k] for k in ("tokens_kept", "tokens_regenerated",
                                                             "notice_to_engine_gone_s", "affected_samples_done_s")}))
