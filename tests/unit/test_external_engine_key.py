"""The run's engine secret never leaves the run: an engine attached by URL may be anybody's server.

Real HTTP: the fleet attaches an external "engine" (a recording double on 127.0.0.1) next to an engine the run
started; the double sees no Authorization header at all, or only the key the operator gave for external
engines — never the run's secret, which the run's own engine does get.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi import FastAPI, Request

from relax.engines.keys import engine_keys
from relax.engines.sglang import external_engine_key
from relax.rollout.assembly import build_fleet
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventLog
from relax.rollout.pool.launcher import EngineSlot
from relax.rollout.routing.router import Router
from relax.rollout.settings import FleetSettings
from relax.weights.publication import WeightRegistry
from tests.loopback import LoopbackServer

SECRET = "the-runs-own-engine-secret"


def recording_engine() -> tuple[FastAPI, list[str | None]]:
    app = FastAPI()
    seen: list[str | None] = []

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def record(path: str, request: Request) -> Any:
        seen.append(request.headers.get("authorization"))
        return {"model_path": "m", "weight_version": "0", "success": True}

    return app, seen


class OwnLauncher:
    """Starts the run's own engine as another recording double."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ids: list[str] = []

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None) -> dict[str, Any]:
        self.ids.append(engine_id)
        return {"url": self.url, "node_id": "n"}

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool | None:
        return True if engine_id in self.ids else None

    async def stop(self, engine_id: str, grace_s: float) -> None:
        if engine_id in self.ids:
            self.ids.remove(engine_id)

    def release(self, slot: EngineSlot) -> None:
        return None

    def engine_ids(self) -> list[str]:
        return list(self.ids)


@pytest.mark.parametrize("external_key", [None, "key-the-operator-gave-for-external-engines"])
async def test_an_attached_engine_never_receives_the_runs_secret(external_key: str | None) -> None:
    own_app, own_seen = recording_engine()
    ext_app, ext_seen = recording_engine()
    with LoopbackServer(own_app, name="own-engine") as own, LoopbackServer(ext_app, name="external-engine") as ext:
        pool = EnginePool(time.time)
        fleet = build_fleet(pool, Router(), EventLog(), WeightRegistry(), OwnLauncher(own.url),
                            FleetSettings(engine_api_key=SECRET, external_engine_api_key=external_key))
        try:
            await fleet.start_initial([("group", 0)])
            record = pool.add(EngineKind.EXTERNAL, url=ext.url)
            await fleet.attach_external(record.engine_id, ext.url, timeout_s=10)
            assert pool.get(record.engine_id).state is EngineState.ACTIVE
            await fleet.client(record.engine_id).get_server_info()
        finally:
            await fleet.shutdown()
    own_keys = engine_keys(SECRET, "engine_0")  # the run's own engine: its own pair, derived from the secret
    assert own_seen and set(own_seen) <= {f"Bearer {own_keys.generation}", f"Bearer {own_keys.admin}"}
    assert f"Bearer {SECRET}" not in own_seen + ext_seen  # the secret itself travels nowhere
    assert ext_seen and set(ext_seen) == {None if external_key is None else f"Bearer {external_key}"}


def test_the_external_key_comes_from_its_own_variable() -> None:
    assert external_engine_key({}) is None and external_engine_key({"RELAX_EXTERNAL_ENGINE_API_KEY": " "}) is None
    assert external_engine_key({"RELAX_EXTERNAL_ENGINE_API_KEY": " k\n", "RELAX_ENGINE_API_KEY": "run"}) == "k"
