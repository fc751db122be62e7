"""A local elastic Ray cluster: a real head plus *fake* autoscaled worker nodes, all on this machine.

Why this exists: Relax's rollout pool grows and shrinks on capacity that a cluster provisioner adds and
takes back. To exercise that loop without a cloud we run Ray's ``fake_multinode`` node provider: the
autoscaler (v1) starts real raylets on this host with logical GPUs when placement groups are pending, and
kills them again once they have been idle for ``idle_timeout_minutes``.

Traps this module works around (measured; docs/development.md, "Traps when the whole cluster is on one machine"):

* ``ray.cluster_utils.AutoscalingCluster`` runs ``ray stop --force``, which kills *every* Ray on the
  machine. We start ``ray start --head --block`` ourselves in a new session (process group) and stop it by
  signalling that group, then sweep any process whose command line names this cluster's private temp dir.
* The provider config must carry ``gcs_address``; without it fake nodes dial port 6379 and hang silently.
* The wheel lacks the example YAML that autoscaler v2 and the stock helper need, so we write a complete v1
  config and pin ``RAY_enable_autoscaler_v2=0``.
* Locked like every cluster Relax starts (``relax.cluster.ray_auth``): node address 127.0.0.1 (every
  process, fake nodes included, listens on loopback only) and Ray's token auth on; the token is the
  caller's ``RAY_AUTH_TOKEN`` or a new one, kept in ``<root>/auth_token`` (0600) for later drivers.

Nothing here calls ``ray.init``: status comes straight from the GCS through a ``GcsClient``, so the class is
safe to use from a process that already runs its own local Ray (a pytest session, for instance).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from relax.cluster import ray_auth
from relax.cluster.embedded import embedded_ray_env
from relax.cluster.network import LOCALHOST as LOOPBACK
from relax.cluster.network import free_ports, port_answers
from relax.cluster.startup import START_ATTEMPTS, start_timed_out

logger = logging.getLogger(__name__)

# The fake provider hard-codes the head's node type name and node id (ray/autoscaler/_private/fake_multi_node).
HEAD_NODE_TYPE = "ray.head.default"
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
ELASTIC_NODE_TYPE = "elastic"
# Loaded by the head's autoscaler; named, not imported, so this module does not pull in Ray's autoscaler
# (tests/unit/test_fake_nodes.py keeps it equal to relax.cluster.fake_nodes.MODULE_PATH).
FAKE_NODE_PROVIDER = "relax.cluster.fake_nodes.SeparateFakeNodeProvider"
MB = 1024 * 1024


class ElasticClusterError(RuntimeError):
    """The local elastic cluster could not be started, reached or stopped as asked."""


# ------------------------------------------------------------------------------------------------ config


@dataclass
class ElasticClusterConfig:
    """Shape of the local elastic cluster.

    The head plays the *stable* node group: it declares the baseline GPUs plus the marker resources
    ``{G}_gpu`` / ``{G}_cpu`` that Relax's baseline bundles and control-plane actors ask for
    (docs/architecture.md, "Placement and eviction").
    The ``elastic`` worker type is what the autoscaler adds for pending placement groups and removes when idle.
    """

    head_gpus: int = 4
    """Baseline logical GPUs on the head."""
    head_cpus: int | None = None
    """Head CPUs; default ``head_gpus + 2``: one per baseline bundle, one for control-plane actors, one spare
    so a driver-side task never waits behind the bundles."""
    node_group: str = "stable"
    """``G`` in the head's marker resources ``{G}_gpu`` and ``{G}_cpu`` (``RELAX_INITIAL_NODE_GROUP``)."""
    extra_head_resources: dict[str, float] = field(default_factory=dict)
    max_elastic: int = 4
    """Most elastic worker nodes the autoscaler may add."""
    min_elastic: int = 0
    elastic_gpus: int = 1
    elastic_cpus: int = 1
    elastic_node_type: str = ELASTIC_NODE_TYPE
    idle_timeout_minutes: float = 0.25
    """Keep it well above the time a node takes to start. Ray's v1 autoscaler counts a node idle from its raylet's
    start and reads pending placement groups and idle times in two calls, so a node whose group lands after the
    timeout can be removed just as the group lands (seen at 0.1 min on a loaded 2-core machine: the group was
    ready, its first actor was cancelled by the node's SIGTERM)."""
    upscaling_speed: float = 1.0
    include_dashboard: bool = True
    """On by default so ``ray job submit`` and the state API work; costs ~1 GB more memory."""
    dashboard_port: int = 8265
    """0 picks a free port."""
    port: int = 0
    """GCS port; 0 picks a free port."""
    root_dir: str | None = None
    """Per-cluster directory (config, logs, Ray temp dir). None: a fresh short directory under the system temp
    dir, removed on stop. Keep it short: Ray puts unix sockets under it (107-byte path limit)."""
    keep_root_dir: bool = False
    """Keep an auto-created ``root_dir`` after stop (for post-mortem logs)."""
    head_object_store_mb: int = 256
    elastic_object_store_mb: int = 100
    cluster_name: str = "relax-elastic"
    autoscaler_update_interval_s: int = 1
    """Seconds between autoscaler rounds (Ray's default 5 makes every scale event ~4 s slower; must be int)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the head (and so the fake nodes, which the head's autoscaler spawns)."""
    loopback: bool = True
    """Bind 127.0.0.1 only (``relax.cluster.ray_auth``). False for a cluster that real worker nodes join
    with ``ray start --address`` (``relax.cluster.worker_node``): in Ray 2.60 the switch that keeps 127.0.0.1
    makes ``ray start --address`` refuse to join, and without it Ray swaps 127.0.0.1 for the routable
    address. Token auth stays on either way."""

    def __post_init__(self) -> None:
        if self.head_gpus < 0 or self.max_elastic < 0 or self.min_elastic < 0:
            raise ValueError("head_gpus, min_elastic and max_elastic must be >= 0")
        if self.min_elastic > self.max_elastic:
            raise ValueError(f"min_elastic ({self.min_elastic}) > max_elastic ({self.max_elastic})")
        if self.elastic_gpus < 0 or self.elastic_cpus < 1:
            raise ValueError("elastic nodes need elastic_cpus >= 1 and elastic_gpus >= 0")
        if not self.node_group or not self.node_group.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"node_group must be a simple name, got {self.node_group!r}")
        if self.idle_timeout_minutes <= 0:
            raise ValueError("idle_timeout_minutes must be > 0")

    @property
    def effective_head_cpus(self) -> int:
        return self.head_cpus if self.head_cpus is not None else self.head_gpus + 2

    def marker_resources(self) -> dict[str, float]:
        """``{G}_gpu`` = baseline GPUs; ``{G}_cpu`` = baseline GPUs + 1 so control-plane actors fit beside them."""
        return {f"{self.node_group}_gpu": float(self.head_gpus), f"{self.node_group}_cpu": float(self.head_gpus + 1)}

    def head_custom_resources(self) -> dict[str, float]:
        return {**self.marker_resources(), **self.extra_head_resources}

    def autoscaling_config(self, gcs_address: str) -> dict[str, Any]:
        """A complete v1 cluster config for the ``fake_multinode`` provider (nothing left to defaults that the
        wheel would read from its missing example file)."""
        head_resources: dict[str, float] = {
            "CPU": self.effective_head_cpus, "GPU": self.head_gpus, **self.head_custom_resources(),
        }
        elastic_resources: dict[str, float] = {
            "CPU": self.elastic_cpus, "GPU": self.elastic_gpus,
            # The fake provider pops this key and hands it to the raylet as its object store size.
            "object_store_memory": self.elastic_object_store_mb * MB,
        }
        return {
            "cluster_name": self.cluster_name,
            "max_workers": self.max_elastic,
            "upscaling_speed": self.upscaling_speed,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "provider": {
                # Ray's fake_multinode provider, each node with its own runtime-env folder (relax.cluster.fake_nodes)
                "type": "external",
                "module": FAKE_NODE_PROVIDER,
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": gcs_address,
            },
            "auth": {},
            "docker": {},
            "head_node_type": HEAD_NODE_TYPE,
            "available_node_types": {
                HEAD_NODE_TYPE: {"resources": head_resources, "node_config": {}, "max_workers": 0},
                self.elastic_node_type: {
                    "resources": elastic_resources,
                    "node_config": {},
                    "min_workers": self.min_elastic,
                    "max_workers": self.max_elastic,
                },
            },
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }


# ------------------------------------------------------------------------------------------------ info


@dataclass
class ClusterInfo:
    """Everything needed to reach and to stop a started cluster; JSON-serialisable so a detached
    ``relax cluster up`` can hand it to a later ``relax cluster down``."""

    address: str
    node_ip: str
    port: int
    dashboard_url: str | None
    head_pid: int
    head_pgid: int
    head_create_time: float
    root_dir: str
    temp_dir: str
    config_path: str
    log_path: str
    owns_root_dir: bool
    elastic_node_type: str = ELASTIC_NODE_TYPE
    session_dir: str | None = None
    token_path: str | None = None  # Ray's auth token (0600); None: the cluster runs with auth off
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def env(self) -> dict[str, str]:
        """Environment a driver (``ray.init()`` / ``ray job submit``) needs to talk to this cluster."""
        env = {"RAY_ADDRESS": self.address}
        if self.node_ip == LOOPBACK:  # else `ray.init` swaps 127.0.0.1 for the routable address, and fails
            env[ray_auth.LOOPBACK_ENV] = "0"
        if self.token_path:
            env.update({ray_auth.MODE_ENV: "token", ray_auth.TOKEN_PATH_ENV: self.token_path})
        else:
            env[ray_auth.MODE_ENV] = "disabled"
        if self.dashboard_url:
            env["RAY_DASHBOARD_ADDRESS"] = self.dashboard_url
        return env


# ------------------------------------------------------------------------------------------------ status


@dataclass
class NodeStatus:
    node_id: str
    node_type: str
    is_head: bool
    ip: str
    state: str
    total: dict[str, float]
    available: dict[str, float]
    idle_ms: int = 0


@dataclass
class PendingGang:
    """A pending placement group (the autoscaler sees it as a gang request)."""

    bundles: list[dict[str, float]]
    details: str = ""


@dataclass
class ClusterStatus:
    """One consistent look at the cluster, read from the GCS (no dashboard, no ``ray.init`` needed)."""

    nodes: list[NodeStatus]
    pending_placement_groups: list[PendingGang]
    pending_demand: list[dict[str, Any]]
    """Unplaced task/actor shapes: ``{"resources": {...}, "count": n}``."""
    resource_requests: list[dict[str, Any]]
    """Standing ``request_resources`` constraints."""
    autoscaler: dict[str, Any]
    """v1 autoscaler report (launching / pending / failed nodes) when it has published one."""
    elastic_node_type: str = ELASTIC_NODE_TYPE

    @property
    def alive_nodes(self) -> list[NodeStatus]:
        return [n for n in self.nodes if n.state != "DEAD"]

    @property
    def head(self) -> NodeStatus | None:
        return next((n for n in self.alive_nodes if n.is_head), None)

    @property
    def worker_nodes(self) -> list[NodeStatus]:
        return [n for n in self.alive_nodes if not n.is_head]

    @property
    def elastic_nodes(self) -> list[NodeStatus]:
        return [n for n in self.worker_nodes if n.node_type == self.elastic_node_type]

    def total(self, resource: str) -> float:
        return sum(n.total.get(resource, 0.0) for n in self.alive_nodes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """Human text for ``relax cluster status``."""
        lines = [f"nodes alive: {len(self.alive_nodes)} (elastic {len(self.elastic_nodes)})"]
        for n in self.alive_nodes:
            role = "head" if n.is_head else n.node_type
            shown = sorted(_public(n.available, n.total))
            res = ", ".join(f"{k}={_fmt_num(v)}/{_fmt_num(n.total[k])}" for k, v in shown)
            idle = f" idle {n.idle_ms / 1000:.1f}s" if n.idle_ms else ""
            lines.append(f"  {role:<16} ..{n.node_id[-8:]} {n.state:<8}{idle}  available/total: {res}")
        if self.pending_placement_groups:
            lines.append(f"pending placement groups: {len(self.pending_placement_groups)}")
            for g in self.pending_placement_groups:
                lines.append(f"  {_fmt_bundles(g.bundles)} {g.details}".rstrip())
        if self.pending_demand:
            lines.append("pending demand:")
            for d in self.pending_demand:
                lines.append(f"  {_fmt_bundles([d['resources']])} x {d['count']}")
        if self.resource_requests:
            lines.append("standing resource requests:")
            for d in self.resource_requests:
                lines.append(f"  {_fmt_bundles([d['resources']])} x {d['count']}")
        pending = self.autoscaler.get("pending_launches") or {}
        launching = {k: v for k, v in pending.items() if v}
        if launching:
            lines.append("launching: " + ", ".join(f"{k} x {v}" for k, v in sorted(launching.items())))
        if not (self.pending_placement_groups or self.pending_demand or self.resource_requests or launching):
            lines.append("pending demand: none")
        return "\n".join(lines)


# Ray's per-placement-group shadow resources: CPU_group_<pg id>, GPU_group_0_<pg id>, bundle_group_<pg id>...
_PG_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{32,}$")


def _public(available: dict[str, float], total: dict[str, float]) -> list[tuple[str, float]]:
    """Resources worth printing: drop ``node:<ip>``, memory byte counts and placement-group shadow resources."""
    return [(k, available.get(k, 0.0)) for k in total
            if not k.startswith("node:") and k not in ("memory", "object_store_memory") and not _PG_RESOURCE.search(k)]


def _fmt_num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _fmt_bundles(bundles: Iterable[dict[str, float]]) -> str:
    return "[" + ", ".join("{" + ", ".join(f"{k}: {_fmt_num(v)}" for k, v in sorted(b.items())) + "}"
                           for b in bundles) + "]"


def connect_gcs(address: str) -> Any:
    """A GCS client for ``address`` (no driver: safe beside a process's own local Ray).

    It authenticates with this process's Ray token (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``); a process
    that reaches a ``relax cluster up`` cluster gets them from ``ClusterInfo.env()``.
    """
    from ray._raylet import GcsClient

    return GcsClient(address=address)


def read_status(address: str, *, elastic_node_type: str = ELASTIC_NODE_TYPE, timeout: float = 10.0,
                gcs_client: Any = None) -> ClusterStatus:
    """Read nodes, pending placement groups and demand from the GCS at ``address``.

    Uses the GCS autoscaler-state RPC (what the autoscaler itself reads), so it works without the dashboard
    and without connecting a driver.
    """
    from ray.core.generated.autoscaler_pb2 import GetClusterResourceStateReply
    from ray.core.generated.autoscaler_pb2 import NodeStatus as PbNodeStatus
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    client = gcs_client if gcs_client is not None else connect_gcs(address)
    reply = GetClusterResourceStateReply()
    reply.ParseFromString(client.get_cluster_resource_state(timeout_s=timeout))
    state = reply.cluster_resource_state
    infos = client.get_all_node_info(timeout=timeout)
    by_id: dict[str, Any] = {nid.hex(): info for nid, info in infos.items()}

    nodes: list[NodeStatus] = []
    for ns in state.node_states:
        nid = ns.node_id.hex()
        info = by_id.get(nid)
        is_head = bool(info.is_head_node) if info is not None else nid == FAKE_HEAD_NODE_ID
        node_type = ns.ray_node_type_name or (info.node_type_name if info is not None else "") or (
            HEAD_NODE_TYPE if is_head else "")
        nodes.append(NodeStatus(
            node_id=nid, node_type=node_type, is_head=is_head, ip=ns.node_ip_address,
            state=PbNodeStatus.Name(ns.status), total=dict(ns.total_resources),
            available=dict(ns.available_resources), idle_ms=int(ns.idle_duration_ms),
        ))
    # Nodes the resource state no longer lists but the node table still calls alive (a raylet that just
    # registered): report them so wait_for_nodes never undercounts a joining node for long.
    seen = {n.node_id for n in nodes}
    for nid, info in by_id.items():
        if nid not in seen and info.state == GcsNodeInfo.ALIVE:
            nodes.append(NodeStatus(
                node_id=nid, node_type=info.node_type_name or (HEAD_NODE_TYPE if info.is_head_node else ""),
                is_head=bool(info.is_head_node), ip=info.node_manager_address, state="RUNNING",
                total=dict(info.resources_total), available={},
            ))
    nodes.sort(key=lambda n: (not n.is_head, n.node_id))

    gangs = [PendingGang(bundles=[dict(r.resources_bundle) for r in g.requests], details=g.details)
             for g in state.pending_gang_resource_requests]
    demand = [{"resources": dict(r.request.resources_bundle), "count": int(r.count)}
              for r in state.pending_resource_requests]
    constraints = [{"resources": dict(r.request.resources_bundle), "count": int(r.count)}
                   for c in state.cluster_resource_constraints for r in c.resource_requests]
    return ClusterStatus(nodes=nodes, pending_placement_groups=gangs, pending_demand=demand,
                         resource_requests=constraints, autoscaler=_autoscaler_report(client, timeout),
                         elastic_node_type=elastic_node_type)


def _autoscaler_report(client: Any, timeout: float) -> dict[str, Any]:
    """The v1 autoscaler's own summary (what ``ray status`` prints): launching and failed nodes."""
    from ray._private import ray_constants

    try:
        raw = client.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode(), None, timeout=timeout)
    except Exception:  # noqa: BLE001 - the report is optional decoration
        return {}
    if not raw:
        return {}
    try:
        report = json.loads(raw).get("autoscaler_report") or {}
    except ValueError:
        return {}
    return {
        "active_nodes": report.get("active_nodes") or {},
        "idle_nodes": report.get("idle_nodes") or {},
        "pending_launches": report.get("pending_launches") or {},
        "pending_nodes": report.get("pending_nodes") or [],
        "failed_nodes": report.get("failed_nodes") or [],
    }


# ------------------------------------------------------------------------------------------------ processes


def _psutil() -> Any:
    """psutil is not a Relax runtime dependency, but Ray vendors it (``ray/thirdparty_files``, put on
    ``sys.path`` by ``import ray``)."""
    try:
        import psutil
    except ImportError:
        importlib.import_module("ray")  # side effect: puts ray/thirdparty_files on sys.path
        psutil = importlib.import_module("psutil")
    return psutil


def port_in_use(port: int, host: str = "") -> bool:
    """True when nothing can bind ``port`` on all interfaces (what the GCS and dashboard need)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def cluster_processes(info: ClusterInfo) -> list[Any]:
    """Live processes that belong to this cluster: the head's process group (``ray start`` and everything it
    spawned, fake nodes included) plus anything whose command line names the cluster's private temp dir (a
    raylet or worker that moved to another group). The create-time check guards against reused pids."""
    psutil = _psutil()

    found: list[Any] = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        pid = proc.info["pid"]
        if pid == me:
            continue
        try:
            if proc.info["create_time"] + 1.0 < info.head_create_time:
                continue
            pgid = os.getpgid(pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
        cmdline = " ".join(proc.info["cmdline"] or [])
        # The group match also asks for "ray" in the command line: a stale state file's pgid may be reused.
        if (info.temp_dir and info.temp_dir in cmdline) or (pgid == info.head_pgid and "ray" in cmdline):
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
    return found


def _head_process(info: ClusterInfo) -> Any | None:
    """The ``ray start --head --block`` process, if it is still the one we started (pid reuse guard)."""
    psutil = _psutil()

    try:
        proc = psutil.Process(info.head_pid)
        if abs(proc.create_time() - info.head_create_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def stop_jobs(info: ClusterInfo, timeout: float = 15.0) -> list[str]:
    """Stop the cluster's running jobs through its jobs API and wait until they ended; returns their ids.

    Why first: a job's driver is not a process of the cluster; once the GCS is gone it spins, reconnecting,
    for about a minute before it gives up. Stopped through the API, Ray SIGTERMs the driver's process group
    (SIGKILL after a few seconds) while the cluster can still record it. Best effort: without a dashboard
    there are no jobs; an API error is logged, and the cluster is stopped anyway.
    """
    if not info.dashboard_url or _head_process(info) is None:
        return []
    try:
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(info.dashboard_url,
                                     headers=ray_auth.auth_headers({**os.environ, **info.env()}) or None)
        running = [j.submission_id or j.job_id for j in client.list_jobs()
                   if j.status in (JobStatus.PENDING, JobStatus.RUNNING)]
        for job_id in running:
            logger.info("elastic cluster %s: stopping job %s before the cluster", info.address, job_id)
            client.stop_job(job_id)
        deadline = time.monotonic() + timeout
        left = list(running)
        while left and time.monotonic() < deadline:
            left = [j for j in left if not client.get_job_status(j).is_terminal()]
            if left:
                time.sleep(0.2)
        if left:
            logger.warning("elastic cluster %s: jobs %s did not stop within %.0fs", info.address, left, timeout)
        return running
    except Exception as exc:  # noqa: BLE001 - the cluster must still come down
        logger.warning("elastic cluster %s: could not stop its jobs first: %s", info.address, exc)
        return []


def stop_cluster(info: ClusterInfo, timeout: float = 30.0, popen: subprocess.Popen[bytes] | None = None) -> list[int]:
    """Stop exactly the processes of this cluster and return the pids that were running. Safe to call twice.

    Order matters (measured): SIGTERM to ``ray start --block`` alone makes it shut its node down in order
    (~3 s). SIGTERM to the whole process group at once makes the GCS, raylet and ``ray start`` wedge on each
    other's graceful shutdown for tens of seconds. So: SIGTERM the head process and wait for it (up to
    ``timeout``); then SIGTERM the fake nodes' processes, which the head does not own and which would otherwise
    wait a minute for the GCS to come back; then SIGKILL whatever is left (group members and stragglers found
    by their temp dir).
    """
    psutil = _psutil()

    stop_jobs(info, timeout=min(15.0, timeout / 2))
    deadline = time.monotonic() + timeout
    procs = cluster_processes(info)
    pids = sorted(p.pid for p in procs)
    head = _head_process(info)
    if procs:
        logger.info("elastic cluster %s: stopping %d processes (head pid %d)", info.address, len(procs), info.head_pid)
    # 1. The autoscaler and the fake nodes it launched (its children: one raylet and one log monitor per
    #    node), while the GCS is still up: a raylet whose GCS is gone ignores SIGTERM for a minute, waiting to
    #    reconnect. (RAY_AUTOSCALER_FATESHARE_WORKERS would do this in the monitor, but its kill_workers()
    #    raises AttributeError in Ray 2.60.)
    monitors = [p for p in procs if _is_monitor(p)]
    fake_nodes = [c for m in monitors for c in _children(m)]
    for proc in [*monitors, *fake_nodes]:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    if monitors or fake_nodes:
        subtree = [*monitors, *fake_nodes, *(d for c in fake_nodes for d in _children(c, recursive=True))]
        psutil.wait_procs(subtree, timeout=min(10.0, max(0.1, deadline - time.monotonic())))
    # 2. The head: ``ray start --block`` shuts its own node down in order.
    if head is not None:
        with contextlib.suppress(psutil.Error):
            head.terminate()
        with contextlib.suppress(psutil.Error):
            head.wait(timeout=max(0.1, deadline - time.monotonic()))
    # What is left are fake nodes (their raylets outlive the GCS for a minute, waiting to reconnect) or, with
    # no head, everything: ask them one by one, briefly, then SIGKILL below.
    rest = [p for p in cluster_processes(info) if p.pid != info.head_pid]
    for proc in rest:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    if rest:
        psutil.wait_procs(rest, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
    # Sweep again: the autoscaler may have been launching a node while we signalled.
    stragglers = {p.pid: p for p in cluster_processes(info)}
    if stragglers:
        logger.info("elastic cluster %s: SIGKILL %d stragglers %s", info.address, len(stragglers),
                    sorted(f"{pid}:{_name(p)}" for pid, p in stragglers.items()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(info.head_pgid, signal.SIGKILL)
        for proc in stragglers.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _, alive = psutil.wait_procs(list(stragglers.values()), timeout=5.0)
        if alive:
            raise ElasticClusterError(f"processes of cluster {info.address} survived SIGKILL: "
                                      f"{sorted(p.pid for p in alive)}")
    if popen is not None:  # reap our child so it does not linger as a zombie
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=5.0)
    _cleanup_dir(info)
    if procs:
        logger.info("elastic cluster %s: stopped", info.address)
    return pids


def _is_monitor(proc: Any) -> bool:
    try:
        return any(arg.endswith("autoscaler/_private/monitor.py") for arg in proc.cmdline())
    except Exception:  # noqa: BLE001 - gone already
        return False


def _children(proc: Any, recursive: bool = False) -> list[Any]:
    try:
        return list(proc.children(recursive=recursive))
    except Exception:  # noqa: BLE001 - gone already
        return []


def _name(proc: Any) -> str:
    try:
        return str(proc.name())
    except Exception:  # noqa: BLE001 - gone already
        return "?"


def _cleanup_dir(info: ClusterInfo) -> None:
    if info.owns_root_dir and not info.extra.get("keep_root_dir"):
        shutil.rmtree(info.root_dir, ignore_errors=True)


def ray_executable() -> list[str]:
    """The ``ray`` CLI of *this* interpreter's environment (never some other ``ray`` on PATH)."""
    candidate = Path(sys.executable).parent / "ray"
    if candidate.is_file():
        return [str(candidate)]
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _tail(path: str, limit: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-limit:]
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------ cluster


class ElasticCluster:
    """A local Ray head with an autoscaler that adds and removes fake ``elastic`` nodes.

    Use as a context manager, or ``start()`` / ``stop()``. Drivers connect with
    ``ray.init(address=cluster.address)`` (from another process if this one already runs Ray) and need the
    cluster's token in their environment; ``cluster.info.env()`` has what they need.
    """

    def __init__(self, config: ElasticClusterConfig | None = None) -> None:
        self.config = config or ElasticClusterConfig()
        self._info: ClusterInfo | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._gcs: Any = None
        self._stopped = False

    @classmethod
    def attach(cls, info: ClusterInfo) -> ElasticCluster:
        """Wrap a cluster started elsewhere (``relax cluster up``) so it can be inspected and stopped."""
        cluster = cls(ElasticClusterConfig(elastic_node_type=info.elastic_node_type))
        cluster._info = info
        return cluster

    # -- properties

    @property
    def info(self) -> ClusterInfo:
        if self._info is None:
            raise ElasticClusterError("elastic cluster not started")
        return self._info

    @property
    def address(self) -> str:
        """GCS address ``ip:port`` for ``ray.init(address=...)``."""
        return self.info.address

    @property
    def dashboard_url(self) -> str | None:
        """``http://host:port`` of the dashboard (for ``ray job submit``), None when it is off."""
        return self.info.dashboard_url

    def is_running(self) -> bool:
        if self._info is None or self._stopped:
            return False
        if self._popen is not None:
            return self._popen.poll() is None
        return _head_process(self._info) is not None

    def pids(self) -> list[int]:
        """Pids of every live process of this cluster (head group, fake nodes, their workers)."""
        return sorted(p.pid for p in cluster_processes(self.info))

    # -- lifecycle

    def start(self, timeout: float = 90.0) -> ClusterInfo:
        """Start the head (and its autoscaler), wait until the GCS answers, the head node is registered and,
        if enabled, the dashboard serves; return how to reach it. Raises ``ElasticClusterError`` with the
        head's log tail on failure, after cleaning up whatever started.

        A head that ran past Ray's own fixed 30 s registration wait (``relax.cluster.startup``; seen on two
        cores beside a training run) is stopped and started once more, with ``timeout`` again.
        """
        for _ in range(START_ATTEMPTS - 1):
            try:
                return self._start_once(timeout)
            except ElasticClusterError as exc:
                if not start_timed_out(exc):
                    raise
                logger.warning("elastic cluster: `ray start --head` timed out in Ray's 30 s wait for its raylet "
                               "(a machine short of CPU); stopped what it started, trying once more")
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> ClusterInfo:
        if self._info is not None:
            raise ElasticClusterError(f"elastic cluster already started at {self._info.address}")
        cfg = self.config
        t0 = time.monotonic()
        deadline = t0 + timeout

        # Every port Ray is given is drawn at once, distinct from each other and from the configured ones: Ray
        # refuses to start when two of its components share a port (seen when two draws returned the same one).
        # Off, Ray still starts its dashboard process, on 8265 and with no retries: it gets a free port too, so
        # a cluster without a dashboard never depends on another Ray's (or a second test run's) port.
        configured_dashboard = cfg.dashboard_port if cfg.include_dashboard else 0
        drawn = free_ports(4, avoid=(cfg.port, configured_dashboard))
        port = cfg.port or drawn[0]
        if cfg.port and port_in_use(port):
            raise ElasticClusterError(f"GCS port {port} is in use; pick another one (--port; 0 picks a free port)")
        dashboard_port = configured_dashboard or drawn[1]
        if cfg.include_dashboard and port_in_use(dashboard_port):
            raise ElasticClusterError(f"dashboard port {dashboard_port} is in use (another Ray dashboard?); "
                                      f"pick another one (--dashboard-port; 0 picks a free port)")
        if cfg.loopback:
            node_ip = LOOPBACK  # a one-machine cluster: nothing of it needs to be reachable from elsewhere
        else:
            os.environ.pop(ray_auth.LOOPBACK_ENV, None)
            from ray._private.services import node_ip_address_from_perspective

            node_ip = node_ip_address_from_perspective()
        address = f"{node_ip}:{port}"

        owns_root = cfg.root_dir is None
        root = Path(cfg.root_dir) if cfg.root_dir else Path(tempfile.mkdtemp(prefix="relax-ec-"))
        root.mkdir(parents=True, exist_ok=True)
        temp_dir = root / "ray"
        # Ray puts unix sockets at <temp>/session_<date>_<pid>/sockets/plasma_store: ~64 chars past temp_dir,
        # and sun_path holds 107. Past that, raylets fail to start with an obscure error.
        if len(str(temp_dir)) + 64 > 107:
            if owns_root:
                shutil.rmtree(root, ignore_errors=True)
            raise ElasticClusterError(f"root_dir {root} is too long for Ray's unix sockets; use a path of at most "
                                      f"{107 - 64 - len('/ray')} characters (or leave root_dir unset)")
        temp_dir.mkdir(exist_ok=True)
        config_path = root / "autoscaler.yaml"
        config_path.write_text(yaml.safe_dump(cfg.autoscaling_config(address), sort_keys=False))
        log_path = root / "head.log"
        auth_off = ray_auth.warn_if_disabled(os.environ, "elastic cluster")
        token_path = None if auth_off else ray_auth.write_token_file(root / "auth_token",
                                                                     ray_auth.cluster_token(os.environ))

        cmd = [
            *ray_executable(), "start", "--head", "--block",
            f"--port={port}",
            f"--num-cpus={cfg.effective_head_cpus}",
            f"--num-gpus={cfg.head_gpus}",
            f"--resources={json.dumps(cfg.head_custom_resources())}",
            f"--object-store-memory={cfg.head_object_store_mb * MB}",
            f"--autoscaling-config={config_path}",
            f"--temp-dir={temp_dir}",
            # Fixed default ports collide with other Ray instances on the machine: take free ones.
            f"--ray-client-server-port={drawn[2]}",
            f"--dashboard-agent-listen-port={drawn[3]}",
            "--disable-usage-stats",
        ]
        if cfg.include_dashboard:
            cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        else:
            cmd += ["--include-dashboard=false", f"--dashboard-port={dashboard_port}"]
        env = {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": str(int(cfg.autoscaler_update_interval_s)),
            **ray_auth.locked_env(os.environ, loopback=cfg.loopback),
            **({} if token_path is None else {ray_auth.TOKEN_PATH_ENV: str(token_path)}),
            # The fake provider's node launch path only works with the v1 autoscaler in this wheel.
            "RAY_enable_autoscaler_v2": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Jobs run `python3 -m relax...`: this interpreter's environment must come first on PATH.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            # the head's GCS keeps as few task events as an embedded cluster's, and no idle workers start
            # (relax.cluster.embedded)
            **embedded_ray_env(os.environ),
            **cfg.env,
        }
        # A driver address inherited from the caller would make `ray start --head` confused about which
        # cluster it belongs to.
        env.pop("RAY_ADDRESS", None)
        if not cfg.loopback:
            env.pop(ray_auth.LOOPBACK_ENV, None)  # os.environ lost it above; cfg.env may bring it back
        if token_path is not None:
            env.pop(ray_auth.TOKEN_ENV, None)  # the file holds the same token: one source for every process
            # This process talks to the cluster (GcsClient, jobs API) with the same token.
            ray_auth.apply_in_process({ray_auth.MODE_ENV: "token", ray_auth.TOKEN_ENV: os.environ.get(
                ray_auth.TOKEN_ENV) or token_path.read_text().strip()})
        # ... and may attach a driver to it: Ray must take 127.0.0.1 as given, not swap in the routable address.
        if cfg.loopback:
            ray_auth.keep_on_loopback_in_process()
        with open(log_path, "ab") as log:
            self._popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True, cwd=str(root))
        psutil = _psutil()

        try:
            create_time = psutil.Process(self._popen.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self._info = ClusterInfo(
            address=address, node_ip=node_ip, port=port, dashboard_url=None, head_pid=self._popen.pid,
            head_pgid=self._popen.pid, head_create_time=create_time, root_dir=str(root), temp_dir=str(temp_dir),
            config_path=str(config_path), log_path=str(log_path), owns_root_dir=owns_root,
            token_path=None if token_path is None else str(token_path),
            elastic_node_type=cfg.elastic_node_type,
            extra={"keep_root_dir": cfg.keep_root_dir, "head_gpus": cfg.head_gpus, "max_elastic": cfg.max_elastic,
                   "node_group": cfg.node_group, "dashboard_port": dashboard_port if cfg.include_dashboard else None},
        )
        # Safety net: a test that dies between start() and stop() must not leave a cluster behind.
        atexit.register(self._stop_at_exit)
        logger.info("elastic cluster: starting head at %s (pid %d, dir %s)", address, self._popen.pid, root)
        try:
            self._wait_head(deadline)
            if cfg.include_dashboard:
                self._info.dashboard_url = self._wait_dashboard(deadline)
        except BaseException:
            # Leave nothing behind on a failed start; the error already carries the log tail.
            self.stop(timeout=15.0)
            self._info = None
            self._stopped = False
            raise
        logger.info("elastic cluster: up at %s in %.1fs (dashboard %s)", address, time.monotonic() - t0,
                    self._info.dashboard_url or "off")
        return self._info

    def _check_head_alive(self) -> None:
        assert self._popen is not None and self._info is not None
        code = self._popen.poll()
        if code is not None:
            raise ElasticClusterError(f"`ray start --head` exited with code {code}; log tail:\n"
                                      f"{_tail(self._info.log_path)}")

    def _wait_head(self, deadline: float) -> None:
        """Poll the GCS until the head node is registered alive with its marker resources."""
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        info = self.info
        last_err: Exception | None = None
        while time.monotonic() < deadline:
            self._check_head_alive()
            try:
                # A GcsClient built before the GCS listens blocks ~30 s in its constructor: probe TCP first.
                if self._gcs is None:
                    if not port_answers(info.node_ip, info.port):
                        raise ConnectionError(f"nothing listens on {info.address} yet")
                    self._gcs = connect_gcs(info.address)
                nodes = self._gcs.get_all_node_info(timeout=2.0)
                for node in nodes.values():
                    if node.is_head_node and node.state == GcsNodeInfo.ALIVE:
                        info.session_dir = node.session_dir or None
                        return
            except Exception as exc:  # noqa: BLE001 - GCS not up yet
                last_err = exc
                self._gcs = None
            time.sleep(0.3)
        raise ElasticClusterError(f"head at {info.address} did not register within the deadline "
                                  f"(last error: {last_err}); log tail:\n{_tail(info.log_path)}")

    def _wait_dashboard(self, deadline: float) -> str:
        """The dashboard publishes its URL in the GCS KV; wait for it and for the jobs API to answer."""
        from ray._private import ray_constants

        url: str | None = None
        last_err: Exception | None = None
        headers = ray_auth.auth_headers({**os.environ, **self.info.env()})
        while time.monotonic() < deadline:
            self._check_head_alive()
            try:
                if url is None:
                    raw = self._gcs.internal_kv_get(b"webui:url", ray_constants.KV_NAMESPACE_DASHBOARD, timeout=2.0)
                    if raw:
                        text = raw.decode()
                        url = text if text.startswith("http") else f"http://{text}"
                if url is not None:
                    request = urllib.request.Request(f"{url}/api/version", headers=headers)
                    with urllib.request.urlopen(request, timeout=2.0) as resp:
                        if resp.status == 200:
                            return url
            except Exception as exc:  # noqa: BLE001 - URLError, connection reset, KV not written yet
                last_err = exc
            time.sleep(0.3)
        raise ElasticClusterError(f"dashboard of {self.info.address} not ready within the deadline "
                                  f"(url {url}, last error: {last_err}); log tail:\n{_tail(self.info.log_path)}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the head, its autoscaler and every fake node; idempotent."""
        if self._info is None or self._stopped:
            return
        self._gcs = None
        stop_cluster(self._info, timeout=timeout, popen=self._popen)
        self._stopped = True
        atexit.unregister(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        if self._popen is not None and not self._stopped:
            with contextlib.suppress(Exception):
                self.stop(timeout=10.0)

    def detach(self) -> ClusterInfo:
        """Give up ownership without stopping: the head keeps running in its own session after this process
        exits (``relax cluster up``); stop it later with ``stop_cluster(info)`` or ``attach(info).stop()``."""
        info = self.info
        atexit.unregister(self._stop_at_exit)
        self._popen = None
        self._gcs = None
        return info

    def __enter__(self) -> ElasticCluster:
        if self._info is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- observation

    def status(self, timeout: float = 10.0) -> ClusterStatus:
        """Nodes alive with their resources, pending placement groups and demand (from the GCS)."""
        if self._gcs is None:
            self._gcs = connect_gcs(self.address)
        return read_status(self.address, elastic_node_type=self.info.elastic_node_type, timeout=timeout,
                           gcs_client=self._gcs)

    def wait_for_nodes(self, n: int, timeout: float = 60.0, *, poll_s: float = 0.25) -> ClusterStatus:
        """Block until exactly ``n`` elastic nodes are alive (``n=0``: all scaled away); return that status.

        Polls the GCS with a deadline and raises ``TimeoutError`` with the last status if it never happens.
        """
        deadline = time.monotonic() + timeout
        last: ClusterStatus | None = None
        while True:
            if self._popen is not None:
                self._check_head_alive()
            try:
                last = self.status(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                if len(last.elastic_nodes) == n:
                    return last
            except Exception as exc:  # noqa: BLE001 - transient GCS errors while nodes churn
                logger.debug("status poll failed: %s", exc)
            if time.monotonic() >= deadline:
                shown = last.format() if last is not None else "no status"
                raise TimeoutError(f"{n} elastic nodes not reached within {timeout:.0f}s; last status:\n{shown}")
            time.sleep(poll_s)
