"""LocalRollout: a run's control API in-process, with the real executor and simulated engines.

Real rules, fake engines: requests go through the real :class:`~relax.rollout.fleet.executor.ScaleExecutor`
(planners, registry, partial-success policy, sticky cancel, drains) and the real
:class:`~relax.rollout.pool.engines.EnginePool` lifecycle, exactly as in the RolloutManager; only the work of each
engine phase (placement, process start, health, weight sync, drain, shutdown) is a pause of
``step_delay_s``. ``paused`` freezes every engine between two phases, which is how a test holds a scale
operation open to see a 409 or a cancel. URLs in ``unreachable_urls`` fail their health check.

For tests, the CLI tests and trying ``relax-client`` without a cluster; use it (and :meth:`aclose` it) on
one event loop: the one serving the app.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from relax.config.flags import PartialSuccessPolicy
from relax.rollout.control.backend import RolloutControl
from relax.rollout.fleet.executor import ScaleExecutor
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineRecord, EngineState
from relax.rollout.pool.events import EventLog, transition_recorder
from relax.rollout.scaling import ScaleRequestRegistry
from relax.rollout.settings import ScalingSettings

_BRING_UP = (EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING, EngineState.ACTIVE)


class SteppedFleet:
    """A :class:`~relax.rollout.fleet.executor.ScaleFleet` whose engines take one ``step_delay_s`` per phase."""

    def __init__(self, pool: EnginePool, *, step_delay_s: float = 0.0, unreachable_urls: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.step_delay_s = step_delay_s
        self.unreachable_urls = set(unreachable_urls)
        self.paused = False
        self._clock = clock
        self._cancelled: set[str] = set()

    def start_initial(self, count: int) -> None:
        for _ in range(count):
            record = self.pool.add(EngineKind.INITIAL, bundle="initial")
            self._assign_address(record)
            for state in _BRING_UP:
                self._advance(record.engine_id, state)

    async def bring_up_elastic(self, engine_id: str, *, timeout_s: float, cancelled: Callable[[], bool]) -> None:
        await self._bring_up(engine_id, timeout_s, cancelled)

    async def attach_external(self, engine_id: str, url: str, *, timeout_s: float) -> None:
        await self._bring_up(engine_id, timeout_s, lambda: False)

    async def _bring_up(self, engine_id: str, timeout_s: float, cancelled: Callable[[], bool]) -> None:
        deadline = self._clock() + timeout_s
        for state in _BRING_UP:
            await self._phase()
            record = self.pool.get(engine_id)
            if record.state.terminal:
                return
            if cancelled() or engine_id in self._cancelled:
                self.pool.transition(engine_id, EngineState.REMOVED)
                return
            if self._clock() > deadline:
                self.pool.transition(engine_id, EngineState.FAILED, error="scale-out timed out")
                return
            if state is EngineState.HEALTH_CHECKING and record.url in self.unreachable_urls:
                self.pool.transition(engine_id, EngineState.FAILED, error=f"{record.url}: connection refused")
                return
            if state is EngineState.STARTING:
                self._assign_address(record)
            self._advance(engine_id, state)

    def cancel(self, engine_ids: Iterable[str]) -> None:
        self._cancelled.update(engine_ids)

    async def retire(self, engine_id: str, *, force: bool, drain_timeout_s: float, reason: str,
                     on_drained: Callable[[int], None] | None = None) -> int:
        record = self.pool.get(engine_id)
        if record.state.terminal:
            return 0
        if record.state is EngineState.ACTIVE:
            await self._phase()
            self.pool.transition(engine_id, EngineState.DRAINING)
        await self._phase()
        if on_drained is not None:
            on_drained(0)
        await self._phase()
        if not self.pool.get(engine_id).state.terminal:
            self.pool.transition(engine_id, EngineState.REMOVED)
        return 0

    async def settle_weights(self) -> None:
        return None

    def _assign_address(self, record: EngineRecord) -> None:
        if record.url is None:
            self.pool.set_url(record.engine_id, f"http://127.0.0.1:{30000 + record.number}")
        group = "stable" if record.kind is EngineKind.INITIAL else "elastic"
        self.pool.set_node_id(record.engine_id, f"node-{group}-{record.number}")

    def _advance(self, engine_id: str, state: EngineState) -> None:
        if state is EngineState.ACTIVE:
            self.pool.set_weight_version(engine_id, 0)
        self.pool.transition(engine_id, state)

    async def _phase(self) -> None:
        await asyncio.sleep(self.step_delay_s)
        while self.paused:
            await asyncio.sleep(0.01)


class LocalRollout(RolloutControl):
    """The rollout manager's control API over :class:`SteppedFleet` (same methods, same answers, same errors)."""

    def __init__(
        self,
        initial_engines: int = 2,
        *,
        step_delay_s: float = 0.0,
        partial_success_policy: PartialSuccessPolicy | str = PartialSuccessPolicy.ROLLBACK_ALL,
        scale_out_timeout_s: float = 300.0,
        max_engines: int | None = None,
        unreachable_urls: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
        verify: Callable[[str], Awaitable[Mapping[str, Any]]] | None = None,
    ) -> None:
        events = EventLog(clock)
        pool = EnginePool(clock, on_transition=transition_recorder(events))
        self.fleet = SteppedFleet(pool, step_delay_s=step_delay_s, unreachable_urls=unreachable_urls, clock=clock)
        executor = ScaleExecutor(
            pool, self.fleet, events,
            ScalingSettings(initial_engines=initial_engines, max_engines=max_engines,
                            scale_out_timeout_s=scale_out_timeout_s, partial_success_policy=partial_success_policy),
            clock=clock, timer=clock,
        )
        self.training: dict[str, Any] = {
            "training_step": 0,
            "num_rollout": 0,
            "rollout_tokens_per_s": 0.0,
            "staleness_mean": 0.0,
            "trainer_wait_fraction": 0.0,
            "staleness_blocked_fraction": 0.0,
        }
        super().__init__(pool, executor, events, run_status=lambda: self.training, verify=verify)
        self.fleet.start_initial(initial_engines)

    # -- knobs for tests ----------------------------------------------------------------------------
    @property
    def registry(self) -> ScaleRequestRegistry:
        return self.executor.registry

    @property
    def initial_count(self) -> int:
        return self.executor.settings.initial_engines

    @property
    def paused(self) -> bool:
        return self.fleet.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self.fleet.paused = value

    @property
    def unreachable_urls(self) -> set[str]:
        return self.fleet.unreachable_urls

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no scale request is running."""
        await self.executor.wait_idle(timeout_s)

    async def aclose(self) -> None:
        """Stop the simulated work of running requests (they stay where they are)."""
        await self.executor.aclose()


__all__ = ["LocalRollout", "SteppedFleet"]
