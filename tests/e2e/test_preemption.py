"""A preemption notice through Ray's drain API, on the local elastic cluster (relax.testing.eviction_scenario).

The scenario runs in a subprocess (this pytest process may hold its own local Ray): a head, one fake node the
autoscaler adds for an elastic engine, a notice with reason PREEMPTION and a deadline while that engine is
mid-way through its requests; the same with the notice as Ray gives it on SIGTERM to a `ray start --block`
node; a notice whose deadline already passed; and no notice at all: the engine's server SIGKILLed half-way
through long responses.
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


# GKE's default pod grace: the low end of what providers give. The engine is frozen mid-way through its requests,
# so migrate and sigterm each wait out their whole budget (deadline - the 5 s margin): a longer deadline only
# makes the test wait longer, and the engine must still be gone within the same 5 s margin.
DEADLINE_S = 15


def _kept_and_gone_in_time(result: dict, deadline_s: float) -> None:
    # every request completes exactly once, in full, and what was generated before the notice is kept
    assert result["lost_samples"] == 0 and result["complete_samples"] == result["requests"]
    assert result["migrated_requests"] > 0 and result["tokens_regenerated"] == 0
    before = result["tokens_before_notice_on_engine"]  # the engine's counter: health probes add a token each
    assert 0 < result["tokens_kept"] <= before and result["tokens_kept"] >= before - 3
    # the engine and its placement group are gone before the deadline, and the node leaves
    assert result["gone_before_deadline"] is True and result["notice_to_engine_gone_s"] < deadline_s
    assert result["node_gone_s"] is not None
    assert result["node_left_as"] == "AUTOSCALER_DRAIN_PREEMPTED", result["node_left_as"]  # as the GCS recorded it
    # Ray's own table: the engine's group is gone (engine ids restart with each mode's manager: all of theirs)
    assert result["placement_group_states"] and set(result["placement_group_states"]) == {"REMOVED"}


def test_notices_keep_the_work_and_beat_the_deadline_and_a_past_deadline_loses_nothing(tiny_preset) -> None:
    """(a) a notice through Ray's drain API, (b) Ray's own marking on SIGTERM to the node's `ray start --block`,
    (c) a deadline already past: an abrupt loss, retried from the prompts, nothing lost. One cluster for all."""
    migrate, sigterm, crash, past = run(tiny_preset, "--modes", "migrate,sigterm,crash,abort",
                                        "--deadline", str(DEADLINE_S))
    assert (migrate["mode"], sigterm["mode"], crash["mode"], past["mode"]) == ("migrate", "sigterm", "crash", "abort")
    _kept_and_gone_in_time(migrate, DEADLINE_S)
    _kept_and_gone_in_time(sigterm, DEADLINE_S)
    assert sigterm["node_gone_s"] < DEADLINE_S  # `ray start --block` exited once its node was idle, in time
    assert past["lost_samples"] == 0 and past["complete_samples"] == past["requests"]
    assert past["tokens_kept"] == 0 and past["tokens_regenerated"] > 0 and past["migrated_requests"] == 0
    assert past["budget_s"] == 0
    # a crash without notice: every request completes once, in full, from the prefix its stream had delivered
    # (at most one chunk, 8 tokens, lost per request)
    assert crash["lost_samples"] == 0 and crash["complete_samples"] == crash["requests"]
    assert crash["migrated_requests"] > 0 and crash["tokens_regenerated"] == 0
    assert crash["tokens_kept_fraction"] >= 0.9 and crash["tokens_kept"] <= crash["tokens_before_notice_on_engine"]
    for r in (migrate, sigterm, crash, past):
        print(f"preemption ({r['mode']}):", json.dumps({k: r[k] for k in (
            "tokens_kept", "tokens_regenerated", "notice_to_engine_gone_s", "affected_samples_done_s")}))
