"""Scaling by REST while the tiny training runs: 2 → 4 → 2 engines, training advancing throughout, joining
engines serving only the current weights, and no sample older than the staleness bound. Then an engine's server
is SIGKILLed mid-generation (no notice, as the OOM killer or a GPU fault ends it): nothing is lost and its streamed
tokens are kept (tests/e2e/engine_crash.py). The run then gets a SIGTERM: it stops cleanly with a checkpoint of its
last step, and every process it started is gone.

One run for both, with the crash's long generations (temperature 25, responses to the length limit): a run of
its own for the crash cost ~60 s more, most of it starting and stopping processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from relax.demo.elastic import RunApi, wait_until
from relax.demo.local import train_argv
from tests.e2e.engine_crash import CRASH_GRPO, assert_crash_lost_nothing, batch, server_pid

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # the waits below add up to more than 300 s


def post(api: RunApi, path: str, body: dict) -> dict:
    response = httpx.post(f"{api.url}{path}", json=body, timeout=10, trust_env=False, headers=api.headers())
    assert response.status_code == 200, response.text
    return response.json()


def request_done(api: RunApi, direction: str, request_id: str) -> dict | None:
    record = httpx.get(f"{api.url}/rollout/{direction}/{request_id}", timeout=5, trust_env=False,
                       headers=api.headers()).json()
    return record if record["status"] in ("ACTIVE", "PARTIAL", "FAILED", "CANCELLED", "COMPLETED") else None


def _running(pid: int) -> bool:
    """Alive and not a zombie; a process that exits while it is looked at counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def while_running(driver: subprocess.Popen, log_path: Path) -> Callable[..., Any]:
    """``wait_until`` that fails at once, with the driver's log, once the driver has exited: a run that died in
    start-up must not be waited on for minutes."""
    def wait(predicate: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.5) -> Any:
        def checked() -> Any:
            if driver.poll() is not None:
                raise AssertionError(f"the driver exited (code {driver.returncode}) while waiting for {what}:\n"
                                     f"{log_path.read_text(errors='replace')[-3000:]}")
            return predicate()
        return wait_until(checked, timeout, what, poll_s)
    return wait


WANDB_KEY = "wandb-key-for-the-driver-only-0123456789"


def environ_of(process: psutil.Process) -> bytes:
    """The environment a process started with, as the kernel shows it to its user."""
    try:
        return Path(f"/proc/{process.pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def api_url(log_path: Path) -> str | None:
    """The URL of the driver's "relax API:" line: with ``--api-port 0`` the OS picks the port."""
    found = re.search(r"^relax API: (http://\S+)", log_path.read_text(errors="replace"), re.MULTILINE)
    return found.group(1) if found else None


def test_rest_scaling_while_training(tiny_preset, tmp_path: Path) -> None:
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # one trainer rank: the scaling is the rollout side's (two ranks are the learning and recipe runs' business)
    argv = train_argv(tiny_preset, out, num_rollout=400, max_staleness=1, trainer_gpus=1, grpo=CRASH_GRPO,
                      extra=("--api-port", "0", "--save", str(ckpt), "--record-samples"))
    log_path = tmp_path / "driver.log"
    env = {k: v for k, v in os.environ.items() if k != "RELAX_API_TOKEN"}
    env["WANDB_API_KEY"] = WANDB_KEY  # the driver's alone: no engine server nor Ray process may inherit it
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    wait = while_running(driver, log_path)
    try:
        # start-up alone took 3 min 20 s once with the other worker's e2e run beside it on two cores
        api = RunApi(wait(lambda: api_url(log_path), 420, "the control plane"))
        # the CLI finds the run's token for the port the OS picked, with no RELAX_API_TOKEN anywhere
        listed = subprocess.run([sys.executable, "-m", "relax.cli", "engines", "--json", "--url", api.url], env=env,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and len(json.loads(listed.stdout)["models"]["default"]["engines"]) == 2, (
            listed.stderr)
        wait(lambda: api.training_step() >= 3, 420, "training to start")
        environs = {p.pid: (p.cmdline(), environ_of(p)) for p in psutil.Process(driver.pid).children(recursive=True)}
        servers = [pid for pid, (cmd, _) in environs.items() if cmd[2:5] == ["relax.cli", "engine", "serve"]]
        assert len(servers) == 2 and all(b"RELAX_ENGINE_API_KEY=" in environs[pid][1] for pid in servers)
        leaked = {pid: cmd for pid, (cmd, text) in environs.items() if WANDB_KEY.encode() in text}
        assert not leaked, leaked

        # closed by default: no RELAX_API_TOKEN was set, yet a caller without the run's token changes nothing
        anonymous = httpx.post(f"{api.url}/rollout/scale_out", json={"engine_urls": ["http://127.0.0.1:9"]},
                               timeout=10, trust_env=False)
        assert anonymous.status_code == 401 and len(api.active()) == 2
        assert (out / "api-token").stat().st_mode & 0o777 == 0o600

        before = api.training_step()
        request = post(api, "/rollout/scale_out", {"num_replicas": 4})
        record = wait(lambda: request_done(api, "scale_out", request["request_id"]), 180, "scale-out")
        assert record["status"] == "ACTIVE", record
        assert len(api.active()) == 4
        # training goes on across the scale-out (on a slow machine the step may land just after it)
        grown = wait(lambda: (step := api.training_step()) > before and step, 120, "training to advance")

        events = httpx.get(f"{api.url}/rollout/events", params={"limit": 200}, timeout=5, trust_env=False,
                           headers=api.headers()).json()
        joined = [e for e in events["events"] if e["kind"] == "engine_state" and e["message"].startswith("ACTIVE")
                  and set(e["engine_ids"]) & set(record["engine_ids"])]
        assert len(joined) == 2
        for event in joined:  # an engine joins the router only once it holds the newest published version
            assert event["details"]["weight_version"] == event["details"]["latest_published"]

        wait(lambda: api.training_step() >= grown + 3, 120, "training on four engines")
        request = post(api, "/rollout/scale_in", {"num_replicas": 2})
        record = wait(lambda: request_done(api, "scale_in", request["request_id"]), 180, "scale-in")
        assert record["status"] == "COMPLETED", record
        shrunk = api.training_step()
        assert [e["kind"] for e in api.engines()] == ["initial", "initial"]
        wait(lambda: api.training_step() > shrunk, 120, "training to keep advancing after scale-in")
        started = {p.pid for p in psutil.Process(driver.pid).children(recursive=True)}
        assert started, "the driver should have started Ray and engine processes"

        # An engine's server SIGKILLed mid-generation: a step's requests take a fraction of a second on the tiny
        # model, so the victim's load is watched closely (its open /metrics); once at least 2 requests run holding
        # 64 tokens each on average (past their first chunks of 8, about 32 tokens still to go: several engine
        # steps), the server is SIGKILLed at once. The summary's migration counters then prove requests were cut
        # mid-way (the run's /pause_generation needs the admin key, which only the run holds, so the test does not
        # freeze it first).
        victim = next(e for e in api.active() if e["engine_id"] == "engine_1")
        pid = server_pid(driver.pid, victim["url"])
        engine = httpx.Client(base_url=victim["url"], timeout=10, trust_env=False)
        try:
            wait(lambda: (load := batch(engine))[0] >= 2 and load[1] >= 64 * load[0], 240,
                 "engine_1 part-way through requests", poll_s=0.002)
        finally:
            engine.close()
        os.killpg(pid, signal.SIGKILL)
        crashed_at = api.training_step()
        # the run goes on: the crash is seen for what it is (the signal, not a connection error), the dead initial
        # engine is replaced in its own bundle, and training advances past the step that was cut
        wait(lambda: "engine_1 failed (server process was killed by SIGKILL" in log_path.read_text(errors="replace"),
             120, "the driver's log to name engine_1's crash")
        wait(lambda: len(api.active()) == 2 and api.training_step() >= crashed_at + 2, 180,
             "engine_1 replaced and training past the crash")
    finally:
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert driver.returncode == 0, text[-3000:]
    assert "SIGTERM: stopping after step" in text
    steps_logged = len([r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                        if r["kind"] == "train"])
    assert (ckpt / "latest").read_text().strip() == f"step_{steps_logged:06d}"
    wait_until(lambda: not any(map(_running, started)), 60, "every process the run started to exit")
    rows = [json.loads(line) for line in (out / "sample_versions.jsonl").read_text().splitlines()]
    assert len(rows) >= 9
    for row in rows:  # the trainer never got a sample older than --max-staleness 1
        assert max(row["trainer_version"] - v for v in row["sample_versions"]) <= 1
    # the crash lost nothing: every step the trainer took (its samples are recorded as it takes them) has its
    # whole batch, once; the cut requests continued from their prefixes
    continued = assert_crash_lost_nothing(text, out, steps=len(rows))
    print(f"engine crash mid-generation: {continued} request(s) continued elsewhere, 0 tokens regenerated")
