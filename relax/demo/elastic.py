"""`relax demo` (default): the recipe's flow on one machine, with capacity that really grows and shrinks.

A local Ray cluster of fake autoscaling nodes stands in for the cluster provisioner; the tiny twin of the
Qwen3-4B recipe is submitted through scripts/entrypoint/ray-job.sh and `ray job submit`; a bounded burst of
requests on loopback plays "load". The demo prints what the recipe tells a user to confirm: training
advancing on the initial engines, nodes joining and more engines ACTIVE under load, and the pool returning
to its initial size with training still advancing.

The same helpers drive the end-to-end test (tests/e2e/test_elastic_recipe.py).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from relax.demo.local import set_aside
from relax.engines.launcher import ENGINE_API_KEY_ENV
from relax.presets.tiny import TinyPreset

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
RAY_JOB = "scripts/entrypoint/ray-job.sh"
TINY_RUN_SCRIPT = "examples/elastic_rollout/run-tiny-cpu-elastic-async.sh"
TINY_AUTOSCALER = "examples/elastic_rollout/autoscaler-tiny.yaml"
CHAT_PROMPT = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"

# A bounded load on loopback: waves of 400 requests per engine (200 in flight) until BURST_SECONDS have passed,
# so the queue holds for as long as the autoscaler's condition needs however fast the engines are (one wave
# takes ~5 s on a quiet 2-core machine, ~3x that under load). Its own process, so the caller keeps polling.
BURST_SECONDS = 45.0
BURST_SCRIPT = """
import asyncio, os, sys, time
from relax.engines.launcher import ENGINE_API_KEY_ENV
from relax.engines.loadgen import run_burst
prompt, seconds = sys.argv[1], float(sys.argv[2])
token = os.environ.get(ENGINE_API_KEY_ENV) or None
async def main():
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.gather(*(run_burst(u, prompt, requests=400, concurrency=200, max_new_tokens=200, token=token)
                               for u in sys.argv[3:]))
asyncio.run(main())
"""


def wait_until(predicate: Callable[[], T], timeout: float, what: str, poll_s: float = 0.5) -> T:
    """Poll `predicate` until it returns something truthy; transient HTTP errors count as 'not yet'."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s (last: {last!r})")


class RunApi:
    """The few control-plane reads the recipe's checks need."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self._token = token

    def headers(self) -> dict[str, str]:
        """The run's token: given, ``RELAX_API_TOKEN``, or the one the run wrote for this address on this machine."""
        from relax.cluster.api_token import find_token

        access = find_token(self.url)
        # a token found for another literal address than self.url (a name resolving to several) is not sent
        token = self._token or (access.token if access.url == self.url else None)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _get(self, path: str) -> httpx.Response:
        response = httpx.get(f"{self.url}{path}", timeout=5, trust_env=False, headers=self.headers())
        response.raise_for_status()
        return response

    def engines(self) -> list[dict[str, Any]]:
        return self._get("/rollout/engines").json()["models"]["default"]["engines"]

    def active(self) -> list[dict[str, Any]]:
        return [e for e in self.engines() if e["status"] == "ACTIVE"]

    def training_step(self) -> int:
        for family in text_string_to_metric_families(self._get("/metrics").text):
            for sample in family.samples:
                if sample.name == "relax_training_step":
                    return int(sample.value)
        return 0

    def scale_history(self) -> list[dict[str, Any]]:
        return self._get("/autoscaler/scale_history").json()["entries"]

    def autoscaler_config(self) -> dict[str, Any]:
        return self._get("/autoscaler/config").json()


def job_env(cluster_env: dict[str, str], preset: TinyPreset, exp_dir: Path, api_port: int,
            **overrides: str) -> dict[str, str]:
    """The run script's environment; ``RELAX_ENGINE_API_KEY`` is the engines' secret the burst needs too."""
    return {
        **os.environ,
        **cluster_env,
        # the job runs `python3 -m relax...`: this interpreter's environment must come first
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "MODEL_DIR": str(preset.root), "DATA_DIR": str(preset.root), "EXP_DIR": str(exp_dir),
        "AUTOSCALER_CONFIG": TINY_AUTOSCALER, "WORKING_DIR": "./", "RAY_NO_WAIT": "1",
        "RELAX_API_PORT": str(api_port), ENGINE_API_KEY_ENV: secrets.token_urlsafe(24), **overrides,
    }


def submit_tiny_job(env: dict[str, str], args: tuple[str, ...] = ()) -> str:
    """`bash scripts/entrypoint/ray-job.sh <tiny run script> [args]`; returns the submission id. ``args`` go to
    the run script, which adds them to the entrypoint's flags."""
    if not (REPO / RAY_JOB).is_file():
        raise FileNotFoundError(f"{REPO / RAY_JOB} not found: the elastic demo runs from a source checkout")
    result = subprocess.run(["bash", RAY_JOB, TINY_RUN_SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=180)
    if result.returncode != 0:
        raise RuntimeError(f"ray-job.sh failed:\n{result.stdout}{result.stderr}")
    return next(line.split()[2] for line in result.stdout.splitlines() if line.startswith("ray-job.sh: submitting"))


def start_burst(urls: list[str], token: str | None = None, seconds: float = BURST_SECONDS) -> subprocess.Popen[bytes]:
    """The load generator, in its own process; ``token``: the engines' secret (the run's RELAX_ENGINE_API_KEY)."""
    env = {**os.environ, ENGINE_API_KEY_ENV: token or ""}
    return subprocess.Popen([sys.executable, "-c", BURST_SCRIPT, CHAT_PROMPT, str(seconds), *urls], env=env)


DEMO_NUM_ROLLOUT = 5000  # an upper bound: the demo ends the run itself once the checks are done


def run_elastic_demo(workdir: Path, *, num_rollout: int = DEMO_NUM_ROLLOUT, console: Console | None = None) -> int:
    """The recipe's flow on a local elastic cluster; 0 when all three checks held and the run ended cleanly.

    The run is given more steps than the checks need and is stopped with ``ray job stop`` (SIGTERM: the
    driver finishes its step, writes summary and plot, and shuts down) once training has advanced after
    the scale-in: how long the checks take depends on the machine, the number of steps must not.
    """
    try:
        return _run_elastic_demo(workdir, num_rollout=num_rollout, console=console or Console())
    except (TimeoutError, DemoError) as exc:
        (console or Console()).print(f"[bold red]demo failed:[/] {exc}", soft_wrap=True)
        return 1


class DemoError(RuntimeError):
    """A check of the demo did not hold; the message says which and what was seen."""


def _run_elastic_demo(workdir: Path, *, num_rollout: int, console: Console) -> int:
    from ray.job_submission import JobSubmissionClient

    from relax.cluster.local_elastic import ElasticCluster, ElasticClusterConfig, read_status
    from relax.cluster.network import free_port
    from relax.presets.ensure import ensure_preset

    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    preset = ensure_preset(workdir, console=console)
    console.print("[bold]2. local elastic Ray cluster[/]: head with 4 logical GPUs (stable markers), "
                  "up to 2 fake autoscaled 1-GPU nodes")
    # `ray job stop` waits this long for the SIGTERM'd driver to finish cleanly before it SIGKILLs (Ray: 3 s)
    cluster = ElasticCluster(ElasticClusterConfig(head_gpus=4, max_elastic=2, dashboard_port=0,
                                                  env={"RAY_JOB_STOP_WAIT_TIME_S": "120"}))
    info = cluster.start()
    jobs = JobSubmissionClient(info.dashboard_url)
    job_id = None
    try:
        api_port = free_port()
        api = RunApi(f"http://127.0.0.1:{api_port}")
        exp = workdir / "exp"
        set_aside(exp / "tiny-elastic", console)
        env = job_env(info.env(), preset, exp, api_port, NUM_ROLLOUT=str(num_rollout))
        console.print(f"[bold]3. submit[/] through {RAY_JOB} → ray job submit ({TINY_RUN_SCRIPT})")
        job_id = submit_tiny_job(env)
        console.print(f"   job {job_id}; REST API {api.url}; `relax monitor --url {api.url}/autoscaler`")

        def running() -> bool:
            if jobs.get_job_status(job_id).is_terminal():
                raise DemoError(f"job {job_id} ended before the checks were done ({jobs.get_job_status(job_id)}; "
                                f"--num-rollout {num_rollout} too small?); its log ends:\n"
                                + jobs.get_job_logs(job_id)[-2000:])
            return True

        def show(label: str) -> None:
            nodes = len(read_status(info.address).elastic_nodes)
            pool = ", ".join(f"{e['engine_id']}({e['kind']}:{e['status']})" for e in api.engines())
            console.print(f"   {label}\n     training step {api.training_step()}/{num_rollout}; "
                          f"elastic nodes {nodes}; engines {pool}", markup=False)

        wait_until(lambda: running() and len(api.active()) == 2 and api.training_step() >= 3, 300,
                   "training on 2 engines")
        show("check 1: training advances on the initial engines")
        console.print(f"[bold]4. load[/]: {BURST_SECONDS:.0f} s of request bursts on the engines (loopback)")
        began = time.monotonic()
        burst = start_burst([e["url"] for e in api.active()], token=env[ENGINE_API_KEY_ENV])
        try:
            wait_until(lambda: running() and len(api.active()) > 2, 300, "more engines under load")
            show(f"check 2: +{len(api.active()) - 2} engine(s) ACTIVE after {time.monotonic() - began:.0f}s")
        finally:
            burst.wait(timeout=600)
        ended = time.monotonic()
        wait_until(lambda: running() and len(api.active()) == 2 and len(api.engines()) == 2, 300,
                   "back to the initial engines")
        cluster.wait_for_nodes(0, timeout=180)
        show(f"check 3: back to 2 engines {time.monotonic() - ended:.0f}s after the load ended; nodes removed")
        for entry in reversed(api.scale_history()):
            console.print(f"   autoscaler {entry['action']} {entry['from_engines']}→{entry['to_engines']}: "
                          f"{entry['reason']}")
        after = api.training_step()
        wait_until(lambda: running() and api.training_step() >= after + 5, 300, "training to keep advancing")
        show("check 3, continued: training keeps advancing on the initial engines")
        console.print("[bold]5. end of the demo[/]: `ray job stop` (SIGTERM: the driver stops after its step, "
                      "writes summary and plot, shuts down)")
        jobs.stop_job(job_id)
        status = wait_until(lambda: jobs.get_job_status(job_id).is_terminal() and jobs.get_job_status(job_id),
                            180, "the job to stop", poll_s=1.0)
        logs = jobs.get_job_logs(job_id)
        run_dir = exp / "tiny-elastic"
        clean = "SIGTERM: stopping after step" in logs and (run_dir / "summary.json").exists()
        console.print(f"   job {job_id}: {status}, {'clean stop' if clean else 'NOT a clean stop'}")
        console.print(f"   metrics: {run_dir / 'metrics.jsonl'}\n   summary: {run_dir / 'summary.json'}\n"
                      f"   plot:    {run_dir / 'training.png'}")
        if not clean:
            raise DemoError("the run did not stop cleanly on SIGTERM; its log ends:\n" + logs[-2000:])
        return 0
    finally:
        if job_id is not None and not jobs.get_job_status(job_id).is_terminal():
            jobs.stop_job(job_id)
            wait_until(lambda: jobs.get_job_status(job_id).is_terminal(), 120, "the job to stop")
        cluster.stop()
