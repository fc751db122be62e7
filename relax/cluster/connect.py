"""Connect the driver to Ray: an existing cluster (RAY_ADDRESS) or an embedded local one.

The embedded cluster is sized from the plan: logical GPUs for the trainer, the initial engines and
the elastic headroom, and the node-group marker resources when the plan asks for them, so the same
plan that runs on a real cluster runs on a laptop (docs/architecture.md, "Placement and eviction").
"""

from __future__ import annotations

import functools
import logging
import os

import ray

from relax.cluster import ray_auth, scratch
from relax.cluster.embedded import (
    clean_stale_sessions,
    current_session_dir,
    embedded_system_config,
    mark_session,
    ray_temp_root,
    stop_session,
)
from relax.cluster.startup import START_ATTEMPTS, start_timed_out
from relax.config.plan import Plan

log = logging.getLogger("relax.cluster")


def _env_only_new(runtime_env: dict | None, *, skip_inherited: bool) -> dict | None:
    """Drop empty env vars and, inside a Ray job, those this process already has: they come from the job's
    runtime env, and Ray refuses a driver runtime env that names the same keys again (the job's values win)."""
    if not runtime_env:
        return runtime_env
    env = {k: v for k, v in runtime_env.get("env_vars", {}).items()
           if v and not (skip_inherited and k in os.environ)}
    rest = {k: v for k, v in runtime_env.items() if k != "env_vars"}
    merged = {**rest, **({"env_vars": env} if env else {})}
    return merged or None


def connect(plan: Plan, *, runtime_env: dict | None = None) -> str:
    """Initialise Ray for the driver; returns "cluster" or "embedded".

    First, what crashed runs left in this node's scratch space (weight copies in shared memory) goes: only
    directories no live process leases (``relax.cluster.scratch``), so a concurrent run keeps its own.
    """
    scratch.sweep()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        connect_existing(address, runtime_env)
        return "cluster"
    gpus = plan.embedded_cluster_gpus
    resources = {}
    for marker in plan.marker_resources:  # e.g. stable_gpu / stable_cpu, with room for the control plane
        resources[marker] = float(plan.baseline_gpus + 1)
    start_local(num_gpus=gpus, num_cpus=gpus + 2, resources=resources,
                runtime_env=_env_only_new(runtime_env, skip_inherited=False))
    log.info("started an embedded Ray cluster: %d logical GPUs, %d CPUs%s", gpus, gpus + 2,
             f", markers {sorted(resources)}" if resources else "")
    return "embedded"


def connect_existing(address: str, runtime_env: dict | None = None) -> None:
    """Attach this driver to the running cluster at ``address`` (``RAY_ADDRESS``)."""
    if not ray_auth.warn_if_disabled(os.environ, f"driver of {address}") and not ray_auth.has_token(os.environ):
        log.warning("connecting to %s without a Ray auth token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                    "~/.ray/auth_token): a cluster with token auth will refuse this driver; one without it "
                    "takes code from anyone who can reach it (docs/install.md, 'Security')", address)
    _stay_on_loopback_if_only_it_answers(address)
    ray.init(address=address, runtime_env=_env_only_new(runtime_env, skip_inherited=True), log_to_driver=True)
    log.info("connected to the Ray cluster at %s", address)


def _stay_on_loopback_if_only_it_answers(address: str) -> None:
    """A loopback ``RAY_ADDRESS`` of a cluster bound to 127.0.0.1, without Ray's loopback switch: keep to
    loopback, as Ray would otherwise retry on the routable address for ever (``relax.cluster.loopback``)."""
    from relax.cluster.loopback import must_keep_loopback
    from relax.cluster.network import port_answers

    routable = functools.cache(ray.util.get_node_ip_address)  # asked at most once, before the switch changes it
    if must_keep_loopback(address, os.environ, ray_auth.LOOPBACK_ENV, routable, port_answers):
        ray_auth.keep_on_loopback_in_process()
        log.info("%s answers on loopback only (not on %s): this driver stays on 127.0.0.1 (%s=0, which "
                 "`relax cluster up` prints, says so up front)", address, routable(), ray_auth.LOOPBACK_ENV)


def _stop_failed_start() -> None:
    """What a failed ``ray.init`` left: its session's processes (the GCS, maybe a raylet), by session directory."""
    ray.shutdown()
    for session in ray_temp_root().glob(f"session_*_{os.getpid()}"):
        stop_session(session, grace_s=0.0, why="its start timed out")


def start_local(num_gpus: int, num_cpus: int, *, resources: dict[str, float] | None = None,
                runtime_env: dict | None = None, log_to_driver: bool = True) -> None:
    """Start an embedded local Ray cluster with the settings a one-machine cluster needs (docs/development.md,
    "Traps when the whole cluster is on one machine").

    ``address="local"`` so a stray ``RAY_ADDRESS`` or a running cluster is never joined by accident; no
    dashboard (slow to start, and nothing here needs it). Locked (``relax.cluster.ray_auth``): every process
    listens on 127.0.0.1 only, and Ray's token auth is on with the caller's ``RAY_AUTH_TOKEN`` or a new
    per-run token that lives only in this process tree's environment. GPUs are logical: placement only.
    """
    ray_auth.keep_on_loopback_in_process()
    if not ray_auth.warn_if_disabled(os.environ, "embedded cluster"):
        ray_auth.apply_in_process(ray_auth.locked_env(os.environ, loopback=True,
                                                      token=ray_auth.cluster_token(os.environ)))
    clean_stale_sessions()  # what a driver killed by pid left behind (relax.cluster.embedded)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=resources or None,
                include_dashboard=False,
                runtime_env=runtime_env,
                log_to_driver=log_to_driver,
                _system_config=embedded_system_config() or None,
            )
            break
        except Exception as exc:
            if attempt == START_ATTEMPTS or not start_timed_out(exc):
                raise
            log.warning("the embedded Ray cluster did not come up (%s: Ray waits 30 s for its raylet, which a "
                        "machine short of CPU can exceed); stopping what it started and trying once more", exc)
            _stop_failed_start()
    session = current_session_dir()
    if session is not None:
        mark_session(session)
    node = ray.util.get_node_ip_address()
    if node not in ("127.0.0.1", "::1"):  # a Ray upgrade that moved the switch: say so rather than hide it
        log.warning("the embedded Ray cluster's node address is %s, not 127.0.0.1: its ports may be reachable "
                    "from other machines (relax.cluster.ray_auth)", node)
