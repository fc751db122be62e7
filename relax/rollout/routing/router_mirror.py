"""Mirroring Relax's routable engines into an external SGLang router (``--sglang-router-url``).

Users of the SGLang ecosystem put the SGLang router (pip ``sglang-router``) in front of their engines. With
``--sglang-router-url`` the run keeps that router's worker list equal to Relax's routable set: an engine is
registered once it is ACTIVE on the newest weights and deregistered at the moment Relax stops routing to it
(before a drain, an eviction or a retirement, and when it fails), so the router never sends to an engine that
is leaving. Relax stays the owner of the pool; the router only sees it.

Two parts, one concept: :func:`plan_changes` (pure: which URLs to add and which to remove, given what Relax
wants and what the router lists) and :class:`SGLangRouterMirror` (the shell: one background task that applies
the plan over HTTP, serialised, and retries after a failure). A router that is down never breaks training:
each failure is one log line naming the engines and URLs concerned, it is counted in :meth:`status`, and the
next change (or a backoff timer) tries again from a fresh listing.

**The router's API** (``sglang-router==0.3.2``, the Rust "SGLang Model Gateway" the package runs in-process;
checked by running it, ``tests/integration/test_sglang_router_mirror.py`` runs it for real):

* ``POST /workers`` with ``{"url": U, "api_key": K}`` answers 202 ``{"status": "accepted", "worker_id": ID}``.
  Registration is a background job: the router probes ``U/health``, reads the model info with the key, then
  lists the worker (~50 ms for a healthy built-in engine). A URL it cannot reach is retried for up to its
  ``--worker-startup-timeout-secs`` and is not listed meanwhile; deleting it meanwhile does not cancel the job.
  Posting a URL that is already registered fails that job ("already exists") and changes nothing.
* ``GET /workers`` answers ``{"workers": [{"id": ID, "url": U, "is_healthy": ..., ...}], "total": n}``
  (the worker's key is not echoed).
* ``DELETE /workers/{ID}`` answers 202; ID is the router's id from the listing (a UUID, stable per URL), not
  the URL. The worker leaves the listing within ~0.3 s.
* The 0.1/0.2 routes (``/add_worker?url=``, ``/remove_worker?url=``, ``/list_workers``) answer 404.

Because both add and remove are asynchronous on the router's side, every pass ends by listing again until
the router shows the planned state (bounded by ``settle_s``): the next change is only applied once the
previous one is visible, so a remove can never overtake the registration it undoes.

**Auth.** To workers: the per-worker ``api_key`` of ``POST /workers``; the router sends
``Authorization: Bearer <key>`` on every request it forwards to that worker (replacing the client's own
header), which is what Relax's engines require (the run's secret; only ``/health``, ``/health_generate`` and
``/metrics`` are open). So the run's engine key is handed to the router the user named; it is sent in the
request body, never logged, and the router does not list it. A router started with ``--api-key R`` requires
``Authorization: Bearer R`` on all its routes (``/workers`` as well as ``/generate``): Relax sends it when
given (``api_key`` here, ``FleetSettings.sglang_router_api_key``). Finer admin keys
(``--control-plane-api-keys``, JWT) are the router's business; use ``--api-key`` with Relax.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from relax.logs import failure_cause
from relax.rollout.pool.engine_url import normalize_engine_url

log = logging.getLogger("relax.rollout")

__all__ = ["MirrorPlan", "RouterAPIError", "SGLangRouterMirror", "canonical_url", "parse_workers", "plan_changes"]

#: Routes of sglang-router 0.3.2's worker API (module docstring).
WORKERS_ROUTE = "/workers"

REQUEST_TIMEOUT_S = 10.0  # one call to the router; it answers its admin routes in milliseconds
SETTLE_S = 5.0  # how long a pass waits for the router to list what it was asked (its jobs are asynchronous)
SETTLE_POLL_S = 0.05
RETRY_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # after consecutive failed passes, without a new change


# ------------------------------------------------------------------ pure part


def canonical_url(url: str) -> str:
    """One spelling per engine URL (``scheme://host:port``), so Relax's and the router's URLs compare equal.

    A URL that is not an engine base URL (a router may list anything it was given) is kept as written, less a
    trailing slash.
    """
    try:
        return normalize_engine_url(url)
    except ValueError:
        return url.strip().rstrip("/")


@dataclass(frozen=True)
class MirrorPlan:
    """What one pass changes on the router: removals first, so it stops sending to leavers before anything else."""

    remove: tuple[str, ...] = ()
    add: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.remove or self.add)


def plan_changes(desired: Iterable[str], listed: Iterable[str], managed: Collection[str]) -> MirrorPlan:
    """The changes that make the router's list equal ``desired`` on the URLs Relax manages.

    ``desired``: URLs of Relax's routable engines. ``listed``: URLs the router lists now. ``managed``: every URL
    Relax ever registered or asked to register in this run. A listed URL outside ``managed`` is someone
    else's worker and is left alone; a managed one that is no longer desired is removed (also one that a
    registration job finished after Relax had given it up). All URLs are compared canonically; the result is
    sorted so a pass is reproducible.
    """
    want = {canonical_url(u) for u in desired}
    have = {canonical_url(u) for u in listed}
    ours = {canonical_url(u) for u in managed} | want
    return MirrorPlan(remove=tuple(sorted((have & ours) - want)), add=tuple(sorted(want - have)))


class RouterAPIError(RuntimeError):
    """The router answered something other than its documented worker API (or nothing at all)."""


def parse_workers(body: Any) -> dict[str, str]:
    """``GET /workers``'s body as {canonical url: worker id}; raises :class:`RouterAPIError` on another shape."""
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        raise RouterAPIError(f"GET {WORKERS_ROUTE} did not answer {{'workers': [...]}} (sglang-router 0.3.2's shape); "
                             f"got {str(body)[:200]!r}")
    out: dict[str, str] = {}
    for worker in workers:
        if not (isinstance(worker, dict) and isinstance(worker.get("url"), str) and worker.get("id") is not None):
            raise RouterAPIError(f"GET {WORKERS_ROUTE} listed a worker without url and id: {str(worker)[:200]!r}")
        out[canonical_url(worker["url"])] = str(worker["id"])
    return out


# ------------------------------------------------------------------ the shell


@dataclass
class _Engine:
    url: str  # canonical
    api_key: str | None


class SGLangRouterMirror:
    """Keeps one SGLang router's worker list equal to the engines Relax routes to.

    :meth:`add` and :meth:`remove` only record what Relax wants and wake the background task, so the fleet
    never waits on the router to change its own routing; :meth:`synced` lets a caller wait (bounded) until the
    router shows it, which the fleet does before draining an engine.
    """

    def __init__(self, url: str, *, api_key: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 settle_s: float = SETTLE_S) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._settle_s = settle_s
        self._desired: dict[str, _Engine] = {}  # engine id -> what the router should list
        self._managed: dict[str, str] = {}  # canonical url -> the engine id it was last registered for
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._passes = asyncio.Condition()
        self._requested = 0  # bumped by every change
        self._done = 0  # the change count the last finished pass (successful or not) started from
        self._applied = 0  # the change count the last successful pass started from
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        self._failed_change = -1  # the change count of the last failed pass (a new change is logged again)
        self.failures = 0  # failed passes over the run
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.registered: dict[str, str] = {}  # engine id -> url, as the router listed them after the last pass

    # -------------------------------------------------------------- what Relax wants
    def add(self, engine_id: str, url: str, api_key: str | None = None) -> None:
        """``engine_id`` at ``url`` became routable: register it (in the background)."""
        engine = _Engine(canonical_url(url), api_key)
        self._desired[engine_id] = engine
        self._managed[engine.url] = engine_id
        self._changed()

    def remove(self, engine_id: str) -> None:
        """``engine_id`` stopped being routable: deregister it (in the background); no-op if it never was."""
        if self._desired.pop(engine_id, None) is not None:
            self._changed()

    async def synced(self, timeout_s: float) -> bool:
        """Wait until a pass that started after the last change has finished; True if it succeeded.

        Returns at the first finished pass (a router that refuses connections answers at once), or False after
        ``timeout_s``: callers bound how long a router can hold them up.
        """
        target = self._requested
        if self._applied >= target:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            async with self._passes:
                await asyncio.wait_for(self._passes.wait_for(lambda: self._done >= target), timeout_s)
        return self._applied >= target

    def status(self) -> dict[str, Any]:
        """For the manager's status: where the router is, what it lists of ours, how often syncing failed."""
        return {"url": self.url, "registered": dict(self.registered), "wanted": len(self._desired),
                "in_sync": self._applied >= self._requested, "failures": self.failures,
                "last_error": self.last_error}

    async def aclose(self, *, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the task and close the session; with ``deregister`` first take every Relax engine off the router
        (the run is ending: its engines are about to stop)."""
        if deregister and self._managed:
            self._desired.clear()
            self._changed()
            await self.synced(timeout_s)
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -------------------------------------------------------------- the background task
    def _changed(self) -> None:
        if self._closed:
            return
        self._requested += 1
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sglang-router-mirror")

    async def _run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            started = self._requested
            try:
                await self._sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a router problem must never reach training
                self._failed(exc, new_change=started != self._failed_change)
                self._failed_change = started
            else:
                self._applied = started
                if self.consecutive_failures:
                    log.info("sglang router %s: in sync again after %d failed attempt(s) (%d engine(s) registered)",
                             self.url, self.consecutive_failures, len(self.registered))
                self.consecutive_failures = 0
                self.last_error = None
            async with self._passes:
                self._done = started
                self._passes.notify_all()
            if self._applied < self._requested and not self._wake.is_set():
                self._retry_later()

    def _retry_later(self) -> None:
        """No change is coming to retry on (a quiet pool): try again after a backoff, so a router that comes back
        is filled without waiting for the next scale event."""
        delay = RETRY_BACKOFF_S[max(1, min(self.consecutive_failures, len(RETRY_BACKOFF_S))) - 1]
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(delay, self._wake.set)

    def _failed(self, exc: BaseException, *, new_change: bool) -> None:
        """One line per failure that concerns a new change (the first of a streak, or one after an engine came
        or went); retries of the same state log at debug level only, the count still goes up."""
        self.failures += 1
        self.consecutive_failures += 1
        cause = failure_cause(exc)
        self.last_error = cause
        pending = [f"add {eid} ({e.url})" for eid, e in sorted(self._desired.items())
                   if self.registered.get(eid) != e.url]
        pending += [f"remove {eid} ({url})" for eid, url in sorted(self.registered.items()) if eid not in self._desired]
        level = logging.WARNING if new_change or self.consecutive_failures == 1 else logging.DEBUG
        log.log(level, "sglang router %s: sync failed (%s); pending: %s; retried on the next change (failure %d)",
                self.url, cause, ", ".join(pending) or "nothing", self.failures)

    async def _sync_once(self) -> None:
        listed = await self._list()
        plan = plan_changes((e.url for e in self._desired.values()), listed, self._managed)
        for url in plan.remove:
            engine_id = self._managed.get(url, "?")
            try:
                await self._call("DELETE", f"{WORKERS_ROUTE}/{listed[url]}")
            except Exception as exc:
                raise RouterAPIError(f"could not remove {engine_id} ({url}): {failure_cause(exc)}") from exc
            log.info("sglang router %s: removed %s (%s)", self.url, engine_id, url)
        keys = {e.url: e.api_key for e in self._desired.values()}
        for url in plan.add:
            engine_id = self._managed.get(url, "?")
            body: dict[str, Any] = {"url": url}
            if keys.get(url):
                body["api_key"] = keys[url]
            try:
                await self._call("POST", WORKERS_ROUTE, json=body)
            except Exception as exc:
                raise RouterAPIError(f"could not add {engine_id} ({url}): {failure_cause(exc)}") from exc
            log.info("sglang router %s: added %s (%s)", self.url, engine_id, url)
        if plan:
            listed = await self._settle(plan)
        self.registered = {self._managed[u]: u for u in listed if u in self._managed}

    async def _settle(self, plan: MirrorPlan) -> dict[str, str]:
        """List until the router shows ``plan`` done (its add/remove jobs run in the background)."""
        deadline = time.monotonic() + self._settle_s
        while True:
            listed = await self._list()
            missing = [u for u in plan.add if u not in listed]
            lingering = [u for u in plan.remove if u in listed]
            if not missing and not lingering:
                return listed
            if time.monotonic() > deadline:
                what = "; ".join([*(f"{self._managed.get(u, '?')} ({u}) not registered (can the router reach it?)"
                                    for u in missing),
                                  *(f"{self._managed.get(u, '?')} ({u}) still listed" for u in lingering)])
                raise RouterAPIError(f"after {self._settle_s:.0f}s: {what}")
            await asyncio.sleep(SETTLE_POLL_S)

    async def _list(self) -> dict[str, str]:
        return parse_workers(await self._call("GET", WORKERS_ROUTE))

    async def _call(self, method: str, route: str, *, json: Mapping[str, Any] | None = None) -> Any:
        if self._session is None:
            # trust_env=False: a proxy from the environment must not carry the engines' key (as EngineClient)
            self._session = aiohttp.ClientSession(timeout=self._timeout, trust_env=False)
        try:
            async with self._session.request(method, self.url + route, json=json, headers=self._headers) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    hint = " (the router needs its --api-key)" if resp.status == 401 else ""
                    raise RouterAPIError(f"{method} {route}: HTTP {resp.status}{hint}: {text[:200]}")
                if not text:
                    return None
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    raise RouterAPIError(f"{method} {route}: not JSON: {text[:200]!r}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise RouterAPIError(f"{method} {self.url}{route}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
