"""A bounded burst of concurrent generations against one engine (demo and benchmarks).

Traffic only goes to the engine URL it is given, and the burst is bounded in count, so it is safe
to point at a loopback server in tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from relax.engines.client import EngineClient


@dataclass(frozen=True)
class BurstResult:
    requests: int
    concurrency: int
    completion_tokens: int
    seconds: float
    latencies: tuple[float, ...]

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def latency_quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def run_burst(
    url: str, prompt: str, *, requests: int, concurrency: int, max_new_tokens: int, temperature: float = 1.0,
    token: str | None = None,
) -> BurstResult:
    """Send `requests` generations with at most `concurrency` in flight; fixed-length outputs."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0
    async with EngineClient(url, timeout=600, token=token) as client:

        async def one() -> None:
            nonlocal tokens
            async with gate:
                began = time.perf_counter()
                out = await client.generate(prompt, sampling_params=params)
                latencies.append(time.perf_counter() - began)
                tokens += int(out["meta_info"]["completion_tokens"])  # type: ignore[index]

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        elapsed = time.perf_counter() - began
    return BurstResult(requests, concurrency, tokens, elapsed, tuple(latencies))


def scrape_metrics(text: str) -> dict[str, float]:
    """Flatten Prometheus text to {name: value}; histograms keep _count and _sum (no buckets)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels and not sample.name.endswith("_created"):
                out[sample.name] = sample.value
    return out
