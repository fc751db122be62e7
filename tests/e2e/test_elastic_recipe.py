"""The recipe's three checks, end to end: the tiny twin of the Qwen3-4B elastic recipe submitted through
scripts/entrypoint/ray-job.sh and `ray job submit` to a local Ray cluster whose capacity really grows and
shrinks (fake autoscaling nodes standing in for the cluster provisioner).

  1. training advances with the initial engines ACTIVE;
  2. under load, fake nodes are added, the pending placement groups become ready, and more than the initial
     number of engines are ACTIVE;
  3. after the load falls, the autoscaler returns to the initial count, idle nodes are removed, and training
     keeps advancing.

Between 2 and 3, as the load ends, one of the added nodes is preempted while training runs: a notice through
Ray's drain API with a 20 s deadline (what a provider's hook sends). Its engine must be out of routing, drained and gone
with its placement group before the deadline, the node must leave as preempted, and training must go on
(a sample that could not be served would fail the run: none is ever dropped silently).

Checked from the REST API, Ray's own state, and the job's logs. The cluster's stable group is called
`baseline` here, so RELAX_INITIAL_NODE_GROUP=baseline is exercised; the default `stable` finds no markers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from relax.cluster.drain import drain_node, node_departure
from relax.cluster.local_elastic import ElasticCluster, ElasticClusterConfig, read_status
from relax.cluster.network import free_port
from relax.demo.elastic import RunApi, job_env, start_burst, submit_tiny_job, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster():
    config = ElasticClusterConfig(head_gpus=4, max_elastic=2, dashboard_port=0,
                                  node_group="baseline")
    with ElasticCluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def jobs(cluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(cluster.info.dashboard_url)


ENGINE_KEY = "recipe-e2e-engine-key"  # the engines' secret, so the burst may call them
PREEMPTION_DEADLINE_S = 20.0  # a provider's notice: GKE gives ~15 s by default, Ray's own drain 30 s


def eviction_record(api: RunApi, engine_id: str) -> dict | None:
    """The measures of ``engine_id``'s eviction, once it is removed (its ``engine_state`` event's details)."""
    events = httpx.get(f"{api.url}/rollout/events", params={"limit": 500, "kind": "engine_state"}, timeout=5,
                       trust_env=False, headers=api.headers()).json()["events"]
    return next((e["details"] for e in events if engine_id in e["engine_ids"]
                 and "notice_to_gone_s" in e.get("details", {})), None)


def submit(cluster, preset, exp: Path, api_port: int, **overrides: str) -> str:
    """The recipe's tiny run script as a job, without its evaluation before the first step: 800 samples at
    once, which the autoscaler rightly answers with added engines where it lasts longer than the scale-out
    condition's hold (seen: 14 s on a slow 2-core machine), and the checks below would wait for those to go
    again (engines started, scaled in one at a time, nodes idle) before their own load could start."""
    env = job_env(cluster.info.env(), preset, exp, api_port, NUM_ROLLOUT="2000", RELAX_INITIAL_NODE_GROUP="baseline",
                  RELAX_ENGINE_API_KEY=ENGINE_KEY)
    env.update(overrides)
    return submit_tiny_job(env, ("--skip-eval-before-train",))


def diagnostics(api: RunApi, jobs, job_id: str) -> str:
    """What an operator would look at: the autoscaler's view, the scale requests, the job log's tail."""
    parts = []
    for path in ("/autoscaler/status", "/autoscaler/health", "/autoscaler/conditions", "/autoscaler/scale_history",
                 "/rollout/scale_out", "/rollout/scale_in", "/rollout/events"):
        try:
            answer = httpx.get(api.url + path, timeout=5, trust_env=False, headers=api.headers()).json()
            parts.append(f"{path}: {json.dumps(answer)[:3000]}")
        except Exception as exc:  # diagnostics must not hide the real failure
            parts.append(f"{path}: {exc!r}")
    parts.append("job log tail:\n" + jobs.get_job_logs(job_id)[-6000:])
    return "\n".join(parts)


def end_status(jobs, job_id: str, timeout: float) -> str:
    return str(wait_until(lambda: jobs.get_job_status(job_id).is_terminal() and jobs.get_job_status(job_id),
                          timeout, f"job {job_id} to end"))


def test_affinity_without_markers_fails_fast_with_the_documented_message(cluster, jobs, tiny_preset, tmp_path):
    job_id = submit(cluster, tiny_preset, tmp_path / "exp", free_port(), RELAX_INITIAL_NODE_GROUP="stable")
    assert end_status(jobs, job_id, 120).endswith("FAILED")
    logs = jobs.get_job_logs(job_id)
    assert "node-group affinity needs the marker resources stable_gpu, stable_cpu" in logs
    assert "--no-enable-affinity" in logs and "ENABLE_AFFINITY=0" in logs
    assert "Traceback" not in logs


def test_recipe_three_checks_on_an_elastic_cluster(cluster, jobs, tiny_preset, tmp_path: Path) -> None:
    api_port = free_port()
    api = RunApi(f"http://127.0.0.1:{api_port}")
    info = cluster.info
    job_id = submit(cluster, tiny_preset, tmp_path / "exp", api_port)

    def expect(predicate, timeout: float, what: str):
        try:
            return wait_until(predicate, timeout, what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{diagnostics(api, jobs, job_id)}") from None

    def requests(direction: str) -> list[dict]:
        return httpx.get(f"{api.url}/rollout/{direction}", timeout=5, trust_env=False, headers=api.headers()).json()

    try:
        # 1. training advances with the initial engines ACTIVE
        expect(lambda: len(api.active()) == 2, 360, "two initial engines ACTIVE")  # start-up: 3+ min seen under load
        assert {e["kind"] for e in api.active()} == {"initial"}
        first = expect(lambda: api.training_step() >= 3 and api.training_step(), 240, "training to advance")
        # The load below must start from the initial pool (training alone never scales out, and the job does
        # not evaluate before its first step: submit), so this holds at once; an added engine would be waited out.
        expect(lambda: len(api.engines()) == 2 and not read_status(info.address).elastic_nodes, 300,
               "the pool back at its two initial engines, no added node")
        assert {e["kind"] for e in api.active()} == {"initial"}
        earlier_outs = {r["request_id"] for r in requests("scale_out")}

        # 2. under load: nodes join, placement groups become ready, more than two engines ACTIVE
        load_started = time.monotonic()
        # the engines refuse calls without the run's secret: the burst is given it (and checks that first)
        assert httpx.get(f"{api.active()[0]['url']}/server_info", timeout=5, trust_env=False).status_code == 401
        burst = start_burst([e["url"] for e in api.active()], token=ENGINE_KEY)  # bounded, loopback only
        try:
            grown = expect(lambda: len(api.active()) > 2 and api.active(), 240, "more than two ACTIVE engines")
            first_extra_s = time.monotonic() - load_started
            status = read_status(info.address)
            assert len(status.elastic_nodes) >= 1, status.format()
            assert any(e["kind"] == "elastic" for e in grown)
            # a request may still be bringing up its second engine: wait for its outcome, then end the load
            outs = expect(lambda: (lambda rs: rs if any(r["status"] in ("ACTIVE", "PARTIAL") for r in rs) else None)(
                [r for r in requests("scale_out") if r["request_id"] not in earlier_outs]), 180,
                "a scale-out request of the load to end ACTIVE or PARTIAL")
            assert outs
            # the preemption must leave an added engine for the scale-in below: wait for the whole ceiling
            ceiling = httpx.get(f"{api.url}/autoscaler/status", timeout=5, trust_env=False,
                                headers=api.headers()).json()["ceiling"]
            expect(lambda: len(api.active()) >= ceiling, 240, f"the pool at its ceiling of {ceiling} engines")
        finally:
            burst.terminate()  # its connections close: the engines abort what it left (SGLang's rule)
            burst.wait(timeout=30)
        load_ended = time.monotonic()

        # 2b. the provider reclaims one added node: a preemption notice with a deadline, mid-training. The load
        # has just ended, so the autoscaler does not replace the engine (under load it would, and the test
        # would pay for an engine started only to be scaled in again).
        victim = next(e for e in api.active() if e["kind"] == "elastic")
        step_at_notice = api.training_step()
        accepted, why = drain_node(victim["node_id"], PREEMPTION_DEADLINE_S, address=info.address,
                                   message="recipe e2e: preemption")
        assert accepted, why
        evicted = expect(lambda: eviction_record(api, victim["engine_id"]), PREEMPTION_DEADLINE_S + 10,
                         f"{victim['engine_id']} to be evicted")
        assert evicted["gone_before_deadline"] is True, evicted
        assert evicted["notice_to_gone_s"] < PREEMPTION_DEADLINE_S - 1, evicted  # the margin kept back
        assert victim["engine_id"] not in {e["engine_id"] for e in api.engines()
                                           if e["status"] in ("ACTIVE", "DRAINING")}
        left_as = expect(lambda: node_departure(victim["node_id"], address=info.address), 60,
                         "the preempted node to leave")
        assert left_as == "AUTOSCALER_DRAIN_PREEMPTED", left_as
        expect(lambda: api.training_step() > step_at_notice, 120, "training to advance past the eviction")
        print(f"\npreemption during training: notice -> {victim['engine_id']} gone "
              f"{evicted['notice_to_gone_s']:.1f}s (deadline {PREEMPTION_DEADLINE_S:.0f}s, budget "
              f"{evicted['budget_s']:.1f}s), {evicted['moved_requests']} request(s) moved; node left as {left_as}")
        logs = jobs.get_job_logs(job_id)
        assert "scale-out so-" in logs and "placement group ready" in logs

        # 3. load falls: the autoscaler scales in to two engines, idle nodes go, training keeps advancing
        expect(lambda: len(api.active()) == 2 and len(api.engines()) == 2
               and any(r["status"] == "COMPLETED" for r in requests("scale_in")), 300,
               "the autoscaler to return the pool to the two initial engines")
        back_to_initial_s = time.monotonic() - load_ended
        cluster.wait_for_nodes(0, timeout=180)
        after = api.training_step()
        expect(lambda: api.training_step() > after, 120, "training to keep advancing after scale-in")
        assert after > first
        logs = jobs.get_job_logs(job_id)
        assert "scale-in si-" in logs and "training step" in logs

        # the autoscaler's own account: each action with its reason; down one engine at a time, cooled down (the
        # preemption took one added engine, so there is often a single scale-in: the cooldown is unit-tested)
        history = api.scale_history()
        # accepted scale-ins only: a refused or NOOP request starts no cooldown
        ins = sorted((h for h in history if h["action"] == "scale_in" and h["accepted"]), key=lambda h: h["time"])
        assert any(h["action"] == "scale_out" for h in history) and ins and all(h["reason"] for h in history)
        assert all(h["from_engines"] - h["to_engines"] == 1 for h in ins)
        cooldown = api.autoscaler_config()["scale_in_cooldown_secs"]
        assert all(b["time"] - a["time"] >= cooldown for a, b in zip(ins, ins[1:], strict=False))
        health = httpx.get(f"{api.url}/autoscaler/health", timeout=5, trust_env=False, headers=api.headers()).json()
        print("\n".join(f"  {h['time']:.1f} {h['action']} {h['from_engines']}->{h['to_engines']} "
                        f"accepted={h['accepted']} {h['reason']}" for h in history))
        print(f"\nelastic e2e: load start -> first extra engine ACTIVE {first_extra_s:.1f}s; "
              f"load end -> back to 2 engines {back_to_initial_s:.1f}s; incomplete scrapes "
              f"{health['incomplete_scrapes']} of {health['scrapes']} (last: {health['last_incomplete']})")
    finally:
        jobs.stop_job(job_id)
        end_status(jobs, job_id, 120)


def test_enable_affinity_0_runs_on_a_cluster_without_the_markers(cluster, jobs, tiny_preset, tmp_path) -> None:
    job_id = submit(cluster, tiny_preset, tmp_path / "exp", free_port(), RELAX_INITIAL_NODE_GROUP="stable",
                    ENABLE_AFFINITY="0", NUM_ROLLOUT="1")
    assert end_status(jobs, job_id, 240).endswith("SUCCEEDED"), jobs.get_job_logs(job_id)[-3000:]
    assert "training step 1/1" in jobs.get_job_logs(job_id)
