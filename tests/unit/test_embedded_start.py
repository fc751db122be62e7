"""An embedded cluster whose node misses Ray's fixed 30 s registration window gets one more try.

Seen in the suite: two runs and a three-node local cluster on two cores, and one driver's ``ray.init`` raised
"The current node timed out during startup". Making a real raylet that late on purpose is not possible here,
so ``ray.init`` is replaced by one that fails the way Ray does; what is checked is what ``start_local`` does
about it: stop what the failed start left, try once more, and give up on anything else at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from relax.cluster import connect
from relax.cluster.embedded import EMBEDDED_RAY_SETTINGS, embedded_ray_env, embedded_system_config

TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                      "failed to startup or the GCS has become overloaded.")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    record: dict[str, Any] = {"init": 0, "stopped": 0, "outcomes": []}

    def fake_init(**_: Any) -> None:
        record["init"] += 1
        outcome = record["outcomes"].pop(0)
        if outcome is not None:
            raise outcome

    def fake_stop() -> None:
        record["stopped"] += 1

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(connect, "_stop_failed_start", fake_stop)
    monkeypatch.setattr(connect, "clean_stale_sessions", lambda: [])
    monkeypatch.setattr(connect, "current_session_dir", lambda: None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    # this process's Ray settings stay as the suite set them: no loopback switch, no token applied
    monkeypatch.setattr(connect.ray_auth, "keep_on_loopback_in_process", lambda: None)
    monkeypatch.setattr(connect.ray_auth, "warn_if_disabled", lambda *_: True)
    return record


def test_a_start_that_timed_out_is_stopped_and_tried_once_more(calls: dict[str, Any]) -> None:
    calls["outcomes"] = [TIMED_OUT, None]
    connect.start_local(num_gpus=1, num_cpus=1)
    assert (calls["init"], calls["stopped"]) == (2, 1)


def test_a_second_timeout_is_raised(calls: dict[str, Any]) -> None:
    calls["outcomes"] = [TIMED_OUT, TIMED_OUT]
    with pytest.raises(Exception, match="timed out during startup"):
        connect.start_local(num_gpus=1, num_cpus=1)
    assert (calls["init"], calls["stopped"]) == (2, 1)


def test_any_other_failure_is_raised_at_once(calls: dict[str, Any]) -> None:
    calls["outcomes"] = [ValueError("bad resources")]
    with pytest.raises(ValueError, match="bad resources"):
        connect.start_local(num_gpus=1, num_cpus=1)
    assert (calls["init"], calls["stopped"]) == (1, 0)


# --- what the embedded cluster's GCS keeps per task stays bounded (relax.cluster.embedded) ---

def test_the_embedded_cluster_bounds_the_task_events_its_gcs_keeps() -> None:
    config = embedded_system_config({})
    assert config == EMBEDDED_RAY_SETTINGS
    # Ray's defaults are 100 000 records and 1 000 000 dropped ids: ~350 MB and more over a long run
    assert 0 < config["task_events_max_num_task_in_gcs"] <= 10_000
    assert 0 < config["task_events_max_dropped_task_attempts_tracked_per_job_in_gcs"] <= 10_000


def test_a_ray_setting_the_user_exported_wins() -> None:
    # _system_config overrides RAY_* variables inside Ray, so a name the user set must not be passed at all
    config = embedded_system_config({"RAY_task_events_max_num_task_in_gcs": "500"})
    assert "task_events_max_num_task_in_gcs" not in config
    assert "task_events_max_dropped_task_attempts_tracked_per_job_in_gcs" in config


def test_no_idle_workers_are_started_for_the_driver() -> None:
    assert embedded_system_config({})["prestart_worker_first_driver"] is False
    # a `ray start` node reads booleans from its environment as true/false (Ray lower-cases and compares)
    assert embedded_ray_env({})["RAY_prestart_worker_first_driver"] == "false"
    assert embedded_ray_env({})["RAY_task_events_max_num_task_in_gcs"] == "10000"
    assert "RAY_prestart_worker_first_driver" not in embedded_ray_env({"RAY_prestart_worker_first_driver": "1"})


def test_every_setting_is_one_this_ray_knows() -> None:
    # an unknown _system_config name stops the GCS at start ("Received unexpected config parameter"); Ray's
    # Python binding exposes only some of the names, its GCS binary holds them all
    gcs = Path(ray.__file__).parent / "core" / "src" / "ray" / "gcs" / "gcs_server"
    known = gcs.read_bytes()
    for name in EMBEDDED_RAY_SETTINGS:
        assert name.encode() in known, name


def test_start_local_passes_the_limits_to_ray(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    connect.start_local(num_gpus=1, num_cpus=1)
    assert seen.get("_system_config") == embedded_system_config()
