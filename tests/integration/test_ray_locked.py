"""The embedded Ray cluster is locked: loopback only, and a driver without the run's token cannot attach."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import ray

from relax.cluster.embedded import current_session_dir, session_processes

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
ATTACH = "import ray; ray.init(address={address!r}, log_to_driver=False); print('ATTACHED', flush=True)"


def _attach(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", ATTACH.format(address=address)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_every_process_of_the_embedded_cluster_listens_on_loopback_only(ray_cluster) -> None:
    @ray.remote(num_cpus=0)
    def worker_pid() -> int:  # a worker too, not only the GCS, raylet and agents
        return os.getpid()

    pid = ray.get(worker_pid.remote())
    session = current_session_dir()
    assert session is not None
    procs = {p.pid: p for p in session_processes(session)}
    assert pid in procs or psutil.pid_exists(pid)
    listening: set[tuple[str, str]] = set()
    for proc in [*procs.values(), *([] if pid in procs else [psutil.Process(pid)])]:
        try:
            listening |= {(proc.name(), c.laddr.ip) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    names = {name for name, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    assert {(name, ip) for name, ip in listening if ip not in LOOPBACK} == set()
    assert ray.util.get_node_ip_address() == "127.0.0.1"


def test_a_driver_without_the_token_cannot_attach(ray_cluster) -> None:
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:")
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    no_token = _attach(address, {**base, "RAY_AUTH_MODE": "token"})
    assert no_token.returncode != 0 and "ATTACHED" not in no_token.stdout
    assert "AuthenticationError" in no_token.stderr, no_token.stderr[-2000:]
    # A guessed token, and a client that does not even try auth: both refused by the GCS.
    for env in ({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "guess"}, {**base, "RAY_AUTH_MODE": "disabled"}):
        refused = _attach(address, {**env, "RAY_gcs_server_port_wait_time_s": "1"})
        assert refused.returncode != 0 and "ATTACHED" not in refused.stdout
        assert "InvalidAuthToken" in refused.stderr or "Unauthenticated" in refused.stderr, refused.stderr[-2000:]
