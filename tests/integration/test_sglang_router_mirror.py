"""``--sglang-router-url`` against the real SGLang router (pip ``sglang-router``, pinned in the dev extras).

A real router process on a free loopback port, a RolloutManager with keyed built-in engines on the tiny preset
on the session's local Ray cluster, and real HTTP in between: after scale-out, scale-in, an engine crash and an
eviction the router lists exactly Relax's ACTIVE engines, and a /generate sent to the router reaches a Relax
engine with the run's key. A second test restarts the router under a mirror that already failed, to show that
a router that was down is filled once it is back. Every wait polls a condition against a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from relax.cluster.network import free_port, free_ports
from relax.rollout.manager import spawn_rollout_manager
from relax.rollout.routing.router_mirror import SGLangRouterMirror, canonical_url
from relax.rollout.scaling import ScaleInSpec, ScaleOutSpec
from relax.rollout.settings import (
    DataSettings,
    FleetSettings,
    RolloutSettings,
    SamplingSettings,
    ScalingSettings,
)

pytest.importorskip("sglang_router", reason="sglang-router is a dev extra (pip install -e '.[dev]')")

pytestmark = pytest.mark.timeout(240)

SECRET = "router-mirror-test-secret"
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout}s"
        time.sleep(0.1)


class RouterProcess:
    """The real ``sglang-router`` on 127.0.0.1, in its own process group (stopped by that group, nothing else)."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port, prometheus = (port, free_port()) if port is not None else tuple(free_ports(2, "127.0.0.1"))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                # its Prometheus exporter binds 0.0.0.0:29000 by default: a second router would panic on it
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus), "--log-level", "warn"]
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._ready, 60, f"the SGLang router on {self.url} to answer (log: {log_path})")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"the router exited: {self.log_path.read_text()[-2000:]}"
        try:
            return httpx.get(f"{self.url}/workers", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def workers(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/workers", timeout=10, trust_env=False)
        response.raise_for_status()
        return response.json()

    def urls(self) -> set[str]:
        return {canonical_url(w["url"]) for w in self.workers()["workers"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = RouterProcess(tmp_path_factory.mktemp("sglang-router") / "router.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def manager(ray_cluster, tiny_preset, router: RouterProcess):
    initial = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK", name="router-mirror-initial")
    ray.get(initial.ready(), timeout=60)
    handle = spawn_rollout_manager(RolloutSettings(
        data=DataSettings(prompt_data=str(tiny_preset.train_path), num_rollout=1, rollout_batch_size=4,
                          sampling=SamplingSettings(n_samples=2, max_new_tokens=8), max_staleness=0,
                          apply_chat_template=True, rm_type="tiny"),
        fleet=FleetSettings(model_path=str(tiny_preset.model_dir), drain_timeout_s=10, shutdown_timeout_s=5,
                            engine_api_key=SECRET, sglang_router_url=router.url),
        scaling=ScalingSettings(max_engines=3, scale_out_timeout_s=60),
    ))
    try:
        ray.get(handle.start_initial_engines.remote([(initial, 0)]), timeout=180)
        yield handle
    finally:
        ray.get(handle.shutdown.remote(), timeout=120)
        ray.kill(handle)
        remove_placement_group(initial)


def engines(manager) -> list[dict[str, Any]]:
    return ray.get(manager.engines.remote(), timeout=60)


def active_urls(manager) -> set[str]:
    return {canonical_url(e["url"]) for e in engines(manager) if e["status"] == "ACTIVE"}


def mirrored(manager, router: RouterProcess, what: str, timeout: float = 30) -> set[str]:
    """Wait until the router lists exactly the ACTIVE engines' URLs (read together, both at once); return them."""
    seen: dict[str, set[str]] = {}

    def equal() -> set[str] | None:
        seen["active"], seen["router"] = active_urls(manager), router.urls()
        return seen["active"] if seen["router"] == seen["active"] else None

    try:
        return wait_until(equal, timeout, f"the router's workers == Relax's ACTIVE engines ({what})")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: the router lists {sorted(seen['router'])}, ACTIVE are "
                             f"{sorted(seen['active'])}") from None


def scale(manager, method: str, spec: Any, direction: str) -> dict[str, Any]:
    request_id = ray.get(getattr(manager, method).remote(spec), timeout=60)["request_id"]

    def done() -> dict[str, Any] | None:
        record = ray.get(manager.get_scale_request.remote(direction, request_id), timeout=60)
        return record if record["status"] in ("ACTIVE", "PARTIAL", "FAILED", "CANCELLED", "COMPLETED") else None

    return wait_until(done, 120, f"{request_id} to finish")


def test_engines_are_registered_with_their_key_and_serve_through_the_router(manager, router) -> None:
    (url,) = mirrored(manager, router, "the initial engine")
    listing = router.workers()
    assert SECRET not in str(listing)  # the router keeps the key; neither it nor Relax shows it
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    # The engine refuses a request without the run's key...
    assert httpx.post(f"{url}/generate", json=body, timeout=30, trust_env=False).status_code == 401
    # ...and serves the same request sent to the router, which adds the key it was registered with.
    through = httpx.post(f"{router.url}/generate", json=body, timeout=60, trust_env=False)
    assert through.status_code == 200, through.text
    assert through.json()["meta_info"]["completion_tokens"] >= 1


def test_scale_out_and_scale_in_keep_the_router_equal_to_the_active_set(manager, router) -> None:
    assert scale(manager, "scale_out", ScaleOutSpec(num_replicas=3), "scale_out")["status"] == "ACTIVE"
    assert len(mirrored(manager, router, "after scale-out to 3")) == 3
    assert scale(manager, "scale_in", ScaleInSpec(num_replicas=2), "scale_in")["status"] == "COMPLETED"
    assert len(mirrored(manager, router, "after scale-in to 2")) == 2


def test_a_crashed_engine_leaves_the_router_once_relax_notices(manager, router) -> None:
    victim = next(e for e in engines(manager) if e["kind"] == "elastic" and e["status"] == "ACTIVE")
    info = ray.get(manager.engine_process.remote(victim["engine_id"]), timeout=60)
    os.killpg(info["pid"], signal.SIGKILL)  # the server runs in its own session: its group is the server
    wait_until(lambda: next(e for e in engines(manager) if e["engine_id"] == victim["engine_id"])["status"]
               in ("FAILED", "REMOVED"), 60, f"Relax to notice {victim['engine_id']} crashed")
    survivors = mirrored(manager, router, "after the crash")
    assert canonical_url(victim["url"]) not in survivors and len(survivors) == 1


def test_an_evicted_engine_leaves_the_router_and_its_replacement_joins(manager, router) -> None:
    victim = next(e for e in engines(manager) if e["status"] == "ACTIVE")
    assert victim["kind"] == "initial"
    info = ray.get(manager.engine_process.remote(victim["engine_id"]), timeout=60)
    os.kill(info["actor_pid"], signal.SIGTERM)  # what a node's reclaim does to the EngineActor
    wait_until(lambda: victim["engine_id"] not in {e["engine_id"] for e in engines(manager)
                                                   if e["status"] == "ACTIVE"}, 60, "the eviction to start")
    # An initial engine is replaced in its own bundle: the router follows both the departure and the arrival.
    replacement = wait_until(
        lambda: [e for e in engines(manager) if e["status"] == "ACTIVE" and e["engine_id"] != victim["engine_id"]],
        120, "the evicted initial engine's replacement")
    assert mirrored(manager, router, "after the eviction and the replacement") == {canonical_url(replacement[0]["url"])}


def test_a_router_that_was_down_is_filled_once_it_is_back(tmp_path: Path, start_engine, tiny_preset) -> None:
    server = start_engine(tiny_preset.model_dir)
    port = free_port()

    async def scenario() -> None:
        mirror = SGLangRouterMirror(f"http://127.0.0.1:{port}")
        try:
            mirror.add("engine-9", server.url)
            assert not await mirror.synced(5)  # nothing listens: a failure, counted and kept for the status
            status = mirror.status()
            assert status["failures"] >= 1 and not status["in_sync"] and "Cannot connect" in status["last_error"]
            router = await asyncio.to_thread(RouterProcess, tmp_path / "router.log", port)
            try:  # no further change comes: the mirror's backoff retry fills the router on its own
                deadline = time.monotonic() + 30
                while router.urls() != {canonical_url(server.url)} or not mirror.status()["in_sync"]:
                    assert time.monotonic() < deadline, f"the router was not filled: {mirror.status()}"
                    await asyncio.sleep(0.2)
                assert mirror.status()["in_sync"] and mirror.status()["registered"] == {"engine-9": server.url}
                await mirror.aclose(deregister=True)
                assert router.urls() == set()  # a run that ends takes its engines off the router
            finally:
                await asyncio.to_thread(router.stop)
        finally:
            await mirror.aclose(deregister=False)

    asyncio.run(scenario())
