"""A worker node started the way a KubeRay worker pod starts one: ``ray start --address=... --block``.

Why this exists beside the fake autoscaled nodes of ``relax.cluster.local_elastic``: those are bare raylets
the fake provider starts and kills itself, so nothing of Ray's own shutdown path runs when they go. A
``ray start --block`` process is what a pod's PID 1 is; on SIGTERM (the kubelet deleting the pod, a VM
shutting down) Ray >= 2.57 marks its node DRAINING with reason PREEMPTION and a deadline
``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` from now, waits until the node is idle or the deadline passed, and
exits. That is the notice ``relax.cluster.drain`` reads; a test that SIGTERMs this process sends it the way
the platform does.

The process runs in its own session (process group) and is stopped by signalling that group, never by
``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from relax.cluster import ray_auth
from relax.cluster.local_elastic import ElasticClusterError, connect_gcs, ray_executable
from relax.cluster.network import free_port

__all__ = ["WorkerNode", "WorkerNodeConfig"]

MB = 1024 * 1024


@dataclass(frozen=True)
class WorkerNodeConfig:
    """What the node offers and how long Ray drains it on SIGTERM."""

    num_cpus: int = 2
    num_gpus: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    object_store_mb: int = 128
    drain_timeout_s: float = 30.0
    """``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` of the node: the deadline of the notice SIGTERM gives."""
    env: dict[str, str] = field(default_factory=dict)


class WorkerNode:
    """One ``ray start --block`` worker joined to ``address``; ``node_id`` once it registered."""

    def __init__(self, address: str, log_path: Path, config: WorkerNodeConfig | None = None) -> None:
        self.address = address
        self.log_path = log_path
        self.config = config or WorkerNodeConfig()
        self.node_id: str | None = None
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise ElasticClusterError("worker node not started")
        return self._popen.pid

    def start(self, timeout: float = 60.0) -> str:
        """Start the node and wait until the GCS lists it alive; returns its node id (hex)."""
        cfg = self.config
        before = set(_alive_node_ids(self.address))
        cmd = [
            *ray_executable(), "start", f"--address={self.address}", "--block",
            f"--num-cpus={cfg.num_cpus}", f"--num-gpus={cfg.num_gpus}",
            f"--resources={json.dumps(cfg.resources)}", f"--object-store-memory={cfg.object_store_mb * MB}",
            # fixed default ports collide with the head's and other nodes' on one machine
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
            # the head's log monitor already tails the logs folder this node shares (Ray: one per host)
            "--include-log-monitor=false",
            "--disable-usage-stats",
        ]
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(cfg.drain_timeout_s),
               "RAY_USAGE_STATS_ENABLED": "0", **cfg.env}
        env.pop("RAY_ADDRESS", None)
        # Ray's loopback switch makes `ray start --address` refuse to join; a worker of a 127.0.0.1 head finds
        # 127.0.0.1 on its own (relax.cluster.ray_auth). The token comes with the caller's environment.
        env.pop(ray_auth.LOOPBACK_ENV, None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            new = set(_alive_node_ids(self.address)) - before
            if new:
                (self.node_id,) = new
                return self.node_id
            code = self._popen.poll()
            if code is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.kill()
                why = f"exited with code {code}" if code is not None else f"did not register within {timeout:.0f}s"
                raise ElasticClusterError(f"`ray start --block` worker {why}; log tail:\n{tail}")
            time.sleep(0.2)

    def terminate(self) -> None:
        """SIGTERM the ``ray start --block`` process, as a pod deletion does (Ray drains the node)."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The process's exit code, or None if it still runs after ``timeout`` seconds."""
        if self._popen is None:
            return None
        try:
            return self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the node's whole process group (raylet, workers); idempotent."""
        if self._popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=10)

    def __enter__(self) -> WorkerNode:
        if self._popen is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()


def _alive_node_ids(address: str) -> list[str]:
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = connect_gcs(address).get_all_node_info(timeout=10)
    return [node_id.hex() for node_id, info in infos.items() if info.state == GcsNodeInfo.ALIVE]
