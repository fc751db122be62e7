"""The embedded Ray cluster is locked: loopback only, and a driver without the run's token cannot attach."""

from __future__ import annotations

import os

import psutil
import ray

from relax.cluster.embedded import current_session_dir, session_processes
from tests.ray_access import attach, listening, not_loopback


def test_every_process_of_the_embedded_cluster_listens_on_loopback_only(ray_cluster) -> None:
    @ray.remote(num_cpus=0)
    def worker_pid() -> int:  # a worker too, not only the GCS, raylet and agents
        return os.getpid()

    pid = ray.get(worker_pid.remote())
    session = current_session_dir()
    assert session is not None
    procs = {p.pid: p for p in session_processes(session)}
    assert pid in procs or psutil.pid_exists(pid)
    pids = [*procs, *([] if pid in procs else [pid])]
    names = {name for _, name, _ in listening(pids)}
    assert {"gcs_server", "raylet"} <= names, listening(pids)
    assert not_loopback(pids) == set()
    assert ray.util.get_node_ip_address() == "127.0.0.1"


def test_a_driver_without_the_token_cannot_attach(ray_cluster) -> None:
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:")
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    no_token = attach(address, {**base, "RAY_AUTH_MODE": "token"})
    assert no_token.returncode != 0 and "ATTACHED" not in no_token.stdout
    assert "AuthenticationError" in no_token.stderr, no_token.stderr[-2000:]
    # A guessed token, and a client that does not even try auth: both refused by the GCS.
    for env in ({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "guess"}, {**base, "RAY_AUTH_MODE": "disabled"}):
        refused = attach(address, {**env, "RAY_gcs_server_port_wait_time_s": "1"})
        assert refused.returncode != 0 and "ATTACHED" not in refused.stdout
        assert "InvalidAuthToken" in refused.stderr or "Unauthenticated" in refused.stderr, refused.stderr[-2000:]
