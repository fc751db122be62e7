"""The autoscaler service: the imperative shell around the pure policy (docs/architecture.md, "The autoscaler").

Every ``metrics_interval_secs`` it scrapes ``/metrics`` of every ACTIVE engine (``scrape_all``), adds the
trainer's and the staleness gate's RL signals from the RolloutManager, and records a ``ClusterFrame``;
every ``evaluation_interval_secs`` it asks ``AutoscalerPolicy.evaluate`` for a decision and carries a
scale decision out through ``scale_out`` / ``scale_in`` -- the very entry points behind
``POST /rollout/scale_out|scale_in``, so an autoscaler request obeys the same rules as a human's (absolute
targets, the initial-engine floor, one operation at a time). It then follows the request it started until
that request ends, and tells the policy what became of it (``record_action``): a refusal or a failed
request backs off, an accepted one starts the cooldown.

The backend is the one client of the RolloutManager actor (``relax.rollout.control.manager_client.ManagerClient``,
or ``relax.testing.local_rollout.LocalRollout`` in process): it answers plain values and raises the scaling
core's typed errors. A ``ScalingError`` is a *refusal* (the rules said no: recorded, backed off); any other
exception is an *error* (the manager could not be asked: recorded in ``health()`` as well).

Why the shape:

* **No logic here.** Thresholds, streaks, bounds, cooldowns, backoff and sizing are the policy's; frames and
  coverage are ``metrics``'; validation is ``AutoscalerConfig``'s. This module only moves data between them
  and the backend, so the rules stay unit-testable in milliseconds and this file stays reviewable.
* **One vocabulary.** Request statuses and the engine count come from the scaling core
  (``relax.rollout.scaling``: ``TERMINAL_STATUSES``, ``FAILED_STATUSES``, ``relax_status()["current_engines"]``);
  condition names, rules and outcomes from the policy. Nothing is re-derived here.
* **One clock.** The injected clock stamps frames, drives the policy and schedules the loop, so tests step
  the service deterministically (``step()``) and the loop (``run()``) is the same code on a timer.
* **It never dies of a bad cycle.** A backend that does not answer, an engine that times out or a bug in a
  cycle is recorded (``health()``) and the loop goes on; a decision is only ever made on fresh facts (a
  current frame and a pool view read just before acting), never on stale ones.
* **Disabled still watches.** With ``enabled: false`` it keeps scraping and evaluating so ``/conditions``
  shows what it *would* do; the policy answers "disabled" and nothing is sent to the scaling API.
* **Strict JSON.** Everything the status methods return passes through ``strict_json`` so an ``inf``
  latency (a P95 in the ``+Inf`` bucket) becomes ``"+Inf"`` instead of breaking the HTTP answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from relax.autoscaler.config import AutoscalerConfig, AutoscalerConfigError, effective_bounds
from relax.autoscaler.metrics import ClusterFrame, MetricsHistory, json_number
from relax.autoscaler.policy import (
    SCALE_IN_CONDITIONS,
    SCALE_OUT_CONDITIONS,
    AutoscalerPolicy,
    Decision,
    Outcome,
    PoolView,
    ScaleAction,
    rules_summary,
)
from relax.autoscaler.scrape import scrape_all
from relax.logs import failure_cause
from relax.rollout.pool.engines import EngineState
from relax.rollout.scaling import (
    FAILED_STATUSES,
    TERMINAL_STATUSES,
    ScaleConflict,
    ScaleInSpec,
    ScaleOutSpec,
    ScalingError,
    UnknownRequest,
)

log = logging.getLogger("relax.autoscaler")

__all__ = [
    "HISTORY_LIMIT",
    "AutoscalerBackend",
    "AutoscalerService",
    "PendingRequest",
    "ScaleRecord",
    "config_error_field",
    "start_autoscaler",
    "strict_json",
]

HISTORY_LIMIT = 200
"""Scale decisions kept for ``GET /autoscaler/scale_history`` (newest first)."""


# --------------------------------------------------------------------------------------------------
# The backend


@runtime_checkable
class AutoscalerBackend(Protocol):
    """What the service needs from the RolloutManager: ``ManagerClient`` (and ``LocalRollout``) implement it.

    Plain results, typed errors. ``engine_urls`` answers ``{engine_id: url}`` of ACTIVE engines;
    ``relax_status`` the manager's status dict (``current_engines``, ``engines_by_state``,
    ``initial_engines``, ``scale_request_running``, the RL signals); ``scale_out`` / ``scale_in`` either
    ``{"request_id", "status"}`` (accepted) or ``{"status": "NOOP", "message", ...}`` (nothing to do);
    ``get_scale_request`` the request record (``status``, ``error``...). A rule refusal raises a
    ``ScalingError`` subclass (``ScaleConflict``, ``RejectedRequest``, ``UnknownRequest``...); a manager that
    cannot be asked raises anything else (``ManagerCallError`` from the client).
    """

    def engine_urls(self) -> Awaitable[dict[str, str]]: ...

    def relax_status(self) -> Awaitable[dict[str, Any]]: ...

    def scale_out(self, spec: ScaleOutSpec) -> Awaitable[dict[str, Any]]: ...

    def scale_in(self, spec: ScaleInSpec) -> Awaitable[dict[str, Any]]: ...

    def get_scale_request(self, direction: str, request_id: str) -> Awaitable[dict[str, Any]]: ...


# --------------------------------------------------------------------------------------------------
# JSON


def strict_json(value: Any) -> Any:
    """``value`` made strictly JSON-safe: no NaN or infinity (``json_number``), enums as their values,
    tuples and sets as lists, mapping keys as strings. The HTTP layer refuses NaN, and so do many clients."""
    if isinstance(value, Enum):  # before str and int: a StrEnum is sent as its plain value
        return strict_json(value.value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, Mapping):
        return {str(key): strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset, deque)):
        return [strict_json(item) for item in value]
    return str(value)


def _finite(value: Any) -> float | None:
    """A number from the backend, or None when it is missing or not a finite number (never a guess)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _leaf_paths(partial: Any, prefix: str = "") -> list[str]:
    if not isinstance(partial, Mapping):
        return [prefix] if prefix else []
    paths: list[str] = []
    for key, value in partial.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        paths.extend(_leaf_paths(value, path) if isinstance(value, Mapping) and value else [path])
    return paths


def config_error_field(partial: Any, message: str) -> str | None:
    """The key of ``partial`` that a config error message names (the longest one mentioned), else its first key.

    ``AutoscalerConfig.patch`` words its errors around the dotted key (``scale_out_policy.max_delta must be
    >= 1``); this recovers that key for the ``field`` of a 400 answer without re-implementing validation.
    """
    paths = _leaf_paths(partial)
    named = [path for path in paths if path in message]
    if named:
        return max(named, key=len)
    return paths[0] if paths else None


# --------------------------------------------------------------------------------------------------
# Records


@dataclass
class ScaleRecord:
    """One decision that acted: what was asked, why, on which numbers, and what became of it.

    ``outcome`` is an :class:`Outcome` or the request's own terminal status; ``error`` names what refused a
    decision (the scaling error's type, e.g. ``ScaleConflict``, or the exception of a manager that could not
    be asked) and ``detail`` says it in words.
    """

    time: float
    wall_time: float
    action: ScaleAction
    from_engines: int
    to_engines: int
    reason: str
    metrics: dict[str, Any]
    conditions: dict[str, Any]
    request_id: str | None = None
    accepted: bool = False
    outcome: str = Outcome.PENDING
    error: str | None = None
    detail: str | None = None
    finished_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return strict_json(
            {
                "time": self.time,
                "wall_time": self.wall_time,
                "action": self.action.value,
                "from_engines": self.from_engines,
                "to_engines": self.to_engines,
                "reason": self.reason,
                "request_id": self.request_id,
                "accepted": self.accepted,
                "outcome": self.outcome,
                "error": self.error,
                "detail": self.detail,
                "finished_at": self.finished_at,
                "metrics": self.metrics,
                "conditions": self.conditions,
            }
        )


@dataclass
class PendingRequest:
    """The scale request the autoscaler started and is following until it ends."""

    action: ScaleAction
    request_id: str
    since: float
    record: ScaleRecord
    status: str = Outcome.PENDING
    polls: int = field(default=0)

    @property
    def direction(self) -> str:
        return self.action.value

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "request_id": self.request_id,
            "status": self.status,
            "age_secs": max(0.0, now - self.since),
            "target": self.record.to_engines,
        }


@dataclass(frozen=True)
class _PoolFacts:
    """What ``relax_status`` says about the pool, read just before a decision."""

    by_state: dict[str, int]
    current: int
    active: int
    initial: int
    running_request: str | None


# --------------------------------------------------------------------------------------------------
# The service


class AutoscalerService:
    """Scrape, decide, act, follow up; plus the read-outs behind ``/autoscaler/*``.

    Drive it with ``run()`` (the loop; ``start_autoscaler`` creates it as a task) or, in tests, with
    ``step()`` / ``scrape_once()`` / ``evaluate_once()`` / ``poll_pending()`` and a fake clock.
    """

    def __init__(
        self,
        config: AutoscalerConfig,
        backend: AutoscalerBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        scrape_timeout: float | None = None,
        engine_token: str | None = None,
        backoff_base_secs: float = 30.0,
        backoff_max_secs: float = 300.0,
    ) -> None:
        """``scrape_timeout`` bounds one engine's ``/metrics`` request (default: 90% of the metrics interval,
        between 1 s and 5 s, so a hung engine cannot delay the next scrape); ``engine_token`` is sent as
        a bearer token to engines that require one."""
        if scrape_timeout is not None and scrape_timeout <= 0:
            raise ValueError(f"scrape_timeout must be positive, got {scrape_timeout}")
        self._config = config
        self.backend = backend
        self._clock = clock
        self._wall_clock = wall_clock
        self._scrape_timeout = scrape_timeout
        self._engine_token = engine_token
        self.policy = AutoscalerPolicy(
            config, clock, backoff_base_secs=backoff_base_secs, backoff_max_secs=backoff_max_secs
        )
        self.history = MetricsHistory(config.condition_window_secs)
        self._scale_history: deque[ScaleRecord] = deque(maxlen=HISTORY_LIMIT)
        self._pending: PendingRequest | None = None
        self._pool: _PoolFacts | None = None
        self._rl: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._started_at: float | None = None
        self._last_scrape_at: float | None = None
        self._last_evaluation_at: float | None = None
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._consecutive_errors = 0
        self._scrapes = 0
        # Scrapes where an engine did not answer or lacked a field: each blocks scale-in for a while.
        self._incomplete_scrapes = 0
        self._last_incomplete: tuple[float, dict[str, str]] | None = None
        self._evaluations = 0
        self._actions = 0

    # -- configuration ----------------------------------------------------------------------------

    @property
    def config(self) -> AutoscalerConfig:
        return self._config

    @property
    def enabled(self) -> bool:
        return self._config.enabled

    @property
    def scrape_timeout(self) -> float:
        if self._scrape_timeout is not None:
            return self._scrape_timeout
        # Overloaded engines answer /metrics slowly, and those are the ones whose numbers matter most for a
        # scale-out: give them most of the interval rather than half of it.
        return min(5.0, max(1.0, 0.9 * self._config.metrics_interval_secs))

    def set_enabled(self, enabled: bool) -> bool:
        """Turn acting on or off (``POST /autoscaler/enable``); returns the previous value.

        Streaks are kept: conditions that held while the autoscaler was off really held, so turning it on
        under a sustained backlog acts at the next evaluation rather than waiting another duration.
        """
        if not isinstance(enabled, bool):
            raise AutoscalerConfigError(f"enabled must be true or false, got {enabled!r}")
        previous = self._config.enabled
        if previous != enabled:
            self._apply(self._config.patch({"enabled": enabled}))
            log.info("autoscaler %s", "enabled" if enabled else "disabled")
        return previous

    def patch_config(self, partial: Any) -> AutoscalerConfig:
        """``PATCH /autoscaler/config``: validate the deep-merged config, then swap it in whole.

        Raises ``AutoscalerConfigError`` naming the key (unknown key, wrong type, broken cross-field rule,
        or bounds the running pool cannot honour, e.g. ``max_engines`` below its initial engines); on error
        nothing changes.
        """
        new = self._config.patch(partial)
        if self._pool is not None:
            try:
                effective_bounds(new, self._pool.initial)
            except AutoscalerConfigError as exc:  # names min_engines / max_engines
                raise AutoscalerConfigError(f"config patch: {exc}") from None
        self._apply(new)
        log.info("autoscaler config patched: %s", strict_json(partial))
        return new

    def _apply(self, config: AutoscalerConfig) -> None:
        self._config = config
        self.policy.update_config(config)
        self.history.window_secs = float(config.condition_window_secs)
        self._wake.set()  # new intervals take effect now, not after the old sleep

    # -- one cycle --------------------------------------------------------------------------------

    async def step(self) -> Decision | None:
        """One full cycle, as the loop runs it when both timers are due: follow up, scrape, evaluate."""
        await self.poll_pending()
        await self.scrape_once()
        return await self.evaluate_once()

    async def scrape_once(self) -> ClusterFrame | None:
        """Scrape every ACTIVE engine and the RL signals into a new frame; None (error recorded) on failure."""
        try:
            urls, rl = await asyncio.gather(self.backend.engine_urls(), self._rl_signals())
            if not isinstance(urls, Mapping):
                raise TypeError(f"engine_urls answered {type(urls).__name__}, expected a mapping of id -> url")
            results = await scrape_all(
                {str(k): str(v) for k, v in urls.items()}, self.scrape_timeout, token=self._engine_token
            )
            now = self._clock()
            frame = self.history.record(
                now,
                results,
                trainer_wait_fraction=rl.get("trainer_wait_fraction"),
                staleness_blocked_fraction=rl.get("staleness_blocked_fraction"),
            )
        except Exception as exc:  # one failed cycle must not end the loop
            self._error("scrape", exc)
            return None
        self._rl = rl
        self._last_scrape_at = now
        self._scrapes += 1
        if gaps := frame.gaps():
            self._incomplete_scrapes += 1
            self._last_incomplete = (now, gaps)
            log.warning("autoscaler: incomplete scrape (%d of %d engines usable): %s", len(frame.asked) - len(gaps),
                        len(frame.asked), "; ".join(f"{e}: {why}" for e, why in gaps.items()))
        if rl:  # an unreadable relax_status stays an error until it answers again
            self._ok()
        return frame

    async def _rl_signals(self) -> dict[str, Any]:
        """Trainer-wait and staleness-blocked fractions; empty (signals unknown) when the manager cannot say.

        A failure here must not cost the engine metrics, so it is recorded and the frame is built without
        the RL signals (unknown, which never triggers anything).
        """
        try:
            body = _status_dict(await self.backend.relax_status())
        except Exception as exc:
            self._error("relax_status", exc)
            return {}
        return {
            "trainer_wait_fraction": _finite(body.get("trainer_wait_fraction")),
            "staleness_blocked_fraction": _finite(body.get("staleness_blocked_fraction")),
            "buffer_waiting_partitions": _finite(body.get("buffer_waiting_partitions")),
        }

    async def _pool_facts(self) -> _PoolFacts:
        """The pool as the scaling rules count it: ``current_engines`` is the number an absolute target is
        compared with (``relax.rollout.scaling.current_engine_count``), never recounted here."""
        body = _status_dict(await self.backend.relax_status())
        raw = body.get("engines_by_state") or {}
        by_state = {str(k): int(v) for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)}
        current = _count(body, "current_engines")
        initial = _count(body, "initial_engines")
        running = body.get("scale_request_running")
        active = by_state.get(EngineState.ACTIVE.value, 0)
        return _PoolFacts(by_state, current, active, initial, str(running) if running else None)

    async def evaluate_once(self) -> Decision | None:
        """Ask the policy for a decision on the latest frame and a fresh pool view, and act on it.

        Returns None (error recorded) when there is no frame yet or the pool cannot be read: deciding
        without knowing the pool size or whether a request runs could double a scale-out.
        """
        frame = self.history.latest
        if frame is None:
            self._error("evaluate", RuntimeError("no metrics frame yet (the first scrape has not succeeded)"))
            return None
        try:
            facts = await self._pool_facts()
        except Exception as exc:
            self._error("evaluate", exc)
            return None
        self._pool = facts
        pending = self._pending is not None or facts.running_request is not None
        view = PoolView(current_engines=facts.current, initial_engines=facts.initial, scale_pending=pending)
        decision = self.policy.evaluate(frame, view)
        self._last_evaluation_at = self._clock()
        self._evaluations += 1
        if decision.action is not ScaleAction.NONE and decision.target is not None:
            await self._act(decision, view)
        return decision

    async def _act(self, decision: Decision, view: PoolView) -> None:
        """Send the decision through the scaling API and record it; refusals back off (``record_action``).

        A ``ScalingError`` is the rules' refusal (another request running, a target the rules forbid); any
        other exception means the manager could not be asked, which is a refusal too (backed off, not retried
        every cycle) and an error in ``health()``.
        """
        action, target = decision.action, int(decision.target or 0)
        now = self._clock()
        record = ScaleRecord(
            time=now,
            wall_time=self._wall_clock(),
            action=action,
            from_engines=view.current_engines,
            to_engines=target,
            reason=decision.reason,
            metrics=strict_json(decision.metrics),
            conditions=_drivers(decision),
        )
        answer: Any = None
        try:
            if action is ScaleAction.SCALE_OUT:
                spec = ScaleOutSpec(num_replicas=target, timeout_secs=self._config.scale_out_request_timeout_secs)
                answer = await self.backend.scale_out(spec)
            else:
                answer = await self.backend.scale_in(ScaleInSpec(num_replicas=target))
        except ScalingError as exc:  # the rules said no: a refusal, not a fault
            record.error, record.detail = type(exc).__name__, _refusal(exc)
        except Exception as exc:  # an unreachable manager is a refusal, not a crash
            record.error, record.detail = type(exc).__name__, failure_cause(exc)
            self._error(action.value, exc)
        request_id = answer.get("request_id") if isinstance(answer, Mapping) else None
        accepted = isinstance(request_id, str) and bool(request_id)
        self.policy.record_action(action, accepted)
        record.accepted = accepted
        if accepted:
            record.request_id = request_id
            record.outcome = str(answer.get("status") or Outcome.PENDING)
            self._pending = PendingRequest(action, request_id, now, record, status=record.outcome)
        else:
            noop = isinstance(answer, Mapping) and answer.get("status") == Outcome.NOOP
            record.outcome = Outcome.NOOP if noop else Outcome.REJECTED
            if answer is not None:  # answered, but started nothing
                record.detail = _answer_text(answer)
                if not noop:  # neither a request id nor NOOP: a backend bug
                    bug = TypeError(f"{action.value} answered {record.detail}, expected a request id or NOOP")
                    record.error = type(bug).__name__
                    self._error(action.value, bug)
            record.finished_at = now
        self._scale_history.append(record)
        self._actions += 1
        if accepted:
            log.info(
                "autoscaler %s request=%s accepted (%s): %s", action.value, request_id, record.outcome, decision.reason
            )
        else:
            log.info(
                "autoscaler %s %d -> %d %s (%s: %s): %s",
                action.value,
                record.from_engines,
                target,
                record.outcome,
                record.error or "no change",
                record.detail,
                decision.reason,
            )

    async def poll_pending(self) -> PendingRequest | None:
        """Follow the request the autoscaler started; when it ends, record the outcome (and back off on failure).

        Returns the request while it is still running, None once there is none.
        """
        pending = self._pending
        if pending is None:
            return None
        try:
            body = await self.backend.get_scale_request(pending.direction, pending.request_id)
        except UnknownRequest as exc:  # garbage-collected or lost with a restarted manager: not running any more
            pending.polls += 1
            self._finish(pending, Outcome.UNKNOWN, f"request record gone: {exc.message}")
            return None
        except Exception as exc:  # keep it pending: no decision while we do not know
            self._error("poll", exc)
            return pending
        pending.polls += 1
        if not isinstance(body, Mapping):
            self._error("poll", TypeError(f"get_scale_request answered {_answer_text(body)}, expected a record"))
            return pending
        state = str(body.get("status") or pending.status)
        pending.status = pending.record.outcome = state
        if state in TERMINAL_STATUSES:
            error = body.get("error")
            self._finish(pending, state, str(error) if error else None)
            return None
        return pending

    def _finish(self, pending: PendingRequest, outcome: str, detail: str | None) -> None:
        record = pending.record
        record.outcome = outcome
        record.detail = detail
        record.finished_at = self._clock()
        self._pending = None
        if outcome in FAILED_STATUSES:
            self.policy.record_action(pending.action, accepted=False)
        log.info(
            "autoscaler %s request %s ended %s after %.1fs%s",
            pending.direction,
            pending.request_id,
            outcome,
            record.finished_at - pending.since,
            f": {detail}" if detail else "",
        )

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Scrape every ``metrics_interval_secs`` and decide every ``evaluation_interval_secs`` until cancelled.

        Intervals are re-read every turn, so ``PATCH /config`` applies without a restart. The first decision
        comes one evaluation interval after the start, when the first frames exist.
        """
        self._started_at = self._clock()
        last_scrape: float | None = None
        last_eval = self._started_at
        log.info(
            "autoscaler started (%s, engines %d..%d, scrape every %gs, decide every %gs)",
            "enabled" if self.enabled else "disabled",
            self._config.min_engines,
            self._config.max_engines,
            self._config.metrics_interval_secs,
            self._config.evaluation_interval_secs,
        )
        try:
            while True:
                cfg = self._config
                now = self._clock()
                polled = False
                if last_scrape is None or now - last_scrape >= cfg.metrics_interval_secs:
                    last_scrape = now
                    await self.poll_pending()
                    polled = True
                    await self.scrape_once()
                now = self._clock()
                if now - last_eval >= cfg.evaluation_interval_secs:
                    last_eval = now
                    if not polled:
                        await self.poll_pending()
                    await self.evaluate_once()
                now = self._clock()
                due = min(last_scrape + cfg.metrics_interval_secs, last_eval + cfg.evaluation_interval_secs)
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, due - now))
        except asyncio.CancelledError:
            log.info("autoscaler stopped")
            raise
        except BaseException:
            log.exception("autoscaler loop crashed")
            raise

    def start(self) -> asyncio.Task[None]:
        """Create the loop task in the running event loop (idempotent while it runs)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="relax-autoscaler")
        return self._task

    async def stop(self) -> None:
        """Cancel the loop and wait for it; a scale request already sent keeps running in the manager."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- read-outs (GET /autoscaler/*) ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``GET /autoscaler/status``: bounds, pool, last decision, pending request, timers, last frame."""
        now = self._clock()
        policy = self.policy.status()
        frame = self.history.latest
        decision = self.policy.last_decision
        facts = self._pool
        notes: list[str] = []
        if facts is not None:
            try:
                floor, ceiling, notes = effective_bounds(self._config, facts.initial)
            except AutoscalerConfigError as exc:
                floor, ceiling = self.policy.bounds(PoolView(facts.current, facts.initial))
                notes = [str(exc)]
        else:
            floor, ceiling = self._config.min_engines, self._config.max_engines
        directions = policy["directions"]
        last = self._scale_history[-1] if self._scale_history else None
        return strict_json(
            {
                "enabled": self._config.enabled,
                "running": self.running,
                "now": now,
                "floor": floor,
                "ceiling": ceiling,
                "bounds_notes": notes,
                "engines": {
                    "current": facts.current if facts else None,
                    "active": facts.active if facts else None,
                    "initial": facts.initial if facts else None,
                    "by_state": facts.by_state if facts else {},
                },
                "last_decision": _decision_summary(decision),
                "pending_request": self._pending.to_dict(now) if self._pending else None,
                "scale_request_running": facts.running_request if facts else None,
                "cooldown_remaining_secs": {a: d["cooldown_remaining_secs"] for a, d in directions.items()},
                "backoff_remaining_secs": {a: d["backoff_remaining_secs"] for a, d in directions.items()},
                "rejections": {a: d["rejections"] for a, d in directions.items()},
                "last_action_at": {a: d["last_action_at"] for a, d in directions.items()},
                "coverage": frame.coverage if frame else None,
                "last_frame": frame.to_dict() if frame else None,
                "rl_signals": self._rl,
                "blockers": self._blockers(now),
                "last_scale": last.to_dict() if last else None,
            }
        )

    def conditions(self) -> dict[str, Any]:
        """``GET /autoscaler/conditions``: every condition of the last evaluation, and what blocks acting now."""
        decision = self.policy.last_decision
        return strict_json(
            {
                "evaluated_at": decision.timestamp if decision else None,
                "action": decision.action.value if decision else None,
                "target": decision.target if decision else None,
                "reason": decision.reason if decision else "not evaluated yet",
                "rules": rules_summary(),
                "conditions": self.policy.conditions(),
                "blockers": self._blockers(self._clock()),
            }
        )

    def health(self) -> dict[str, Any]:
        """``GET /autoscaler/health``: is the loop alive, how fresh is its view, what went wrong last."""
        now = self._clock()
        scrape_age = now - self._last_scrape_at if self._last_scrape_at is not None else None
        stale_after = 3 * self._config.metrics_interval_secs
        if not self.running:
            state = "stopped"
        elif self._consecutive_errors or (scrape_age is not None and scrape_age > stale_after):
            state = "degraded"
        elif scrape_age is None:
            state = "starting"
        else:
            state = "ok"
        return strict_json(
            {
                "status": state,
                "loop_alive": self.running,
                "enabled": self._config.enabled,
                "uptime_secs": now - self._started_at if self._started_at is not None and self.running else None,
                "last_scrape_at": self._last_scrape_at,
                "last_scrape_age_secs": scrape_age,
                "last_evaluation_age_secs": (
                    now - self._last_evaluation_at if self._last_evaluation_at is not None else None
                ),
                "scrape_timeout_secs": self.scrape_timeout,
                "scrapes": self._scrapes,
                "incomplete_scrapes": self._incomplete_scrapes,
                "last_incomplete": (
                    {"age_secs": now - self._last_incomplete[0], "engines": self._last_incomplete[1]}
                    if self._last_incomplete is not None else None
                ),
                "evaluations": self._evaluations,
                "actions": self._actions,
                "consecutive_errors": self._consecutive_errors,
                "last_error": self._last_error,
                "last_error_age_secs": now - self._last_error_at if self._last_error_at is not None else None,
            }
        )

    def scale_history(self, limit: int = 50, action: str | ScaleAction | None = None) -> list[dict[str, Any]]:
        """``GET /autoscaler/scale_history``: decisions that acted, newest first, optionally one direction."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        wanted = None if action is None else ScaleAction(action)
        if wanted is ScaleAction.NONE:
            raise ValueError("action must be scale_out or scale_in")
        records = [r for r in reversed(self._scale_history) if wanted is None or r.action is wanted]
        return [record.to_dict() for record in records[:limit]]

    def config_dict(self) -> dict[str, Any]:
        """``GET /autoscaler/config``: the config in effect, as the YAML would spell it."""
        return strict_json(self._config.model_dump(mode="json"))

    # -- internals --------------------------------------------------------------------------------

    def _blockers(self, now: float) -> list[str]:
        """Why the autoscaler would not act right now, in words (troubleshooting)."""
        cfg = self._config
        out: list[str] = []
        if not cfg.enabled:
            out.append('disabled: POST /autoscaler/enable {"enabled": true} turns it on')
        frame = self.history.latest
        if frame is None:
            out.append("no metrics frame yet")
        elif not frame.asked:
            out.append("no ACTIVE engines to read metrics from")
        else:
            if frame.coverage < cfg.min_coverage_scale_out:
                out.append(
                    f"coverage {frame.coverage:.0%} below min_coverage_scale_out {cfg.min_coverage_scale_out:.0%}: "
                    "no decision at all"
                )
            if frame.coverage < cfg.min_coverage_scale_in or frame.missing or frame.incomplete:
                out.append(f"metrics incomplete ({len(frame.engines)} of {len(frame.asked)} engines): no scale-in")
            age = now - frame.timestamp
            if age > 2 * cfg.metrics_interval_secs:
                out.append(f"metrics are stale ({age:.0f}s old)")
        if self._pending is not None:
            pending = self._pending
            out.append(f"{pending.direction} request {pending.request_id} is pending ({pending.status})")
        elif self._pool is not None and self._pool.running_request is not None:
            out.append(f"scale request {self._pool.running_request} is running (started outside the autoscaler)")
        for action in (ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN):
            cooldown = self.policy.cooldown_remaining(action, now)
            if cooldown > 0:
                out.append(f"{action.value} cooling down ({cooldown:.0f}s left)")
            backoff = self.policy.backoff_remaining(action, now)
            if backoff > 0:
                out.append(f"{action.value} backing off after a rejected or failed request ({backoff:.0f}s left)")
        if self._pool is not None:
            floor, ceiling = self.policy.bounds(PoolView(self._pool.current, self._pool.initial))
            if self._pool.current >= ceiling:
                out.append(f"at the ceiling ({ceiling} engines): no scale-out")
            if self._pool.current <= floor:
                out.append(f"at the floor ({floor} engines): no scale-in")
        return out

    def _error(self, where: str, exc: BaseException) -> None:
        message = f"{where}: {type(exc).__name__}: {exc}" if str(exc) else f"{where}: {type(exc).__name__}"
        if message != self._last_error:  # log changes, not every cycle of the same outage
            log.warning("autoscaler %s", message)
        self._last_error = message
        self._last_error_at = self._clock()
        self._consecutive_errors += 1

    def _ok(self) -> None:
        self._consecutive_errors = 0


def _status_dict(body: Any) -> Mapping[str, Any]:
    """``relax_status``'s answer, which must be a mapping (anything else is a backend bug: an error)."""
    if not isinstance(body, Mapping):
        raise TypeError(f"relax_status answered {_answer_text(body)}, expected a mapping")
    return body


def _count(body: Mapping[str, Any], key: str) -> int:
    """A non-negative engine count from ``relax_status``; a missing or broken one is an error, never a guess."""
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RuntimeError(f"relax_status has no usable {key} ({value!r})")
    return value


def _refusal(exc: ScalingError) -> str:
    """A refusal in words: the rule's message (a conflict's names the request that runs)."""
    message = exc.message or str(exc)
    if isinstance(exc, ScaleConflict) and exc.running_request_id not in message:
        message = f"{message} (running: {exc.running_request_id})"
    return message[:300]


def _answer_text(answer: Any) -> str:
    """An answer in words for a record: its message or detail when it has one, else its start."""
    if isinstance(answer, Mapping):
        for key in ("message", "detail"):
            if answer.get(key):
                return str(answer[key])[:300]
    return str(answer)[:300]


def _decision_summary(decision: Decision | None) -> dict[str, Any] | None:
    if decision is None:
        return None
    return {
        "action": decision.action.value,
        "target": decision.target,
        "delta": decision.delta,
        "reason": decision.reason,
        "timestamp": decision.timestamp,
    }


def _drivers(decision: Decision) -> dict[str, Any]:
    """The conditions that drove an action: the sustained scale-out signals, or every scale-in condition."""
    if decision.action is ScaleAction.SCALE_OUT:
        names = [n for n in SCALE_OUT_CONDITIONS if n in decision.conditions and decision.conditions[n].sustained]
    else:
        names = [n for n in SCALE_IN_CONDITIONS if n in decision.conditions]
    return strict_json({name: decision.conditions[name].to_dict() for name in names})


def start_autoscaler(config: AutoscalerConfig, backend: AutoscalerBackend, **kwargs: Any) -> AutoscalerService:
    """Create the service and start its loop as a task in the running event loop (the control plane's).

    ``backend`` is a ``relax.rollout.control.manager_client.ManagerClient`` over the RolloutManager actor (see
    ``relax.autoscaler.mount``) or an in-process double. ``kwargs`` go to ``AutoscalerService`` (``clock``,
    ``scrape_timeout``, ``engine_token``...). Call ``await service.stop()`` on shutdown.
    """
    service = AutoscalerService(config, backend, **kwargs)
    service.start()
    return service
