"""Async HTTP client of the engine contract (SGLang's native API; docs/architecture.md, "Engines").

One client talks to one engine. The same client serves a real SGLang server and Relax's built-in engine,
because both speak the same endpoints and JSON shapes.

Errors are typed so that callers can decide without parsing strings:

- :class:`EngineUnavailable` - the engine could not be reached or did not answer in time (connection
  refused/reset, timeouts, a response cut off mid-way, 502/503/504). The router retries the request on
  another engine.
- :class:`EngineError` - the engine answered and refused (4xx, 500, ``success: false``). Retrying the same
  request elsewhere will usually fail the same way.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

import aiohttp

from relax.engines.event_stream import EventStream, StreamError
from relax.engines.keys import is_admin_route
from relax.weights.pause_mode import PauseMode

# Status codes that mean "this engine cannot serve right now", not "your request is wrong".
_UNAVAILABLE_STATUS = frozenset({502, 503, 504})
# Cap on how much of a non-JSON error body goes into an exception message.
_MAX_BODY_IN_MESSAGE = 500

_UNSET: Any = object()

#: How long an idle pooled connection may be reused. Engines serve with uvicorn, which closes a keep-alive
#: connection idle for 5 s (its default; the built-in engine and SGLang both run under it). A request sent on a
#: connection the server is closing at that moment is reset ("connection reset by peer"), and after a lull
#: (the trainer holding generation back) every pooled connection hits the 5 s mark at once, so retries fail
#: the same way. Giving idle connections up well before the server does avoids the race without probing
#: each socket per request.
KEEPALIVE_S = 2.0

#: Where old SGLang builds reported the weight version; 0.5.23 has no such route (it is in /model_info).
LEGACY_WEIGHT_VERSION_ROUTE = "/get_weight_version"

#: Every SGLang route this client calls (checked against the SGLang contract snapshot, scripts/).
SGLANG_ROUTES_USED: tuple[str, ...] = (
    "/generate",
    "/health",
    "/health_generate",
    "/metrics",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/begin_weight_update",
    "/update_weights_from_distributed",
    "/end_weight_update",
    "/destroy_weights_update_group",
    "/server_info",
    "/model_info",
)


class EngineError(RuntimeError):
    """An engine call failed; carries where, what and why so logs and the router can act on it."""

    def __init__(
        self,
        message: str,
        *,
        url: str,
        endpoint: str,
        status_code: int | None = None,
        server_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.endpoint = endpoint
        self.status_code = status_code
        self.server_message = server_message

    def __reduce__(self):  # keep the fields when the error crosses a Ray / pickle boundary
        return (
            _rebuild_error,
            (type(self), str(self), self.url, self.endpoint, self.status_code, self.server_message),
        )


class WeightsUncheckable(EngineError):
    """The engine answers, but cannot report what weights it serves (``/weights_checker``): it is not verified."""


class EngineUnavailable(EngineError):
    """The engine is unreachable, timed out or overloaded: retry the request on another engine."""


def _rebuild_error(
    cls: type[EngineError],
    message: str,
    url: str,
    endpoint: str,
    status_code: int | None,
    server_message: str | None,
) -> EngineError:
    return cls(message, url=url, endpoint=endpoint, status_code=status_code, server_message=server_message)


def normalize_base_url(base_url: str) -> str:
    """Check that ``base_url`` names an engine (http/https, a host, a valid port) and normalise it.

    Raises ``ValueError`` with a message naming the problem; the REST layer reuses this to reject
    malformed ``engine_urls`` before anything changes state. A path prefix is kept (engines behind a
    proxy); query strings and fragments are rejected because every endpoint path is appended to it.
    """
    if not isinstance(base_url, str) or not base_url.strip():
        raise ValueError(f"engine URL must be a non-empty string, got {base_url!r}")
    text = base_url.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URL {text!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"engine URL {text!r} has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"engine URL {text!r} has an invalid port: {exc}") from None
    if port is not None and port == 0:
        raise ValueError(f"engine URL {text!r} has an invalid port: 0")
    if parts.username or parts.password:
        raise ValueError(f"engine URL {text!r} must not carry credentials; pass token= instead")
    if parts.query or parts.fragment:
        raise ValueError(f"engine URL {text!r} must not have a query string or fragment")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass(frozen=True, slots=True)
class Response:
    """An engine's answer, read in full: the connection is back in the pool before anyone looks at it."""

    status_code: int
    reason: str
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _server_message(response: Response) -> str:
    """Best-effort extraction of the error text an engine put in its response body."""
    text = response.text
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message") is not None:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if body.get(key) is not None:
                value = body[key]
                return value if isinstance(value, str) else json.dumps(value)
    text = text.strip()
    if len(text) > _MAX_BODY_IN_MESSAGE:
        text = text[:_MAX_BODY_IN_MESSAGE] + "..."
    return text or response.reason


@dataclass
class PauseWindow:
    """What :meth:`EngineClient.paused` did: the mode, and how long the engine did not generate."""

    mode: PauseMode
    seconds: float = 0.0


class EngineClient:
    """One engine's HTTP API as async methods; close it with ``aclose()`` or ``async with``.

    ``timeout`` (seconds) applies to every call unless the call passes its own ``timeout=`` (``None``
    there means no limit): a long generation legitimately outlives a health probe's patience. It bounds
    connecting (waiting for a pooled connection included) and each wait for bytes, not the whole exchange.
    ``token`` is sent as ``Authorization: Bearer`` (SGLang's ``--api-key``) on generation routes and
    ``admin_token`` (its ``--admin-api-key``) on control routes (``relax.engines.keys.ADMIN_ROUTES``; the
    token there when there is no admin token). Proxy environment variables
    are ignored: engines are cluster-internal, and an ``HTTP_PROXY`` meant for the internet must not
    swallow traffic to 10.x addresses.

    The transport is aiohttp, not httpx: the rollout manager keeps one generation in flight per sample,
    and httpx's connection pool scans (and polls the socket of) every pooled connection on each request,
    so its CPU per request grows with the number in flight (``benchmarks/engine_client.py``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 60.0,
        token: str | None = None,
        admin_token: str | None = None,
        max_connections: int = 1024,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        if not keepalive_s > 0:
            raise ValueError(f"keepalive_s must be a positive number of seconds, got {keepalive_s!r}")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        admin = admin_token or token
        self._admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        # Many concurrent generations per engine is the normal case; a small pool would turn queueing on
        # our side into timeouts that look like an unavailable engine.
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None  # made in the first call: it binds to that loop
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                trust_env=False,
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=self._keepalive_s),
            )
        return self._session

    @staticmethod
    def _timeout(seconds: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=seconds, sock_read=seconds)

    async def _request(
        self,
        method: str,
        endpoint: str,
        *,
        payload: dict[str, Any] | None = None,
        timeout: float | None = _UNSET,
    ) -> Response:
        """Send one request; map transport failures and error statuses to typed errors.

        ``timeout`` left out means the client's timeout; ``None`` means no limit.
        """
        limit = self._timeout(self.timeout if timeout is _UNSET else timeout)
        try:
            headers = self._admin_headers if is_admin_route(endpoint) else None
            async with self._http().request(method, self.base_url + endpoint, json=payload, timeout=limit,
                                            headers=headers) as answer:
                response = Response(answer.status, answer.reason or "", await answer.read())
        except TimeoutError as exc:
            raise EngineUnavailable(
                f"{method} {self.base_url}{endpoint} timed out ({type(exc).__name__})",
                url=self.base_url,
                endpoint=endpoint,
            ) from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(
                f"{method} {self.base_url}{endpoint} failed: {type(exc).__name__}: {exc}",
                url=self.base_url,
                endpoint=endpoint,
            ) from exc
        if response.is_success:
            return response
        self._raise_for(response, method, endpoint)

    def _raise_for(self, response: Response, method: str, endpoint: str) -> NoReturn:
        """Raise the typed error of an unsuccessful answer (unavailable: 502/503/504; refused otherwise)."""
        message = _server_message(response)
        cls = EngineUnavailable if response.status_code in _UNAVAILABLE_STATUS else EngineError
        raise cls(
            f"{method} {self.base_url}{endpoint} -> {response.status_code}: {message}",
            url=self.base_url,
            endpoint=endpoint,
            status_code=response.status_code,
            server_message=message,
        )

    def _json(self, response: Response, endpoint: str) -> Any:
        """Parse a JSON body; an empty body is ``None`` (SGLang answers some control calls with none)."""
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(
                f"{self.base_url}{endpoint} returned a body that is not JSON: {response.text[:200]!r}",
                url=self.base_url,
                endpoint=endpoint,
                status_code=response.status_code,
            ) from exc

    async def _get_json(self, endpoint: str, *, timeout: float | None = _UNSET) -> Any:
        return self._json(await self._request("GET", endpoint, timeout=timeout), endpoint)

    async def _post_json(self, endpoint: str, payload: dict[str, Any], *, timeout: float | None = _UNSET) -> Any:
        return self._json(await self._request("POST", endpoint, payload=payload, timeout=timeout), endpoint)

    # -- generation -------------------------------------------------------------------------------

    async def generate(
        self,
        text: str | list[str] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        rid: str | list[str] | None = None,
        return_logprob: bool = False,
        timeout: float | None = _UNSET,
        **extra: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """``POST /generate``: one result dict, or a list when ``n > 1`` or the input is batched.

        Exactly one of ``text`` / ``input_ids``. ``extra`` passes further SGLang fields through as-is.
        """
        if (text is None) == (input_ids is None):
            raise ValueError("generate needs exactly one of text= or input_ids=")
        payload: dict[str, Any] = {"sampling_params": dict(sampling_params or {})}
        if text is not None:
            payload["text"] = text
        else:
            payload["input_ids"] = input_ids
        if rid is not None:
            payload["rid"] = rid
        if return_logprob:
            payload["return_logprob"] = True
        payload.update(extra)
        response = await self._request("POST", "/generate", payload=payload, timeout=timeout)
        result = self._json(response, "/generate")
        if not isinstance(result, dict | list):
            raise EngineError(
                f"{self.base_url}/generate returned {type(result).__name__}, expected an object or a list",
                url=self.base_url,
                endpoint="/generate",
                status_code=response.status_code,
            )
        return result

    async def generate_stream(
        self,
        held: EventStream,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        timeout: float | None = _UNSET,
    ) -> dict[str, Any]:
        """``POST /generate`` with ``"stream": true`` for one request; returns the final answer.

        ``held`` receives the stream as it arrives (relax.engines.event_stream), so when this raises - the
        engine died, the connection broke, the caller cancelled - ``held.latest()`` is the output so far.
        ``timeout`` bounds each wait for bytes, not the whole generation.
        """
        payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": dict(sampling_params or {}),
                                   "stream": True}
        if rid is not None:
            payload["rid"] = rid
        if return_logprob:
            payload["return_logprob"] = True
        url, endpoint = self.base_url, "/generate"
        limit = self._timeout(self.timeout if timeout is _UNSET else timeout)
        try:
            async with self._http().post(url + endpoint, json=payload, timeout=limit) as answer:
                if not 200 <= answer.status < 300:
                    self._raise_for(Response(answer.status, answer.reason or "", await answer.read()),
                                          "POST", endpoint)
                async for data in answer.content.iter_any():
                    held.feed(data)
        except TimeoutError as exc:
            raise EngineUnavailable(f"POST {url}{endpoint} (stream) timed out ({type(exc).__name__})",
                                    url=url, endpoint=endpoint) from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"POST {url}{endpoint} (stream) failed: {type(exc).__name__}: {exc}",
                                    url=url, endpoint=endpoint) from exc
        except StreamError as exc:
            raise EngineError(f"POST {url}{endpoint} (stream): {exc}", url=url, endpoint=endpoint,
                              server_message=str(exc)) from exc
        final = held.latest() if held.done else None
        if final is None:
            raise EngineUnavailable(f"POST {url}{endpoint}: the stream ended without its final chunk "
                                    f"({held.chunks} chunk(s) received)", url=url, endpoint=endpoint)
        return final

    # -- health and metrics -----------------------------------------------------------------------

    async def health(self, *, timeout: float | None = _UNSET) -> None:
        """``GET /health``: returns when the server process answers; raises otherwise."""
        await self._request("GET", "/health", timeout=timeout)

    async def health_generate(self, *, timeout: float | None = _UNSET) -> None:
        """``GET /health_generate``: returns when the engine can actually generate a token."""
        await self._request("GET", "/health_generate", timeout=timeout)

    async def is_healthy(self, *, generate: bool = True, timeout: float | None = _UNSET) -> bool:
        """Health as a boolean, for pollers that only need yes/no."""
        try:
            if generate:
                await self.health_generate(timeout=timeout)
            else:
                await self.health(timeout=timeout)
        except EngineError:
            return False
        return True

    async def metrics_text(self, *, timeout: float | None = _UNSET) -> str:
        """``GET /metrics``: the Prometheus exposition text (SGLang needs ``--enable-metrics``)."""
        return (await self._request("GET", "/metrics", timeout=timeout)).text

    # -- control ----------------------------------------------------------------------------------

    async def flush_cache(self) -> None:
        """``POST /flush_cache``; SGLang answers 400 while requests are running (raised as EngineError)."""
        await self._request("POST", "/flush_cache")

    async def pause_generation(self, mode: PauseMode | str = PauseMode.ABORT, *,
                               timeout: float | None = _UNSET) -> Any:
        """``POST /pause_generation`` with ``mode`` in abort | retract | in_place."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        mode = PauseMode(mode)
        return await self._post_json("/pause_generation", {"mode": mode.value}, timeout=timeout)

    async def continue_generation(self, *, timeout: float | None = _UNSET) -> Any:
        """``POST /continue_generation``: resume after ``pause_generation``."""
        return await self._post_json("/continue_generation", {}, timeout=timeout)

    @contextlib.asynccontextmanager
    async def paused(self, mode: PauseMode | str, *, timeout: float | None = _UNSET) -> AsyncIterator[PauseWindow]:
        """Pause generation for a weight load and continue after it: the one bracket of every weight path.

        ``none`` pauses nothing (the load then waits behind SGLang's writer lock for in-flight requests). When
        the load raises, the engine is **left paused**: a failed load may have changed part of the model, and the
        caller fails the engine rather than let it serve a mix of two versions. ``seconds`` is set on success.
        """
        window = PauseWindow(PauseMode(mode))
        began = time.monotonic()
        if window.mode.pauses:
            await self.pause_generation(window.mode, timeout=timeout)
        yield window
        if window.mode.pauses:
            await self.continue_generation(timeout=timeout)
            window.seconds = time.monotonic() - began

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> Any:
        """``POST /abort_request``: abort one request by ``rid``, or all of them."""
        if rid is None and not abort_all:
            raise ValueError("abort_request needs rid= or abort_all=True")
        return await self._post_json("/abort_request", {"rid": rid or "", "abort_all": bool(abort_all)})

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | str,
        load_format: str | None = None,
        *,
        timeout: float | None = _UNSET,
        **extra: Any,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_disk``; returns ``{success, message, ...}`` or raises EngineError.

        ``weight_version`` travels as a string because SGLang declares it ``str``; Relax's versions are
        integers, so callers pass ints and read them back with ``int(...)``.
        """
        payload: dict[str, Any] = {"model_path": str(model_path), "weight_version": str(weight_version)}
        if load_format is not None:
            payload["load_format"] = load_format
        payload.update(extra)
        endpoint = "/update_weights_from_disk"
        result = await self._post_json(endpoint, payload, timeout=timeout)
        if not isinstance(result, dict) or not result.get("success", False):
            message = result.get("message") if isinstance(result, dict) else repr(result)
            raise EngineError(
                f"{self.base_url}{endpoint} did not load {model_path!r}: {message}",
                url=self.base_url,
                endpoint=endpoint,
                status_code=200,
                server_message=None if message is None else str(message),
            )
        return result

    # -- broadcast weight updates (SGLang's distributed protocol) -----------------------------------

    def _check_success(self, result: Any, endpoint: str, what: str) -> dict[str, Any]:
        if not isinstance(result, dict) or not result.get("success", False):
            message = result.get("message") if isinstance(result, dict) else repr(result)
            raise EngineError(f"{self.base_url}{endpoint} {what}: {message}", url=self.base_url, endpoint=endpoint,
                              status_code=200, server_message=None if message is None else str(message))
        return result

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
        group_name: str = "weight_update_group", backend: str = "nccl", timeout: float | None = _UNSET,
    ) -> dict[str, Any]:
        """``POST /init_weights_update_group``: returns once the engine's ranks joined (the trainer must join too)."""
        endpoint = "/init_weights_update_group"
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return self._check_success(await self._post_json(endpoint, body, timeout=timeout), endpoint,
                                   f"did not join weight group {group_name!r}")

    async def begin_weight_update(self) -> dict[str, Any]:
        """``POST /begin_weight_update``: open the session every distributed update must run in."""
        return await self._post_json("/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any]:
        """``POST /end_weight_update``."""
        return await self._post_json("/end_weight_update", {})

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        group_name: str = "weight_update_group", weight_version: int | str | None = None,
        load_format: str | None = None, flush_cache: bool = True, timeout: float | None = _UNSET,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_distributed``: returns after the broadcast (from rank 0) and the load."""
        endpoint = "/update_weights_from_distributed"
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return self._check_success(await self._post_json(endpoint, body, timeout=timeout), endpoint,
                                   f"did not load a bucket of {len(names)} tensors")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group", *,
                                           timeout: float | None = _UNSET) -> dict[str, Any]:
        """``POST /destroy_weights_update_group``."""
        return await self._post_json("/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

    # -- identity ---------------------------------------------------------------------------------

    async def get_server_info(self) -> dict[str, Any]:
        """``GET /server_info``: the server's arguments and state (used to vet external engines).

        SGLang 0.5.23 still answers ``/get_server_info`` but logs a deprecation warning on every call.
        """
        return await self._get_json("/server_info")

    async def get_weight_version(self) -> str:
        """The version string the engine serves, from ``/model_info`` (SGLang has no other route for it).

        Builds older than ``/model_info``'s ``weight_version`` field answered ``/get_weight_version``;
        that route is tried only when ``/model_info`` lacks the field or does not exist.
        """
        body: Any = None
        for endpoint in ("/model_info", LEGACY_WEIGHT_VERSION_ROUTE):
            try:
                body = await self._get_json(endpoint)
            except EngineError as exc:
                if exc.status_code != 404:
                    raise
                body = None
            if isinstance(body, dict) and "weight_version" in body:
                break
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError(
                f"{self.base_url} reports no weight version: /model_info has no 'weight_version' and "
                f"{LEGACY_WEIGHT_VERSION_ROUTE} is missing; is it an SGLang server started with --weight-version "
                "(SGLang >= 0.5)?",
                url=self.base_url,
                endpoint=endpoint,
            )
        return str(body["weight_version"])

    async def weights_checksums(self, *, timeout: float | None = _UNSET) -> dict[str, str]:
        """``POST /weights_checker {"action": "checksum"}``: the checksum of every tensor the engine serves
        (``relax.weights.digest`` says what they are of). An admin route.

        Raises :class:`WeightsUncheckable` when the engine cannot answer the question (no such route, no checksum
        action, more than one tensor-parallel rank), and ``EngineError`` when it did not answer at all.
        """
        endpoint = "/weights_checker"
        try:
            body = await self._post_json(endpoint, {"action": "checksum"}, timeout=timeout)
        except EngineError as exc:
            if exc.status_code in (400, 404, 405):
                raise WeightsUncheckable(f"{self.base_url} cannot report weight checksums: {exc}", url=self.base_url,
                                         endpoint=endpoint, status_code=exc.status_code) from exc
            raise
        ranks = body.get("ranks") if isinstance(body, dict) else None
        if not ranks or not isinstance(ranks[0], dict) or not isinstance(ranks[0].get("checksums"), dict):
            raise WeightsUncheckable(f"{self.base_url} answered /weights_checker without per-tensor checksums: "
                                     f"{body!r:.200}", url=self.base_url, endpoint=endpoint)
        if len(ranks) > 1:
            raise WeightsUncheckable(f"{self.base_url} serves with {len(ranks)} ranks; weight verification covers "
                                     "one (tensor parallelism 1)", url=self.base_url, endpoint=endpoint)
        return {str(k): str(v) for k, v in ranks[0]["checksums"].items()}
