"""``relax cluster up|down|status``: a detached local elastic Ray cluster for trying Relax on one machine.

``up`` starts a head with the stable node-group markers and an autoscaler that adds fake ``elastic`` nodes
(see ``relax.cluster.local_elastic``), writes a state file (pids, address, dashboard URL) and prints shell
exports, so ``eval "$(relax cluster up)"`` points ``ray job submit`` and drivers at it. ``down`` stops exactly
what ``up`` started, found through that state file, never ``ray stop`` (which kills every Ray on the machine).

Ray is imported only inside the commands so ``relax --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from relax import argtypes

log = logging.getLogger("relax.cluster.cli")

STATE_FILE = "cluster.json"
STATE_DIR_ENV = "RELAX_CLUSTER_STATE_DIR"


def default_state_dir() -> Path:
    """Where ``up`` records the cluster: ``$RELAX_CLUSTER_STATE_DIR`` or ``~/.relax/cluster``."""
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else Path.home() / ".relax" / "cluster"


def add_cluster_parser(subparsers: Any) -> None:
    """Register ``cluster up|down|status`` on the top-level ``relax`` sub-parsers."""
    cluster = subparsers.add_parser("cluster", help="a local elastic Ray cluster with fake autoscaled GPU nodes")
    sub = cluster.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)

    def state_dir_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state-dir", default=None,
                       help=f"where the cluster's state file lives (default ${STATE_DIR_ENV} or ~/.relax/cluster)")

    up = sub.add_parser("up", help="start the cluster detached and print shell exports for it")
    up.add_argument("--gpus", type=argtypes.non_negative_int, default=4,
                    help="baseline logical GPUs on the head (default 4)")
    up.add_argument("--cpus", type=argtypes.non_negative_int, default=None, help="head CPUs (default gpus + 2)")
    up.add_argument("--max-elastic", type=argtypes.non_negative_int, default=4,
                    help="most elastic {GPU:1, CPU:1} nodes the autoscaler may add (default 4)")
    up.add_argument("--node-group", default="stable",
                    help="node group G of the head's markers {G}_gpu / {G}_cpu (default stable)")
    up.add_argument("--idle-timeout-minutes", type=argtypes.positive_float, default=0.25,
                    help="idle elastic nodes are removed after this long (default 0.25; keep it above the time "
                         "a node takes to start, or a node can go just as its placement group lands)")
    up.add_argument("--port", type=argtypes.port, default=0, help="GCS port (default 0: a free port)")
    up.add_argument("--dashboard-port", type=argtypes.port, default=8265,
                    help="dashboard port for `ray job submit` (default 8265; 0 picks a free one)")
    up.add_argument("--no-dashboard", action="store_true", help="no dashboard (saves ~1 GB; no `ray job submit`)")
    up.add_argument("--timeout", type=argtypes.positive_float, default=120.0, help="seconds to wait for the head")
    state_dir_arg(up)
    up.set_defaults(func=cmd_up)

    status = sub.add_parser("status", help="nodes, resources and pending demand of the running cluster")
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    state_dir_arg(status)
    status.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="stop exactly the processes `relax cluster up` started")
    down.add_argument("--timeout", type=argtypes.positive_float, default=30.0,
                      help="seconds to wait for a graceful stop before SIGKILL")
    state_dir_arg(down)
    down.set_defaults(func=cmd_down)


def _state_path(args: argparse.Namespace) -> Path:
    return Path(args.state_dir or default_state_dir()) / STATE_FILE


def _load(path: Path) -> Any | None:
    """The recorded cluster, or None when there is no state file."""
    from relax.cluster.local_elastic import ClusterInfo

    if not path.is_file():
        return None
    try:
        return ClusterInfo.from_json(path.read_text())
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"relax cluster: unreadable state file {path}: {exc}; remove it if no cluster runs") from None


def _exports(info: Any) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in info.env().items())


def _use_cluster_token(info: Any) -> None:
    """Talk to the recorded cluster with its own token (its file beats a stray RAY_AUTH_TOKEN in the shell)."""
    from relax.cluster import ray_auth

    ray_auth.apply_in_process(info.env(), remove=[ray_auth.TOKEN_ENV] if info.token_path else [])


def _setup_logging() -> None:
    from relax.logs import setup_logging

    setup_logging()


def cmd_up(args: argparse.Namespace) -> int:
    from relax.cluster.local_elastic import (
        ElasticCluster,
        ElasticClusterConfig,
        ElasticClusterError,
        stop_cluster,
    )

    _setup_logging()
    path = _state_path(args)
    old = _load(path)
    if old is not None:
        if ElasticCluster.attach(old).is_running():
            print(f"relax cluster up: already up at {old.address} (state file {path}); "
                  f"run `relax cluster down` first", file=sys.stderr)
            return 1
        log.warning("state file %s names a cluster that is no longer running; cleaning it up", path)
        stop_cluster(old, timeout=10.0)
        path.unlink(missing_ok=True)
    try:
        config = ElasticClusterConfig(
            head_gpus=args.gpus, head_cpus=args.cpus, max_elastic=args.max_elastic, node_group=args.node_group,
            idle_timeout_minutes=args.idle_timeout_minutes, port=args.port,
            include_dashboard=not args.no_dashboard, dashboard_port=args.dashboard_port,
        )
    except ValueError as exc:
        print(f"relax cluster up: {exc}", file=sys.stderr)
        return 2
    cluster = ElasticCluster(config)
    try:
        info = cluster.start(timeout=args.timeout)
    except ElasticClusterError as exc:
        print(f"relax cluster up: {exc}", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.to_json())
    tmp.replace(path)
    # Detach: the head runs in its own session and outlives this command; `down` finds it via the state file.
    cluster.detach()
    log.info("state file %s; stop with `relax cluster down%s`", path,
             f" --state-dir {shlex.quote(str(path.parent))}" if args.state_dir else "")
    print(_exports(info))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from relax.cluster.local_elastic import ElasticCluster, read_status

    path = _state_path(args)
    info = _load(path)
    if info is None:
        print(f"relax cluster status: not up (no state file {path})", file=sys.stderr)
        return 1
    if not ElasticCluster.attach(info).is_running():
        print(f"relax cluster status: not up (the cluster recorded in {path} is gone; "
              f"`relax cluster down` cleans up)", file=sys.stderr)
        return 1
    _use_cluster_token(info)
    try:
        status = read_status(info.address, elastic_node_type=info.elastic_node_type, timeout=10.0)
    except Exception as exc:  # noqa: BLE001 - report any GCS failure as a clear one-liner
        print(f"relax cluster status: cannot read {info.address}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"address": info.address, "dashboard_url": info.dashboard_url, **status.to_dict()},
                         indent=2, sort_keys=True))
    else:
        print(f"address: {info.address}   dashboard: {info.dashboard_url or 'off'}")
        print(status.format())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from relax.cluster.local_elastic import ElasticClusterError, stop_cluster

    _setup_logging()
    path = _state_path(args)
    info = _load(path)
    if info is None:
        print(f"relax cluster down: not up (no state file {path})", file=sys.stderr)
        return 1
    _use_cluster_token(info)  # its running jobs are stopped first, through its jobs API
    try:
        pids = stop_cluster(info, timeout=args.timeout)
    except ElasticClusterError as exc:
        print(f"relax cluster down: {exc}", file=sys.stderr)
        return 1
    path.unlink(missing_ok=True)
    if pids:
        print(f"stopped the cluster at {info.address} ({len(pids)} processes)")
    else:
        print(f"the cluster at {info.address} was not running; removed its state file")
    return 0
