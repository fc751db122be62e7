"""Scraping the engines' ``/metrics`` for the autoscaler: the HTTP half of ``relax.autoscaler.metrics``.

The parsing and every rule about what a scrape means live in the pure ``metrics`` module; this one only fetches
the texts (and turns each engine's failure into a ``ScrapeError``), so the decision modules never import HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx

from relax.autoscaler.metrics import ScrapeError

__all__ = ["metrics_url", "scrape_all"]


def metrics_url(url: str) -> str:
    """An engine's base URL or its full ``/metrics`` URL -> the ``/metrics`` URL."""
    text = url.rstrip("/")
    return text if text.endswith("/metrics") else f"{text}/metrics"


async def scrape_all(
    urls: Mapping[str, str],
    timeout: float,
    *,
    token: str | None = None,
    client: httpx.AsyncClient | None = None,
) -> dict[str, str | Exception]:
    """Fetch ``/metrics`` of every engine concurrently; each answer is the text or the exception.

    ``timeout`` bounds each engine's whole request (connect + read), so one hung engine costs one
    timeout, not one per engine. Never raises for an engine's failure: the caller turns failures into
    missing engines and lower coverage. Proxy variables are ignored (engines are cluster-internal).
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if not urls:
        return {}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout, headers=headers, trust_env=False)
    try:
        answers = await asyncio.gather(*(_scrape_one(http, metrics_url(u), timeout) for u in urls.values()))
    finally:
        if own:
            await http.aclose()
    return dict(zip(urls, answers, strict=True))


async def _scrape_one(http: httpx.AsyncClient, url: str, timeout: float) -> str | Exception:
    try:
        response = await asyncio.wait_for(http.get(url, timeout=timeout), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return ScrapeError(f"GET {url} timed out after {timeout:g}s")
    except httpx.HTTPError as error:
        return ScrapeError(f"GET {url} failed: {type(error).__name__}: {error}")
    if not response.is_success:
        return ScrapeError(f"GET {url} -> HTTP {response.status_code}")
    return response.text
