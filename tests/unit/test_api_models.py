"""Scaling REST bodies: strict shapes, URL rules, one-line messages naming the field, errors to HTTP.

(docs/architecture.md, "Scale requests".)
"""

from __future__ import annotations

import json
import pickle

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from relax.rollout.control.api_models import (
    DEFAULT_MODEL,
    MAX_REPLICAS,
    CancelBatchBody,
    EngineDetailView,
    EnginesResponse,
    ErrorResponse,
    InvalidBody,
    RequestError,
    ScaleInBody,
    ScaleOutBody,
    describe_validation_error,
    error_body,
    http_status_of,
    normalize_engine_url,
    parse_body,
)
from relax.rollout.control.backend import RolloutControl
from relax.rollout.pool.engine_url import normalize_engine_url as pure_normalize_engine_url
from relax.rollout.pool.engines import EngineKind, EnginePool, EngineState
from relax.rollout.pool.events import EventLog
from relax.rollout.scaling import (
    IllegalRequestTransition,
    NotCancellable,
    RejectedRequest,
    ScaleConflict,
    ScaleInSpec,
    ScaleOutSpec,
    ScaleOutStatus,
    ScalingError,
    UnknownModel,
    UnknownRequest,
)


def _message(model, data) -> str:
    with pytest.raises(InvalidBody) as info:
        parse_body(model, data)
    assert info.value.http_status == 422 and http_status_of(info.value) == 422
    return info.value.message


# -- valid bodies -------------------------------------------------------------------------------------


def test_scale_out_defaults_and_absolute_target() -> None:
    body = ScaleOutBody(num_replicas=6)
    assert body.model_name == DEFAULT_MODEL
    assert body.engine_urls == []
    assert body.timeout_secs is None


def test_scale_out_urls_are_canonical_and_deduplicated_in_order() -> None:
    body = parse_body(
        ScaleOutBody,
        {
            "engine_urls": [
                "http://10.0.0.2:30000",
                "HTTP://Node-B:30001/",
                "http://10.0.0.2:30000/",
                "http://node-b:30001",
            ]
        },
    )
    assert body.engine_urls == ["http://10.0.0.2:30000", "http://node-b:30001"]


def test_scale_in_defaults() -> None:
    body = ScaleInBody(num_replicas=4)
    assert (body.force, body.dry_run, body.timeout_secs, body.engine_urls) == (False, False, None, [])


def test_timeout_accepts_an_integer_number_of_seconds() -> None:
    assert parse_body(ScaleOutBody, '{"num_replicas": 5, "timeout_secs": 30}').timeout_secs == 30.0


def test_cancel_batch_body_defaults() -> None:
    body = CancelBatchBody()
    assert body.status_filter is None and body.dry_run is False
    assert CancelBatchBody(status_filter=["PENDING"], dry_run=True).status_filter == ["PENDING"]


def test_parse_body_accepts_json_text_bytes_and_instances() -> None:
    body = ScaleOutBody(num_replicas=5)
    assert parse_body(ScaleOutBody, body) is body
    assert parse_body(ScaleOutBody, b'{"num_replicas": 5}') == body
    assert parse_body(ScaleOutBody, json.dumps({"num_replicas": 5})) == body


def test_bodies_are_frozen() -> None:
    body = ScaleOutBody(num_replicas=5)
    with pytest.raises(ValidationError):
        body.num_replicas = 7


# -- malformed bodies: every one is named -------------------------------------------------------------------

OUT_BAD = [
    ({"num_replicas": "6"}, "num_replicas: expected an integer, got str '6'"),
    ({"num_replicas": 6.0}, "num_replicas: expected an integer, got float 6.0"),
    ({"num_replicas": True}, "num_replicas: expected an integer, got bool True"),
    ({"num_replicas": None}, "num_replicas: expected an integer"),
    ({"num_replicas": -1}, "num_replicas: input should be greater than or equal to 0 (got -1)"),
    ({"num_replicas": MAX_REPLICAS + 1}, f"num_replicas: input should be less than or equal to {MAX_REPLICAS}"),
    ({"num_replicas": 5, "timeout_secs": "30"}, "timeout_secs: expected a number, got str '30'"),
    ({"num_replicas": 5, "timeout_secs": 0}, "timeout_secs: input should be greater than 0 (got 0)"),
    ({"num_replicas": 5, "timeout_secs": -5.5}, "timeout_secs: input should be greater than 0"),
    ({"num_replicas": 5, "timeout_secs": float("nan")}, "timeout_secs: input should be a finite number"),
    ({"num_replicas": 5, "timeout_secs": True}, "timeout_secs: expected a number, got bool True"),
    ({"num_replicas": 5, "model_name": 3}, "model_name: expected a string, got int 3"),
    ({"num_replicas": 5, "model_name": ""}, "model_name: string should have at least 1 character (got '')"),
    ({"num_replicas": 5, "replicas": 6}, "replicas: unknown field (allowed: model_name, num_replicas, engine_urls"),
    ({"num_replicas": 5, "force": True}, "force: unknown field"),
    ({"engine_urls": "http://a:1"}, "engine_urls: expected a list, got str 'http://a:1'"),
    ({"engine_urls": [1]}, "engine_urls.0: expected a string, got int 1"),
    ({"engine_urls": ["http://a:1", "ftp://b:2"]}, "engine_urls.1: engine URL 'ftp://b:2' must use http or https"),
    ({"engine_urls": ["a:30000"]}, "engine_urls.0: engine URL 'a:30000' must use http or https (missing 'http://'?)"),
    ({"engine_urls": ["http://a"]}, "engine_urls.0: engine URL 'http://a' needs an explicit port"),
    ({"engine_urls": ["http://a:1/generate"]}, "engine_urls.0: engine URL 'http://a:1/generate' must be a base URL"),
    ({"engine_urls": ["http://a:1?x=1"]}, "engine_urls.0: engine URL 'http://a:1?x=1' must be a base URL"),
    ({"engine_urls": ["http://u:pw@a:1"]}, "engine_urls.0: engine URL 'http://u:pw@a:1' must not contain user info"),
    ({"engine_urls": ["http://a:99999"]}, "engine_urls.0: engine URL 'http://a:99999' has an invalid port"),
    ({"engine_urls": ["http://a b:1"]}, "engine_urls.0: engine URL 'http://a b:1' contains whitespace"),
    ({"engine_urls": ["http://-a:1"]}, "engine_urls.0: engine URL 'http://-a:1' has an invalid host"),
    ({"engine_urls": [""]}, "engine_urls.0: engine URL is empty"),
    ({"num_replicas": 6, "engine_urls": ["http://a:1"]}, "engine_urls: give either num_replicas"),
    ({}, "engine_urls: nothing to scale out: give num_replicas > 0"),
    ({"num_replicas": 0, "engine_urls": []}, "engine_urls: nothing to scale out"),
    ([6], "body: expected a JSON object, got list [6]"),
]


@pytest.mark.parametrize(("data", "expected"), OUT_BAD, ids=[str(i) for i in range(len(OUT_BAD))])
def test_malformed_scale_out_bodies_name_the_field(data, expected: str) -> None:
    assert expected in _message(ScaleOutBody, data)


IN_BAD = [
    ({"num_replicas": 4, "force": "yes"}, "force: expected true or false, got str 'yes'"),
    ({"num_replicas": 4, "force": 1}, "force: expected true or false, got int 1"),
    ({"num_replicas": 4, "dry_run": "true"}, "dry_run: expected true or false"),
    ({"num_replicas": -3}, "num_replicas: input should be greater than or equal to 0 (got -3)"),
    ({"num_replicas": "4"}, "num_replicas: expected an integer"),
    ({"num_replicas": 4, "drain": True}, "drain: unknown field (allowed: model_name, num_replicas, engine_urls, force"),
    ({"engine_urls": ["https://x:1/path"]}, "engine_urls.0: engine URL 'https://x:1/path' must be a base URL"),
    ({}, "engine_urls: nothing to scale in: give num_replicas > 0"),
    ({"num_replicas": 4, "engine_urls": ["http://x:1"]}, "engine_urls: give either num_replicas"),
]


@pytest.mark.parametrize(("data", "expected"), IN_BAD, ids=[str(i) for i in range(len(IN_BAD))])
def test_malformed_scale_in_bodies_name_the_field(data, expected: str) -> None:
    assert expected in _message(ScaleInBody, data)


CANCEL_BAD = [
    ({"status_filter": "PENDING"}, "status_filter: expected a list, got str 'PENDING'"),
    ({"status_filter": [3]}, "status_filter.0: expected a string, got int 3"),
    ({"status_filter": [""]}, "status_filter.0: string should have at least 1 character"),
    ({"dry_run": "no"}, "dry_run: expected true or false"),
    ({"status": ["PENDING"]}, "status: unknown field (allowed: status_filter, dry_run)"),
]


@pytest.mark.parametrize(("data", "expected"), CANCEL_BAD, ids=[str(i) for i in range(len(CANCEL_BAD))])
def test_malformed_cancel_bodies_name_the_field(data, expected: str) -> None:
    assert expected in _message(CancelBatchBody, data)


def test_several_problems_are_joined_on_one_line() -> None:
    message = _message(ScaleInBody, {"num_replicas": -1, "force": "x", "colour": "red"})
    parts = message.split("; ")
    assert len(parts) == 3
    assert {p.split(":")[0] for p in parts} == {"num_replicas", "force", "colour"}
    assert "\n" not in message


def test_invalid_body_carries_structured_errors_and_survives_pickle() -> None:
    with pytest.raises(InvalidBody) as info:
        parse_body(ScaleOutBody, {"num_replicas": "x"})
    err = info.value
    assert err.field == "num_replicas"
    assert err.to_dict()["errors"] == [{"field": "num_replicas", "problem": "expected an integer, got str 'x'"}]
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, InvalidBody)
    assert (clone.message, clone.field, clone.http_status, clone.errors) == (err.message, err.field, 422, err.errors)


def test_describe_validation_error_reads_fastapi_errors_without_the_body_prefix() -> None:
    exc = RequestValidationError(
        [
            {
                "type": "int_type",
                "loc": ("body", "num_replicas"),
                "msg": "Input should be a valid integer",
                "input": "6",
            },
            {
                "type": "int_type",
                "loc": ("body", "num_replicas"),
                "msg": "Input should be a valid integer",
                "input": "6",
            },
            {"type": "missing", "loc": ("query", "limit"), "msg": "Field required"},
            {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"},
        ]
    )
    assert describe_validation_error(exc) == (
        "num_replicas: expected an integer, got str '6'; limit: field required; body: JSON decode error"
    )


def test_describe_validation_error_for_fastapi_body_problems() -> None:
    bad_json = RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]
    )
    assert describe_validation_error(bad_json) == "body: invalid JSON: Expecting value"
    no_body = RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    assert describe_validation_error(no_body) == "body: a JSON object body is required"
    extra = RequestValidationError([{"type": "extra_forbidden", "loc": ("body", "dry"), "msg": "x", "input": 1}])
    assert describe_validation_error(extra, ScaleInBody).startswith("dry: unknown field (allowed: model_name,")
    assert describe_validation_error(extra) == "dry: unknown field"


def test_describe_validation_error_strips_pydantic_value_error_prefix() -> None:
    with pytest.raises(ValidationError) as info:
        ScaleOutBody.model_validate({"engine_urls": ["ftp://h:1"]})
    text = describe_validation_error(info.value)
    assert text.startswith("engine_urls.0: engine URL 'ftp://h:1'")
    assert "Value error" not in text


def test_bodies_become_specs() -> None:
    assert ScaleOutBody(num_replicas=6, timeout_secs=30).to_spec() == ScaleOutSpec(num_replicas=6, timeout_secs=30.0)
    out = parse_body(ScaleOutBody, {"engine_urls": ["HTTP://B:1/", "http://a:2", "http://b:1"], "model_name": "m"})
    assert out.to_spec() == ScaleOutSpec(engine_urls=("http://b:1", "http://a:2"), model_name="m")
    body = ScaleInBody(num_replicas=4, force=True, dry_run=True, timeout_secs=5)
    assert body.to_spec() == ScaleInSpec(num_replicas=4, force=True, dry_run=True, timeout_secs=5.0)
    assert ScaleInBody(engine_urls=["http://x:1"]).to_spec() == ScaleInSpec(engine_urls=("http://x:1",))
    assert ScaleInBody(engine_urls=["http://x:1"]).to_spec().num_replicas is None


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (UnknownModel("qwen"), 404),
        (UnknownRequest("so-1"), 404),
        (ScaleConflict("so-1", "CREATING", "scale_out"), 409),
        (NotCancellable("so-1", "FAILED"), 400),
        (RejectedRequest("no", code="below_initial"), 400),
        (ScalingError("no"), 400),
        (InvalidBody("bad"), 422),
        (RequestError("bad"), 400),
        (RequestError("gone", http_status=410), 410),
        (IllegalRequestTransition("so-1", ScaleOutStatus.PENDING, ScaleOutStatus.ACTIVE), None),
        (ValueError("bug"), None),
        (KeyError("bug"), None),
    ],
)
def test_http_status_of_is_the_one_mapping_from_error_types(error: BaseException, status: int | None) -> None:
    assert http_status_of(error) == status


def test_error_body_is_the_errors_json() -> None:
    conflict = ScaleConflict("so-1", "CREATING", "scale_out")
    assert error_body(conflict) == conflict.to_dict()
    assert error_body(conflict)["running_request_id"] == "so-1"
    assert ErrorResponse(**error_body(conflict)).running_request_id == "so-1"
    assert error_body(UnknownModel("x")) == {"detail": UnknownModel("x").message, "field": "model_name"}
    assert error_body(InvalidBody("bad", errors=[{"field": "f", "problem": "p"}]))["errors"] == [
        {"field": "f", "problem": "p"}
    ]
    assert error_body(ValueError("oops")) == {"detail": "oops", "field": None}


def test_request_error_defaults_and_to_dict() -> None:
    err = RequestError("num_replicas: too big", field="num_replicas")
    assert err.http_status == 400
    assert err.to_dict() == {"detail": "num_replicas: too big", "field": "num_replicas"}
    assert ErrorResponse(**err.to_dict()).detail == "num_replicas: too big"
    assert RequestError("x", http_status=404).http_status == 404


# -- URLs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("http://10.0.0.5:30000", "http://10.0.0.5:30000"),
        (" HTTPS://Engine-3.Cluster.Local:443/ ", "https://engine-3.cluster.local:443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://[FE80::1]:8000/", "http://[fe80::1]:8000"),
        ("http://node_1:5", "http://node_1:5"),
    ],
)
def test_normalize_engine_url(url: str, canonical: str) -> None:
    assert normalize_engine_url(url) == canonical
    assert pure_normalize_engine_url is normalize_engine_url  # one definition, re-exported by the REST layer


@pytest.mark.parametrize(
    "url", ["", "ftp://a:1", "http://a", "http://a:0", "http://a:1/x", "http://a:1#f", "http://u@a:1", "http://[zz]:1"]
)
def test_normalize_engine_url_rejects(url: str) -> None:
    with pytest.raises(ValueError, match="engine URL"):
        normalize_engine_url(url)


# -- responses ------------------------------------------------------------------------------------------


async def test_the_engines_view_is_an_engines_response() -> None:
    """What ``GET /rollout/engines`` answers (``RolloutControl.engines_view``) fits its response model; a failed
    engine is left out of it, and still answers on its own (``engine_view``)."""
    pool = EnginePool(lambda: 1.0)
    a = pool.add(EngineKind.INITIAL, url="http://a:1", node_id="n1")
    for state in (EngineState.STARTING, EngineState.HEALTH_CHECKING, EngineState.WEIGHT_SYNCING):
        pool.transition(a.engine_id, state)
    pool.set_weight_version(a.engine_id, 3, "ab" * 32, verified=True)
    pool.transition(a.engine_id, EngineState.ACTIVE)
    pool.add(EngineKind.ELASTIC)  # pending
    gone = pool.add(EngineKind.ELASTIC)
    pool.transition(gone.engine_id, EngineState.FAILED)

    control = RolloutControl(pool, None, EventLog())  # type: ignore[arg-type]  # the views read the pool only
    view = EnginesResponse.model_validate(await control.engines_view())
    assert view.total_engines == 2 and view.active_engines == 1
    engines = view.models[DEFAULT_MODEL].engines
    assert [e.engine_id for e in engines] == ["engine_0", "engine_1"]
    assert engines[0].model_dump() == {
        "engine_id": "engine_0",
        "url": "http://a:1",
        "kind": "initial",
        "status": "ACTIVE",
        "weight_version": 3,
        "weight_digest": "ab" * 32,
        "weights_verified": True,
        "in_flight": 0,
        "node_id": "n1",
        "join_active_s": None,  # the fleet's join measures; records alone do not have them
        "join_first_answer_s": None,
        "bring_up": None,  # likewise the fleet's bring-up log
    }
    assert engines[1].status == "PENDING"
    assert EngineDetailView.model_validate(await control.engine_view(gone.engine_id)).status == "FAILED"
