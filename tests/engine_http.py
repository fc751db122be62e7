"""Reading a running engine over HTTP, the way the engine tests check it: its ``/metrics``, and waiting for a
condition on it (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


async def engine_metrics(http: httpx.AsyncClient) -> dict[str, float]:
    """The engine's ``/metrics`` samples by name (histogram buckets left out)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families((await http.get("/metrics")).text):
        for s in family.samples:
            if "le" not in s.labels:
                out[s.name] = s.value
    return out


async def in_flight(http: httpx.AsyncClient) -> tuple[float, float]:
    """(requests running, requests queued), as the engine's ``/metrics`` says."""
    m = await engine_metrics(http)
    return m["sglang:num_running_reqs"], m["sglang:num_queue_reqs"]


async def poll(predicate: Callable[[], Awaitable[bool]], timeout: float = 15.0, what: str = "condition") -> None:
    """Wait until ``predicate()`` holds, checking every 20 ms; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: not met within {timeout}s")
