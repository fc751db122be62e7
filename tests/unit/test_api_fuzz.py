"""The control plane's HTTP API under fuzzing: no 5xx on malformed input, and answers that match ``/openapi.json``.

The app is the real one: :class:`~relax.rollout.control.server.ControlPlane` (``create_app`` served by uvicorn
on 127.0.0.1, port picked by the OS) over :class:`~relax.testing.local_rollout.LocalRollout` (the real scale
request registry, engine pool and event log with simulated engines), with the real autoscaler router over an
:class:`~relax.autoscaler.service.AutoscalerService` mounted under ``/autoscaler``. Nothing leaves 127.0.0.1.

Two layers:

* **schemathesis**, schema loaded from the served ``/openapi.json``: for every operation, ``MAX_EXAMPLES``
  positive cases and (where there is an input to break) ``MAX_EXAMPLES`` negative ones, each sent and
  checked with schemathesis' checks: not a server error, status code / content type / body / headers
  conform to the schema, invalid input rejected. Two checks are left out, because what they flag are not
  bugs: ``positive_data_acceptance`` (a schema-valid request must get a 2xx) fails on the contract's rules
  that JSON Schema cannot say: ``num_replicas`` XOR ``engine_urls``, the status names of
  ``status_filter``/``?status=``, ``max_engines``, one scale operation at a time (409), unknown ids (404);
  ``unsupported_method`` fails on Starlette's 405, whose ``Allow`` header names only the methods of the first
  route on the path (``OPTIONS /rollout/scale_in`` says ``POST``, not ``GET, POST``).
* **hypothesis, the negative space schemathesis does not reach**: arbitrary JSON (recursive, wrong types,
  integers beyond int64, NaN/Infinity tokens, lone surrogates, unknown fields), pathological JSON (deep
  nesting, 5000-digit numbers) and non-JSON bytes under several content types, sent to every POST/PATCH
  route: the status is < 500 and every 4xx is a JSON object with a ``detail`` and, for an input error
  (400/415/422) on a route that reads a body, the ``field`` to fix.

Both are derandomized (the same examples on every run) and bounded: about 1200 requests, 10-15 s on 2 cores.
Bugs they found have a regression example at the end.

The schemathesis cases come from each operation's ``as_strategy`` (its fuzzing phase) under our own
``@given``, not from ``schemathesis.pytest.from_fixture(...).parametrize()``: that lazy loader fails on
pytest 9 (it sets ``request.node._nodeid``, which pytest 9 nodes no longer have).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance, unsupported_method

from relax.autoscaler.config import AutoscalerConfig
from relax.autoscaler.routes import autoscaler_router
from relax.autoscaler.service import AutoscalerService
from relax.rollout.control.api import create_app
from relax.rollout.control.server import ControlPlane
from relax.testing.local_rollout import LocalRollout
from tests.local_manager import LocalManager

MAX_EXAMPLES = 25
"""Cases per operation and generation mode (schemathesis layer)."""
NEGATIVE_SPACE_EXAMPLES = 100
"""Payloads per POST/PATCH route (hypothesis layer)."""
HOST = "127.0.0.1"
UNKNOWN_REQUEST_ID = "so-999999"
"""Fills ``{request_id}`` in the negative-space layer: the answer must not depend on the (ignored) body."""

FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
EXCLUDED_CHECKS = [positive_data_acceptance, unsupported_method]


# -- the served app --------------------------------------------------------------------------------------


def autoscaler_config() -> AutoscalerConfig:
    return AutoscalerConfig.model_validate({"enabled": False, "min_engines": 2, "max_engines": 8})


class ServedControlPlane:
    """The control plane on its own event loop in a background thread, as the ControlPlane actor runs it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-control-plane", daemon=True)
        self.url = ""

    def __enter__(self) -> ServedControlPlane:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=60)
        return self

    async def _start(self) -> str:
        # Built on the serving loop: LocalRollout's simulated work must run there.
        self.backend = LocalRollout(2, max_engines=8)
        self.service = AutoscalerService(autoscaler_config(), LocalManager(self.backend), scrape_timeout=1.0)
        await self.service.step()  # one scrape and evaluation, so /autoscaler/status has pool facts to show
        self.plane = ControlPlane(self.backend, HOST, 0, None, autoscaler=autoscaler_router(self.service))
        return await self.plane.start()

    async def _stop(self) -> None:
        await self.plane.stop()
        await self.backend.aclose()

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


@pytest.fixture(scope="module")
def served() -> Iterator[ServedControlPlane]:
    with ServedControlPlane() as plane:
        assert plane.url.startswith(f"http://{HOST}:")
        yield plane


@pytest.fixture(scope="module")
def http(served: ServedControlPlane) -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.trust_env = False  # never a proxy from the environment: 127.0.0.1 only
        yield session


@pytest.fixture(scope="module")
def api_schema(served: ServedControlPlane) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json", timeout=30)


# -- the operations, known at collection time ---------------------------------------------------------------


def _openapi() -> dict[str, Any]:
    """The schema of an app built by the same factories (the served one is checked to be the same)."""
    local = LocalRollout(0)
    service = AutoscalerService(autoscaler_config(), LocalManager(local))
    return create_app(local, token=None, autoscaler=autoscaler_router(service)).openapi()


OPENAPI = _openapi()
OPERATIONS = sorted(
    (method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item if method != "parameters"
)


def _constrains_input(operation: dict[str, Any]) -> bool:
    """Whether some input can break the schema (``PATCH /autoscaler/config`` takes any JSON: nothing to negate)."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    return bool(operation.get("parameters")) or bool(set(body) - {"title", "description"})


NEGATABLE = sorted(
    (method.upper(), path)
    for path, item in OPENAPI["paths"].items()
    for method, operation in item.items()
    if _constrains_input(operation)
)
BODY_ROUTES = [(method, path) for method, path in OPERATIONS if method in ("POST", "PATCH")]
BODYLESS_POSTS = frozenset({"/rollout/scale_out/{request_id}/cancel", "/rollout/engines/{engine_id}/verify"})
"""The POST routes that read no body (an id in the path is all they take)."""
EXAMPLES_RUN: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_examples() -> Iterator[None]:
    yield
    total = sum(EXAMPLES_RUN.values())
    print(f"\nfuzzed {total} requests: " + ", ".join(f"{label}: {n}" for label, n in sorted(EXAMPLES_RUN.items())))


def test_the_served_schema_is_the_one_fuzzed(http: requests.Session, served: ServedControlPlane) -> None:
    served_schema = http.get(f"{served.url}/openapi.json", timeout=30).json()
    assert served_schema == OPENAPI
    assert {"/rollout/scale_out", "/autoscaler/config", "/autoscaler/enable", "/metrics"} <= set(OPENAPI["paths"])
    assert len(OPERATIONS) >= 19


def test_every_error_answer_is_documented_as_error_response() -> None:
    """The app answers every 4xx with ErrorResponse; FastAPI's own HTTPValidationError must not be documented."""
    assert "HTTPValidationError" not in json.dumps(OPENAPI)
    for method, path in OPERATIONS:
        operation = OPENAPI["paths"][path][method.lower()]
        expected = {"400", "415", "422"} if "requestBody" in operation else set()
        assert expected <= set(operation["responses"]), (method, path)
        for code, answer in operation["responses"].items():
            if code.startswith("4"):
                assert answer["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse"), (path, code)


# -- layer 1: schemathesis -------------------------------------------------------------------------------


def _fuzz_cases(
    mode: schemathesis.GenerationMode,
    method: str,
    path: str,
    api_schema: schemathesis.BaseSchema,
    http: requests.Session,
) -> None:
    operation = api_schema[path][method]
    label = f"{method} {path} {mode.value}"

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        EXAMPLES_RUN[label] += 1
        response = case.call_and_validate(session=http, excluded_checks=EXCLUDED_CHECKS, timeout=30)
        assert response.status_code < 500, response.text

    check()
    assert EXAMPLES_RUN[label] >= 1


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_schemathesis_positive(
    method: str, path: str, api_schema: schemathesis.BaseSchema, http: requests.Session
) -> None:
    _fuzz_cases(schemathesis.GenerationMode.POSITIVE, method, path, api_schema, http)


@pytest.mark.parametrize(("method", "path"), NEGATABLE, ids=[f"{m} {p}" for m, p in NEGATABLE])
def test_schemathesis_negative(
    method: str, path: str, api_schema: schemathesis.BaseSchema, http: requests.Session
) -> None:
    _fuzz_cases(schemathesis.GenerationMode.NEGATIVE, method, path, api_schema, http)


# -- layer 2: the negative space -------------------------------------------------------------------------

ANY_CHAR = st.characters(exclude_categories=())  # surrogates included: JSON text can carry "\ud800"
KEYS = st.text(ANY_CHAR, max_size=12)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([2**63, -(2**63) - 1, 10**300, 0, -1, 1024, 1025]),
    st.floats(allow_nan=True, allow_infinity=True),  # NaN and +-Infinity become the tokens json.loads accepts
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(ANY_CHAR, max_size=40))
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "application/merge-patch+json",
        "multipart/form-data; boundary=x",
    ]
)


def _body_fields(method: str, path: str) -> list[str]:
    """The field names of the route's body (followed through ``$ref``), to put wrong values under real names."""
    body = OPENAPI["paths"][path][method.lower()].get("requestBody", {})
    schema = body.get("content", {}).get("application/json", {}).get("schema", {})
    for option in [schema, *schema.get("anyOf", [])]:
        ref = option.get("$ref", "")
        if ref:
            return list(OPENAPI["components"]["schemas"][ref.rsplit("/", 1)[-1]].get("properties", {}))
    if path == "/autoscaler/config":  # an open body: the config's own keys, nested ones included
        return list(autoscaler_config().model_dump()) + ["scale_out_policy.max_delta"]
    return []


def _nest(fields: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}`` (one level: the config's blocks)."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        outer, dot, inner = key.partition(".")
        out[outer] = {inner: value} if dot else value
    return out


def _deep(depth: int, array: bool) -> str:
    return "[" * depth + "]" * depth if array else '{"a":' * depth + "1" + "}" * depth


def _payloads(method: str, path: str) -> st.SearchStrategy[tuple[bytes, str | None]]:
    """``(raw body, content type)``: JSON of any shape, JSON shaped like the body with wrong values, or junk."""
    names = _body_fields(method, path)
    name = st.one_of(st.sampled_from(names), KEYS) if names else KEYS
    shaped = st.dictionaries(name, JSON_VALUES, min_size=1, max_size=5).map(_nest)
    as_json = st.one_of(JSON_VALUES, shaped).map(lambda value: json.dumps(value).encode())
    deep = st.builds(_deep, st.integers(1, 5000), st.booleans())
    huge = st.builds(lambda key, digits: json.dumps({key: 0}).replace("0", "9" * digits), name, st.integers(4290, 6000))
    junk = st.binary(max_size=64)
    return st.tuples(st.one_of(as_json, st.one_of(deep, huge).map(str.encode), junk), CONTENT_TYPES)


def _check_answer(method: str, path: str, response: requests.Response, sent: bytes, content_type: str | None) -> None:
    shown = f"{method} {path} Content-Type={content_type!r} body={sent[:120]!r}"
    assert response.status_code < 500, f"{shown} -> {response.status_code} {response.text[:300]}"
    if path in BODYLESS_POSTS:  # no body: whatever is sent, the unknown id is what is wrong
        assert response.status_code == 404, f"{shown} -> {response.status_code} {response.text[:300]}"
    if response.status_code < 400:
        assert response.headers["content-type"].startswith("application/json"), shown
        return
    answer = response.json()
    assert isinstance(answer, dict) and isinstance(answer.get("detail"), str) and answer["detail"], (shown, answer)
    assert "field" in answer, (shown, answer)
    if response.status_code in (400, 415, 422) and path not in BODYLESS_POSTS and not _whole_body_refused(path, answer):
        # A string; empty only when that is the name sent ({"": 1} is an unknown field named "").
        assert isinstance(answer["field"], str) and (answer["field"] or b'""' in sent), (shown, answer)


def _whole_body_refused(path: str, answer: dict[str, Any]) -> bool:
    """``PATCH /autoscaler/config`` with a body that is no JSON object names no field (``field: null``, as
    ``test_autoscaler_service`` pins it): the detail says the whole patch must be a mapping."""
    return path == "/autoscaler/config" and answer["field"] is None and "must be a mapping" in answer["detail"]


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
def test_malformed_bodies_are_4xx_naming_the_field(
    method: str, path: str, served: ServedControlPlane, http: requests.Session
) -> None:
    url = served.url + path.replace("{request_id}", UNKNOWN_REQUEST_ID)
    label = f"{method} {path} negative space"

    @settings(FUZZ_SETTINGS, max_examples=NEGATIVE_SPACE_EXAMPLES)
    @given(payload=_payloads(method, path))
    def check(payload: tuple[bytes, str | None]) -> None:
        EXAMPLES_RUN[label] += 1
        sent, content_type = payload
        headers = {"Content-Type": content_type} if content_type else {}
        response = http.request(method, url, data=sent, headers=headers, timeout=30)
        _check_answer(method, path, response, sent, content_type)

    check()
    assert EXAMPLES_RUN[label] >= NEGATIVE_SPACE_EXAMPLES // 2


# -- regressions: what the fuzzing found -------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"\\ud800x": 1}',  # the unknown key came back raw in "field": UnicodeEncodeError, 500
        b'{"scale_out_policy": {"\\udfff": 1}}',
        b'{"rollout_service_url": "http://a\\ud800"}',  # accepted, then every GET /config was a 500 too
    ],
)
def test_config_patch_with_lone_surrogates_is_not_a_500(
    body: bytes, served: ServedControlPlane, http: requests.Session
) -> None:
    before = http.get(f"{served.url}/autoscaler/config", timeout=30).json()
    try:
        answer = http.patch(
            f"{served.url}/autoscaler/config", data=body, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert answer.status_code in (200, 400), answer.text
        assert answer.content.isascii() and isinstance(answer.json(), dict)
        assert http.get(f"{served.url}/autoscaler/config", timeout=30).status_code == 200
    finally:
        http.patch(f"{served.url}/autoscaler/config", json=before, timeout=30)


@pytest.mark.parametrize(
    ("method", "path"), [op for op in BODY_ROUTES if op[1] not in BODYLESS_POSTS], ids=lambda value: str(value)
)
@pytest.mark.parametrize("body", [b'{"num_replicas": ' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000])
def test_a_body_json_cannot_decode_is_a_400_naming_the_body(
    method: str, path: str, body: bytes, served: ServedControlPlane, http: requests.Session
) -> None:
    """FastAPI answered a bare ``{"detail": "There was an error parsing the body"}`` (no field, no reason)."""
    answer = http.request(method, served.url + path, data=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["field"] == "body" and answer.json()["detail"].startswith("body: invalid JSON: ")
