"""The recipe's three checks, end to end: the tiny twin of the Qwen3-4B elastic recipe submitted through
scripts/entrypoint/ray-job.sh and `ray job submit` to a local Ray cluster whose capacity really grows and
shrinks (fake autoscaling nodes standing in for the cluster provisioner).

  1. training advances with the initial engines ACTIVE;
  2. under load, fake nodes are added, the pending placement groups become ready, and more than the initial
     number of engines are ACTIVE;
  3. after the load falls, the autoscaler returns to the initial count, idle nodes are removed, and training
     keeps advancing.

Checked from the REST API, Ray's own state, and the job's logs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax.cluster.network import free_port
from relax.testing import ElasticCluster, ElasticClusterConfig, read_status

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, KeyError, ValueError) as exc:  # the API may not be up yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def training_step(api: str) -> int:
    text = httpx.get(f"{api}/metrics", timeout=5, trust_env=False).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "relax_training_step":
                return int(sample.value)
    return 0


def engines(api: str) -> list[dict]:
    body = httpx.get(f"{api}/rollout/engines", timeout=5, trust_env=False).json()
    return body["models"]["default"]["engines"]


def active(api: str) -> list[dict]:
    return [e for e in engines(api) if e["status"] == "ACTIVE"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = ElasticClusterConfig(head_gpus=4, max_elastic=2, dashboard_port=0, idle_timeout_minutes=0.15)
    with ElasticCluster(config) as c:
        yield c


def test_recipe_three_checks_on_an_elastic_cluster(cluster, tiny_preset, tmp_path: Path) -> None:
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    info = cluster.info
    env = {
        **os.environ,
        **info.env(),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "MODEL_DIR": str(tiny_preset.root), "DATA_DIR": str(tiny_preset.root), "EXP_DIR": str(tmp_path / "exp"),
        "AUTOSCALER_CONFIG": "examples/elastic_rollout/autoscaler-tiny.yaml", "WORKING_DIR": "./",
        "RAY_NO_WAIT": "1", "RELAX_API_PORT": str(api_port), "NUM_ROLLOUT": "2000",
    }
    submit = subprocess.run(["bash", "scripts/entrypoint/ray-job.sh",
                             "examples/elastic_rollout/run-tiny-cpu-elastic-async.sh"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = next(line.split()[2] for line in submit.stdout.splitlines() if line.startswith("ray-job.sh: submitting"))

    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient(info.dashboard_url)
    try:
        # 1. training advances with the initial engines ACTIVE
        wait_until(lambda: len(active(api)) == 2, 240, "two initial engines ACTIVE")
        assert {e["kind"] for e in active(api)} == {"initial"}
        first = wait_until(lambda: training_step(api) >= 3 and training_step(api), 240, "training to advance")
        assert read_status(info.address).elastic_nodes == []

        # 2. under load: nodes join, placement groups become ready, more than two engines ACTIVE
        urls = [e["url"] for e in active(api)]
        burst = subprocess.Popen([sys.executable, "-c", _BURST, *urls], env=env)  # bounded, loopback only
        try:
            grown = wait_until(lambda: len(active(api)) > 2 and active(api), 240, "more than two ACTIVE engines")
        finally:
            burst.wait(timeout=300)
        assert any(e["kind"] == "elastic" for e in grown)
        status = read_status(info.address)
        assert len(status.elastic_nodes) >= 1, status.format()
        logs = jobs.get_job_logs(job_id)
        assert "scale-out so-" in logs and "ACTIVE" in logs

        # 3. load falls: back to two engines, idle nodes removed, training keeps advancing
        wait_until(lambda: len(active(api)) == 2 and all(e["kind"] == "initial" for e in engines(api)), 300,
                   "the pool to return to the two initial engines")
        cluster.wait_for_nodes(0, timeout=180)
        after = training_step(api)
        wait_until(lambda: training_step(api) > after, 120, "training to keep advancing after scale-in")
        assert after > first
        logs = jobs.get_job_logs(job_id)
        assert "scale-in si-" in logs and "training step" in logs
    finally:
        jobs.stop_job(job_id)
        wait_until(lambda: jobs.get_job_status(job_id).is_terminal(), 120, "the job to stop")


_BURST = """
import asyncio, sys
prompt = "<|im_start|>user\\nWhat is 3 + 4?<|im_end|>\\n<|im_start|>assistant\\n"
async def main():
    await asyncio.gather(*(run_burst(u, prompt, requests=400, concurrency=200, max_new_tokens=200)
                           for u in sys.argv[1:]))
asyncio.run(main())
"""
