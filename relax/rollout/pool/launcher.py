"""The launcher port: where an engine runs and how its process starts and stops.

The engine fleet (``rollout.fleet.lifecycle``) decides *when* an engine is placed, started, synced or stopped; this
module is *how*. :class:`EngineLauncher` is the port, small on purpose, so that the fleet and the scale
executor can be exercised without a cluster; :class:`RayEngineLauncher` is the one implementation that
makes Ray calls for engines (placement groups and :class:`~relax.engines.actor.EngineActor`). Nothing
else in ``relax.rollout`` touches Ray's engine APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from relax.engines.backends import cuda_available
from relax.logs import failure_cause
from relax.weights.pause_mode import PauseMode

log = logging.getLogger("relax.rollout")

ACTOR_START_ATTEMPTS = 2


@dataclass
class EngineSlot:
    """Where an engine runs: a placement group and bundle, and whether Relax owns (and removes) that group.

    Initial engines use bundles of the run's own group (never removed: a failed initial engine is replaced
    in the same bundle); elastic engines get a group of their own, which is the resource demand a cluster
    provisioner sees, and it goes away with them.
    """

    placement_group: Any | None
    bundle_index: int = 0
    owns_group: bool = False


class EngineLauncher(Protocol):
    """What the fleet needs from the platform, one engine at a time (keyed by engine id)."""

    def reserve(self, engine_id: str, gpus: int) -> EngineSlot:
        """Ask for a new placement (non-blocking); :meth:`wait_placed` waits for the capacity."""
        ...

    async def wait_placed(self, slot: EngineSlot) -> None:
        """Return once the slot's resources are granted (may wait for a node to be provisioned)."""
        ...

    async def start(
        self, engine_id: str, slot: EngineSlot, initial_weights: tuple[int, list[Any]] | None = None, *,
        dummy_weights: bool = False,
    ) -> Mapping[str, Any]:
        """Start the engine's server in ``slot`` and wait until it answers; ``{"url", "node_id", ...}``.

        ``initial_weights`` (version, bucket refs): start the server from that version, not the base
        checkpoint; the answer's ``weight_version`` says what it serves. ``dummy_weights``: start it with random
        weights, reading no weight file (its first refit overwrites them).
        """
        ...

    async def sync_weights(
        self, engine_id: str, version: int, bucket_refs: list[Any], pause_mode: PauseMode
    ) -> Mapping[str, Any]:
        """Load weight version ``version`` (bucketed object-store refs): pause (``pause_mode``), load, continue.

        Returns the timings (``pull_s``, ``write_s``, ``load_s``, ``paused_s``, ``bytes``) when known.
        """
        ...

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool | None:
        """Whether the engine's server process runs; ``None`` when the launcher does not own it."""
        ...

    async def info(self, engine_id: str) -> Mapping[str, Any]:
        """Launch facts (url, node, pids) for operators and tests; empty when unknown."""
        ...

    async def stop(self, engine_id: str, grace_s: float) -> None:
        """Stop the server (graceful for ``grace_s``, then killed) and forget the engine."""
        ...

    def release(self, slot: EngineSlot) -> None:
        """Give back a placement the launcher reserved (no-op for groups Relax does not own)."""
        ...

    def engine_ids(self) -> list[str]:
        """Engines with a running (or starting) process."""
        ...


@dataclass
class RayEngineLauncher:
    """:class:`EngineLauncher` on Ray: one PACK placement group per elastic engine, one EngineActor each.

    ``spawn_kwargs`` are the EngineActor's settings shared by every engine of the run (backend options,
    host, log directory, environment, the eviction callback). ``keys_for`` gives each engine its own keys
    (``relax.engines.keys``): they go into that engine's options only.
    """

    backend: str
    model_path: str
    spawn_kwargs: dict[str, Any] = field(default_factory=dict)
    gpus_per_engine: int = 1
    keys_for: Callable[[str], Any] | None = None
    _actors: dict[str, Any] = field(default_factory=dict)

    def reserve(self, engine_id: str, gpus: int) -> EngineSlot:
        from ray.util.placement_group import placement_group

        # one bundle of all its GPUs: one node, and the actor (so its server) sees every one of them
        bundles = [{"GPU": gpus, "CPU": 1}]
        return EngineSlot(placement_group(bundles, strategy="PACK", name=f"relax-{engine_id}"), 0, owns_group=True)

    async def wait_placed(self, slot: EngineSlot) -> None:
        assert slot.placement_group is not None
        await slot.placement_group.ready()

    async def start(
        self, engine_id: str, slot: EngineSlot, initial_weights: tuple[int, list[Any]] | None = None, *,
        dummy_weights: bool = False,
    ) -> Mapping[str, Any]:
        import ray

        from relax.engines.actor import spawn_engine_actor

        kwargs = dict(self.spawn_kwargs)
        if self.keys_for is not None and kwargs.get("options") is not None:
            keys = self.keys_for(engine_id)
            kwargs["options"] = replace(kwargs["options"], api_key=keys.generation, admin_api_key=keys.admin)
        for attempt in range(1, ACTOR_START_ATTEMPTS + 1):
            actor = spawn_engine_actor(
                engine_id,
                self.backend,
                self.model_path,
                placement_group=slot.placement_group,
                bundle_index=slot.bundle_index,
                num_gpus=self.gpus_per_engine,
                num_cpus=1,
                weight_version=0,
                **kwargs,
            )
            self._actors[engine_id] = actor
            try:
                return await actor.start.remote(initial_weights, dummy_weights)
            except ray.exceptions.RayActorError as exc:
                # The actor's *process* died (a node under pressure, a library that failed to load): worth
                # one more try in the same bundle. A server that fails to start is not (ServerLaunchError).
                if attempt == ACTOR_START_ATTEMPTS:
                    raise
                log.warning("%s: engine actor died while starting (%s); retrying in the same bundle", engine_id,
                            failure_cause(exc))
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        raise AssertionError("unreachable")

    async def sync_weights(
        self, engine_id: str, version: int, bucket_refs: list[Any], pause_mode: PauseMode
    ) -> Mapping[str, Any]:
        return await self._actors[engine_id].sync_weights.remote(version, list(bucket_refs), pause_mode)

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool | None:
        actor = self._actors.get(engine_id)
        if actor is None:
            return None
        try:
            return bool(await asyncio.wait_for(_await(actor.is_alive.remote()), timeout=timeout_s))
        except Exception:  # the actor itself is gone or stuck
            return False

    async def info(self, engine_id: str) -> Mapping[str, Any]:
        actor = self._actors.get(engine_id)
        return {} if actor is None else (await actor.info.remote()) or {}

    async def stop(self, engine_id: str, grace_s: float) -> None:
        import ray

        actor = self._actors.pop(engine_id, None)
        if actor is None:
            return
        try:
            await asyncio.wait_for(_await(actor.shutdown.remote(grace_s)), timeout=grace_s + 10)
        except Exception as exc:  # dead or stuck actor: killing it below is the fallback
            log.info("%s: shutdown: %s", engine_id, failure_cause(exc))
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    def release(self, slot: EngineSlot) -> None:
        if not slot.owns_group or slot.placement_group is None:
            return
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(slot.placement_group)
        slot.placement_group = None

    def engine_ids(self) -> list[str]:
        return list(self._actors)


async def _await(ref: Any) -> Any:
    return await ref


def resolve_backend(backend: str, engines_have_cuda: bool | None = None) -> str:
    """`auto` = SGLang for engines on CUDA GPUs, the built-in engine for CPU-only engines.

    ``engines_have_cuda``: whether an engine's GPUs are real CUDA devices, as seen on the engine's node
    (:func:`probe_engine_node`). The plan's GPUs alone cannot say it: Ray's GPUs may be logical ones (a CPU
    test machine, ``relax local``). ``None``: this process's own view (``torch.cuda.is_available()``).
    Whether SGLang is installed plays no part: an engine on a GPU that cannot run SGLang fails with one line
    saying so, rather than training on a CPU-style fp32 engine without a word.
    """
    if backend != "auto":
        return backend
    if engines_have_cuda is None:
        engines_have_cuda = cuda_available()
    return "sglang" if engines_have_cuda else "builtin"


@dataclass(frozen=True)
class EngineNodeFacts:
    """What an engine's own node says: real CUDA devices, the backend ``auto`` resolves to, SGLang's version.

    ``problem`` is the one-line reason an engine there cannot start its backend (SGLang missing or unusable
    for ``python``), else ``None``.
    """

    cuda: bool
    backend: str
    python: str
    sglang_version: str | None = None
    problem: str | None = None


def engine_node_facts(backend: str, python: str | None, env: Mapping[str, str] | None = None) -> EngineNodeFacts:
    """Run on the engine's node, holding its GPUs: resolve ``backend`` and check SGLang there."""
    import sys

    cuda = cuda_available()
    chosen = resolve_backend(backend, engines_have_cuda=cuda)
    if chosen != "sglang":
        return EngineNodeFacts(cuda, chosen, sys.executable)
    from relax.engines.sglang import SGLangVersionError, check_sglang_version

    interpreter = python or sys.executable
    try:
        version = check_sglang_version(interpreter, env=dict(env) if env else None)
    except SGLangVersionError as exc:
        return EngineNodeFacts(cuda, chosen, interpreter, problem=str(exc))
    return EngineNodeFacts(cuda, chosen, interpreter, sglang_version=version)


def probe_engine_node(
    placement_group: Any, bundle_index: int, gpus: int, backend: str, python: str | None,
    env: Mapping[str, str] | None = None,
) -> Any:
    """A Ray ref to :func:`engine_node_facts` run in an engine's bundle with the engine's GPUs.

    Holding the GPUs matters: Ray then shows the task the same devices the engine's server will see (a task
    without GPUs is shown none). It returns in a second or two and gives the GPUs back before the engine starts.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(engine_node_facts).options(
        num_cpus=0, num_gpus=gpus, max_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group,
                                                             placement_group_bundle_index=bundle_index),
    )
    return task.remote(backend, python, dict(env or {}))


def resolve_engine_host(host: str) -> str:
    """`auto` = loopback while every Ray node shares one address (one machine), else the node's IP."""
    if host != "auto":
        return host
    import ray

    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return "127.0.0.1" if len(addresses) <= 1 else "node"


__all__ = ["EngineLauncher", "EngineNodeFacts", "EngineSlot", "RayEngineLauncher", "engine_node_facts",
           "probe_engine_node", "resolve_backend", "resolve_engine_host"]
