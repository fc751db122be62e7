"""The local elastic cluster really grows on a pending placement group and shrinks when it goes away.

The pytest process may already run its own local Ray (session fixtures), so the driver that talks to the
elastic cluster runs in a subprocess: a tiny line protocol (one JSON command in, one JSON reply out) lets the
test observe the cluster between the driver's steps. Timings are printed (and attached to the test report),
never asserted: performance belongs in benchmarks/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from relax.cluster import ray_auth
from relax.cluster.local_elastic import ClusterInfo, ElasticCluster, ElasticClusterConfig, stop_cluster
from relax.cluster.network import free_port
from tests.ray_access import attach, listening, not_loopback

T = TypeVar("T")

DRIVER = r'''
import json, sys, time
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# the job's package (runtime_env working_dir), as `ray job submit --working-dir` gives one
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR", runtime_env={"working_dir": sys.argv[2]})
groups = {}
probes = {}

@ray.remote(num_cpus=0)
class Probe:
    """Imports a module from its job package (runtime_env working_dir) and reports where that file is."""
    def where(self):
        import os, probe_module
        return probe_module.__file__, os.stat(probe_module.__file__).st_ino

def reply(**kw):
    print(json.dumps(kw), flush=True)

reply(event="connected", resources=ray.cluster_resources())
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "create":
        pg = placement_group(cmd["bundles"], strategy=cmd.get("strategy", "PACK"))
        groups[cmd["name"]] = pg
        reply(event="created", t=time.time(), state=placement_group_table(pg)["state"])
    elif op == "ready":
        pg = groups[cmd["name"]]
        try:
            ray.get(pg.ready(), timeout=cmd["timeout"])
            reply(event="ready", t=time.time(), ok=True, state=placement_group_table(pg)["state"])
        except ray.exceptions.GetTimeoutError:
            reply(event="ready", t=time.time(), ok=False, state=placement_group_table(pg)["state"])
    elif op == "remove":
        remove_placement_group(groups.pop(cmd["name"]))
        reply(event="removed", t=time.time())
    elif op == "probe":  # an actor of the job, in group cmd["name"] if given
        options = {}
        if cmd.get("name"):
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(groups[cmd["name"]])
        probes[cmd["probe"]] = Probe.options(**options).remote()
        file, ino = ray.get(probes[cmd["probe"]].where.remote(), timeout=60)
        reply(event="probe", file=file, ino=ino)
    elif op == "where":
        file, ino = ray.get(probes[cmd["probe"]].where.remote(), timeout=30)
        reply(event="where", file=file, ino=ino)
    elif op == "exit":
        reply(event="bye")
        break
ray.shutdown()
'''


def _poll(read: Callable[[], T], done: Callable[[T], bool], timeout: float) -> T:
    """Read until ``done`` holds or the deadline passes (then fail with the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s; last value: {value}")
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _survivors(pids: list[int]) -> list[int]:
    """The pids still running (zombies awaiting their parent's reap count as gone)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


class Driver:
    """A Ray driver in a subprocess, connected to the elastic cluster."""

    def __init__(self, address: str, env: dict[str, str], package: Path, log: Path) -> None:
        self.log = log  # its stderr: why it exited, should it exit
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, address, str(package)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=5)
            raise RuntimeError(f"driver exited with code {code}:\n{self.log.read_text(errors='replace')[-3000:]}")
        return json.loads(line)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a dead driver is fine; make sure it is gone
                self.proc.kill()
                self.proc.wait(timeout=10)


def _running_job_driver(info: ClusterInfo, tmp_path: Any) -> int:
    """Submit a job whose driver attaches to Ray and waits; return the driver's pid once it runs."""
    from ray.job_submission import JobSubmissionClient

    pid_file = tmp_path / "job.pid"
    code = (f"import os, time, ray; ray.init(); open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(600)")
    client = JobSubmissionClient(info.dashboard_url)
    client.submit_job(entrypoint=f"{sys.executable} -c \"{code}\"")
    return _poll(lambda: int(pid_file.read_text()) if pid_file.is_file() and pid_file.read_text() else 0,
                 bool, timeout=60)


def test_elastic_cluster_grows_and_shrinks(record_property: Any, tmp_path: Any) -> None:
    # Dashboard on, as `relax cluster up` runs it: `ray job submit` needs its jobs API.
    config = ElasticClusterConfig(head_gpus=2, max_elastic=2,
                                  include_dashboard=True, dashboard_port=free_port())
    cluster = ElasticCluster(config)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    info = cluster.start(timeout=120)
    timings["cluster_start_s"] = time.monotonic() - t0
    try:
        assert info.dashboard_url is not None
        # The jobs API wants Ray's token: refused without it, served with it.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{info.dashboard_url}/api/jobs/", timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(f"{info.dashboard_url}/api/jobs/",
                                         headers=ray_auth.auth_headers({**os.environ, **info.env()}))
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == []
        status = cluster.status()
        head = status.head
        assert head is not None and status.elastic_nodes == []
        assert head.total["GPU"] == 2 and head.total["stable_gpu"] == 2 and head.total["stable_cpu"] == 3

        # The job's package, in use on the head before any node joins (as the recipe's run is when it scales out).
        package = tmp_path / "package"
        package.mkdir()
        (package / "probe_module.py").write_text("VALUE = 1\n")
        driver = Driver(info.address, info.env(), package, tmp_path / "driver.err")
        try:
            hello = driver.read()
            assert hello["resources"]["stable_gpu"] == 2, hello
            assert hello["resources"]["stable_cpu"] == 3, hello

            # Baseline bundles with the stable markers fill the head's GPUs, as Relax's baseline would.
            baseline = [{"GPU": 1, "CPU": 1, "stable_gpu": 1, "stable_cpu": 1}] * 2
            driver.call(op="create", name="baseline", bundles=baseline)
            assert driver.call(op="ready", name="baseline", timeout=30)["ok"]

            on_head = driver.call(op="probe", probe="head")

            # One more GPU does not fit on the head: the group is pending and the autoscaler must add a node.
            created = driver.call(op="create", name="elastic", bundles=[{"GPU": 1, "CPU": 1}])
            t_created = time.monotonic()
            assert created["state"] == "PENDING", created
            pending = _poll(cluster.status, lambda st: bool(st.pending_placement_groups), timeout=10)
            assert pending.elastic_nodes == [], pending.format()
            assert pending.pending_placement_groups[0].bundles == [{"GPU": 1.0, "CPU": 1.0}], pending.format()

            up = cluster.wait_for_nodes(1, timeout=90)
            timings["node_up_s"] = time.monotonic() - t_created
            node = up.elastic_nodes[0]
            assert node.total["GPU"] == 1 and node.total["CPU"] == 1 and "stable_gpu" not in node.total
            # Every process while the fake node is up (its raylet included), to check that stop leaves none,
            # and that all of them, the fake node's included, listen on loopback only.
            pids = set(cluster.pids())
            assert not_loopback(sorted(pids)) == set()

            ready = driver.call(op="ready", name="elastic", timeout=60)
            assert ready["ok"], ready
            timings["pg_ready_s"] = time.monotonic() - t_created

            # The joining node extracts the package into its own folder: the head's copy, which its workers
            # import from, is left as it was (a shared folder was deleted and re-extracted under them).
            on_node = driver.call(op="probe", probe="node", name="elastic")
            assert Path(on_node["file"]).parts[-4] != Path(on_head["file"]).parts[-4], (on_node, on_head)
            assert driver.call(op="where", probe="head") == {**on_head, "event": "where"}
            # One log monitor on this host, the head's (Ray: one per physical host, or every line twice).
            assert len([p for p in pids if "log_monitor" in _cmdline(p)]) == 1

            driver.call(op="remove", name="elastic")
            t_removed = time.monotonic()
            gone = cluster.wait_for_nodes(0, timeout=90)
            timings["node_removed_s"] = time.monotonic() - t_removed
            assert gone.head is not None and gone.head.total["stable_gpu"] == 2
        finally:
            driver.close()

        pids |= set(cluster.pids())
        assert info.head_pid in pids
        # A job still running when the cluster stops: its driver is stopped first, not left spinning.
        job_pid = _running_job_driver(info, tmp_path)
        pids.add(job_pid)
    finally:
        t_stop = time.monotonic()
        cluster.stop(timeout=30)
        timings["stop_s"] = time.monotonic() - t_stop
    cluster.stop()  # idempotent
    assert _survivors(sorted(pids)) == [], "processes of the cluster survived stop"
    assert not os.path.exists(info.root_dir)
    timings["total_s"] = time.monotonic() - t0
    for key, value in timings.items():
        record_property(key, round(value, 2))
    print("elastic cluster timings:", json.dumps({k: round(v, 2) for k, v in timings.items()}))


def test_autoscaling_config_is_complete() -> None:
    """The v1 config carries everything the fake provider needs (the wheel has no example file to fall back on)."""
    cfg = ElasticClusterConfig(head_gpus=4, max_elastic=3, node_group="g1")
    conf = cfg.autoscaling_config("10.0.0.1:6380")
    assert conf["provider"] == {"type": "external", "module": "relax.cluster.fake_nodes.SeparateFakeNodeProvider",
                                "use_node_id_as_ip": True, "disable_node_updaters": True,
                                "disable_launch_config_check": True, "gcs_address": "10.0.0.1:6380"}
    head = conf["available_node_types"][conf["head_node_type"]]
    assert head["resources"] == {"CPU": 6, "GPU": 4, "g1_gpu": 4.0, "g1_cpu": 5.0} and head["max_workers"] == 0
    elastic = conf["available_node_types"]["elastic"]
    assert (elastic["min_workers"], elastic["max_workers"], conf["max_workers"]) == (0, 3, 3)
    assert {k: elastic["resources"][k] for k in ("CPU", "GPU")} == {"CPU": 1, "GPU": 1}
    with pytest.raises(ValueError):
        ElasticClusterConfig(min_elastic=2, max_elastic=1)


def _shell_env() -> dict[str, str]:
    """A user's shell: no Ray token of its own (the test session's is not theirs)."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}


def _cli(state_dir: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax.cli", "cluster", *args, "--state-dir", state_dir],
                          capture_output=True, text=True, timeout=timeout, env=_shell_env())


RELAX_DRIVER = """
import logging, os
import ray
from relax.cluster.connect import connect_existing
logging.basicConfig(level=logging.INFO)
print("ROUTABLE", ray.util.get_node_ip_address(), flush=True)
connect_existing(os.environ["RAY_ADDRESS"])
print("ATTACHED", flush=True)
"""


def test_cluster_cli_up_status_down(tmp_path: Any) -> None:
    """`up` detaches (the head outlives the command), `status` reads it, `down` stops exactly those processes."""
    state_dir = str(tmp_path / "state")
    state_file = tmp_path / "state" / "cluster.json"
    assert _cli(state_dir, "status").returncode == 1
    assert "not up" in _cli(state_dir, "down").stderr
    try:
        up = _cli(state_dir, "up", "--gpus", "1", "--max-elastic", "1", "--no-dashboard")
        assert up.returncode == 0, up.stderr
        info = ClusterInfo.from_json(state_file.read_text())
        assert f"export RAY_ADDRESS={info.address}" in up.stdout and "export RAY_AUTH_MODE=token" in up.stdout
        assert info.address.startswith("127.0.0.1:") and info.token_path is not None
        assert f"export RAY_AUTH_TOKEN_PATH={info.token_path}" in up.stdout
        assert os.stat(info.token_path).st_mode & 0o777 == 0o600
        pids = ElasticCluster.attach(info).pids()
        assert info.head_pid in pids
        assert listening(pids) and not_loopback(pids) == set()

        # A driver without the token is refused at once; one with the token `up` printed attaches. The refused
        # one has every other line `up` printed (without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray swaps 127.0.0.1
        # for the machine's routable address, where nothing listens, and retries there for ever).
        no_token = {k: v for k, v in info.env().items() if k != ray_auth.TOKEN_PATH_ENV}
        refused = attach(info.address, {**_shell_env(), **no_token})
        assert refused.returncode != 0 and "ATTACHED" not in refused.stdout
        assert "AuthenticationError" in refused.stderr, refused.stderr[-2000:]
        attached = attach(info.address, {**_shell_env(), **info.env()})
        assert "ATTACHED" in attached.stdout, attached.stderr[-2000:]
        # Relax's driver given only the address and the token (the loopback switch not exported): it keeps to
        # loopback by itself, where a plain `ray.init` would retry on the routable address for ever.
        partial = {k: v for k, v in _shell_env().items() if k != ray_auth.LOOPBACK_ENV}
        partial.update(RAY_ADDRESS=info.address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=info.token_path)
        relax_driver = subprocess.run([sys.executable, "-c", RELAX_DRIVER], env=partial, capture_output=True,
                                      text=True, timeout=120)
        assert "ATTACHED" in relax_driver.stdout, relax_driver.stderr[-2000:]
        routable = relax_driver.stdout.split("ROUTABLE ", 1)[1].split()[0]
        if routable != "127.0.0.1":  # a machine with a routable address, where Ray would have gone
            assert f"answers on loopback only (not on {routable})" in relax_driver.stderr, relax_driver.stderr

        again = _cli(state_dir, "up", "--no-dashboard")
        assert again.returncode == 1 and "already up" in again.stderr

        status = _cli(state_dir, "status", "--json")
        assert status.returncode == 0, status.stderr
        nodes = json.loads(status.stdout)["nodes"]
        assert [n["total"]["stable_gpu"] for n in nodes if n["is_head"]] == [1.0]

        down = _cli(state_dir, "down")
        assert down.returncode == 0, down.stderr
        assert not state_file.exists()
        assert _survivors(pids) == []
        assert _cli(state_dir, "status").returncode == 1
    finally:
        if state_file.exists():  # never leak a detached cluster, whatever failed above
            stop_cluster(ClusterInfo.from_json(state_file.read_text()), timeout=15)
