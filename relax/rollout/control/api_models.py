"""Request and response bodies of the elastic-scaling REST contract, and the mapping of errors to HTTP.

(docs/architecture.md, "Scale requests".) The bodies are strict on purpose: a scale request moves GPUs, so
``"num_replicas": "6"``, ``true``, ``-1``, a typo'd field name or an engine URL with a path is rejected with a
message naming the field, instead of being coerced into something the operator did not ask for. A valid body
becomes a spec (:meth:`ScaleOutBody.to_spec`, :meth:`ScaleInBody.to_spec`) for :mod:`relax.rollout.scaling`,
where the rules that need the pool live (absolute targets, the initial-engine floor, unknown models).

Scaling raises domain errors that know nothing about HTTP; :func:`http_status_of` is *the* mapping from an
error type to the status a route answers, and :func:`error_body` the JSON it answers with. Nothing here knows
about Ray, the pool or the HTTP server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from relax.rollout.pool.engine_url import normalize_engine_url
from relax.rollout.scaling import (
    DEFAULT_MODEL,
    NoSuchEngine,
    NotCancellable,
    RejectedRequest,
    ScaleConflict,
    ScaleInSpec,
    ScaleOutSpec,
    ScalingError,
    UnknownModel,
    UnknownRequest,
)

__all__ = [
    "DEFAULT_MODEL",
    "MAX_REPLICAS",
    "CancelBatchBody",
    "CancelBatchResponse",
    "EngineView",
    "EnginesResponse",
    "ErrorResponse",
    "InvalidBody",
    "ModelEngines",
    "RequestError",
    "ScaleAccepted",
    "ScaleInBody",
    "ScaleInDryRun",
    "ScaleInRequestView",
    "ScaleNoop",
    "ScaleOutBody",
    "ScaleOutRequestView",
    "describe_validation_error",
    "error_body",
    "http_status_of",
    "normalize_engine_url",
    "parse_body",
]

MAX_REPLICAS = 1024
"""Sanity ceiling on ``num_replicas`` and on the number of URLs in one request.

Without it, ``num_replicas: 1000000000`` with no autoscaler bound would ask Ray for a billion placement
groups. The real bound (``max_engines``) is applied by the planner when the autoscaler config is known.
"""


# -- errors ------------------------------------------------------------------------------------------


def _rebuild_error(cls: type[RequestError], state: dict[str, Any]) -> RequestError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error


class RequestError(Exception):
    """A REST-layer client error: the HTTP status the route answers and a message that says what to fix.

    Scaling rule violations are not ``RequestError`` s: they are :class:`~relax.rollout.scaling.ScalingError`
    s, mapped to a status by :func:`http_status_of`. ``field`` names the offending body field when there is one.
    """

    default_status: ClassVar[int] = 400

    def __init__(self, message: str, *, field: str | None = None, http_status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.http_status = http_status if http_status is not None else type(self).default_status

    def to_dict(self) -> dict[str, Any]:
        """The JSON error body (see :class:`ErrorResponse`)."""
        return {"detail": self.message, "field": self.field}

    def __reduce__(self):  # keep every attribute across a Ray / pickle boundary
        return (_rebuild_error, (type(self), dict(self.__dict__)))


class InvalidBody(RequestError):
    """The body does not have the contract's shape (wrong type, unknown field, bad URL...): HTTP 422."""

    default_status = 422

    def __init__(self, message: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message, field=errors[0].get("field") if errors else None)
        self.errors = errors or []

    def to_dict(self) -> dict[str, Any]:
        return {"detail": self.message, "field": self.field, "errors": self.errors}


_SCALING_STATUS: tuple[tuple[type[ScalingError], int], ...] = (
    (UnknownModel, 404),
    (UnknownRequest, 404),
    (NoSuchEngine, 404),
    (ScaleConflict, 409),
    (NotCancellable, 400),
    (RejectedRequest, 400),
    (ScalingError, 400),
)
"""Scaling error type → HTTP status, most specific first."""


def http_status_of(error: BaseException) -> int | None:
    """The HTTP status a route answers for ``error``; ``None`` when it is not a client error (a bug: 500).

    The one mapping from error types to status codes: unknown model or request id 404, another scale
    operation running 409, any other scaling rule 400, a body of the wrong shape 422, any other
    :class:`RequestError` its own status.
    """
    for cls, status in _SCALING_STATUS:
        if isinstance(error, cls):
            return status
    if isinstance(error, RequestError):
        return error.http_status
    return None


def error_body(error: BaseException) -> dict[str, Any]:
    """The JSON body a route answers for ``error`` (see :class:`ErrorResponse`)."""
    to_dict = getattr(error, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {"detail": str(error) or type(error).__name__, "field": None}


# -- engine URLs (rules in relax.rollout.pool.engine_url) --------------------------------------------------------


def _check_url(url: str) -> str:
    return normalize_engine_url(url)


EngineUrl = Annotated[StrictStr, AfterValidator(_check_url)]


def _dedupe(urls: Iterable[str]) -> list[str]:
    """Keep the first occurrence of each (canonical) URL, in the order given."""
    return list(dict.fromkeys(urls))


# -- request bodies -------------------------------------------------------------------------------------

_STRICT_BODY = ConfigDict(extra="forbid", strict=True, frozen=True)

ModelName = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Replicas = Annotated[StrictInt, Field(ge=0, le=MAX_REPLICAS)]
UrlList = Annotated[list[EngineUrl], Field(max_length=MAX_REPLICAS)]
TimeoutSecs = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _exactly_one_target(urls: list[str], info: ValidationInfo, verb: str) -> list[str]:
    """``num_replicas > 0`` XOR non-empty ``engine_urls``: one request is either a count or a URL list.

    Mixing both would make the absolute target ambiguous (is the URL list part of the count?), and neither
    is a request for nothing, most likely a client that sent the wrong field name.
    """
    urls = _dedupe(urls)
    if "num_replicas" not in info.data:  # num_replicas itself failed validation; that error is enough
        return urls
    replicas = info.data["num_replicas"]
    if replicas > 0 and urls:
        raise ValueError(f"give either num_replicas (an absolute target, got {replicas}) or engine_urls, not both")
    if replicas == 0 and not urls:
        raise ValueError(f"nothing to {verb}: give num_replicas > 0 (absolute total of engines) or engine_urls")
    return urls


class ScaleOutBody(BaseModel):
    """``POST /rollout/scale_out``: grow the pool to ``num_replicas`` engines, or attach ``engine_urls``."""

    model_config = _STRICT_BODY

    model_name: ModelName = DEFAULT_MODEL
    num_replicas: Replicas = 0
    engine_urls: UrlList = Field(default_factory=list, validate_default=True)
    timeout_secs: TimeoutSecs | None = None

    @field_validator("engine_urls", mode="after")
    @classmethod
    def _one_target(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        return _exactly_one_target(urls, info, "scale out")

    def to_spec(self) -> ScaleOutSpec:
        """The validated values, as the scaling planners take them."""
        urls = tuple(self.engine_urls)
        return ScaleOutSpec(
            num_replicas=None if urls else self.num_replicas,
            engine_urls=urls,
            model_name=self.model_name,
            timeout_secs=self.timeout_secs,
        )


class ScaleInBody(BaseModel):
    """``POST /rollout/scale_in``: shrink the pool to ``num_replicas`` engines, or remove ``engine_urls``.

    ``force`` skips waiting for in-flight requests (they are aborted and retried on other engines at once);
    it never lets scale-in touch an initial engine. ``dry_run`` answers with the victims and changes nothing.
    """

    model_config = _STRICT_BODY

    model_name: ModelName = DEFAULT_MODEL
    num_replicas: Replicas = 0
    engine_urls: UrlList = Field(default_factory=list, validate_default=True)
    force: StrictBool = False
    timeout_secs: TimeoutSecs | None = None
    dry_run: StrictBool = False

    @field_validator("engine_urls", mode="after")
    @classmethod
    def _one_target(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        return _exactly_one_target(urls, info, "scale in")

    def to_spec(self) -> ScaleInSpec:
        """The validated values, as the scaling planners take them."""
        urls = tuple(self.engine_urls)
        return ScaleInSpec(
            num_replicas=None if urls else self.num_replicas,
            engine_urls=urls,
            model_name=self.model_name,
            force=self.force,
            timeout_secs=self.timeout_secs,
            dry_run=self.dry_run,
        )


class CancelBatchBody(BaseModel):
    """``POST /rollout/scale_out_cancel``: cancel every running scale-out whose status is in the filter.

    Status names are checked against the scale-out states by the registry (400 naming ``status_filter``).
    """

    model_config = _STRICT_BODY

    status_filter: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=32)] | None = None
    dry_run: StrictBool = False


BodyT = TypeVar("BodyT", bound=BaseModel)

_BODY_MODELS: dict[str, type[BaseModel]] = {m.__name__: m for m in (ScaleOutBody, ScaleInBody, CancelBatchBody)}


def parse_body(model: type[BodyT], data: Any) -> BodyT:
    """Validate ``data`` (a dict, a JSON string or bytes, or an instance) into ``model``.

    Raises :class:`InvalidBody` (422) with :func:`describe_validation_error`'s message. In-process callers
    that start from JSON-like data use it (then ``to_spec()``) to get the same checks and messages as an
    HTTP client.
    """
    if isinstance(data, model):
        return data
    try:
        if isinstance(data, str | bytes | bytearray):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidBody(describe_validation_error(exc), errors=_error_items(exc)) from None


# -- validation messages ----------------------------------------------------------------------------------

_LOC_ROOTS = frozenset({"body", "query", "path", "header", "cookie"})
_STRIP_PREFIXES = ("Value error, ", "Assertion failed, ")
_TYPE_HINTS = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "model_type": "expected a JSON object",
    "dict_type": "expected a JSON object",
    "model_attributes_type": "expected a JSON object",
}

_BOUND_KINDS = frozenset(
    {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
    | {"too_short", "too_long", "string_too_short", "string_too_long"}
)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_name(loc: Iterable[Any]) -> str:
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] in _LOC_ROOTS:  # FastAPI prefixes the location with where it was sent
        parts = parts[1:]
    return ".".join(parts) if parts else "body"


def _problem(err: Mapping[str, Any], allowed: list[str] | None) -> str:
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    for prefix in _STRIP_PREFIXES:
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    has_input = "input" in err
    value = err.get("input")
    if kind == "extra_forbidden":
        return "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error")
        return f"invalid JSON: {detail}" if detail else msg
    if kind == "missing":
        return "field required"
    if kind in _TYPE_HINTS:
        got = f", got {type(value).__name__} {_short_repr(value)}" if has_input else ""
        return f"{_TYPE_HINTS[kind]}{got}"
    if kind in _BOUND_KINDS and has_input:
        return f"{msg[0].lower()}{msg[1:]} (got {_short_repr(value)})"
    return msg


def _error_items(exc: Any, model: type[BaseModel] | None = None) -> list[dict[str, Any]]:
    errors = exc.errors() if hasattr(exc, "errors") else []
    model = model or _BODY_MODELS.get(getattr(exc, "title", ""))
    allowed = list(model.model_fields) if model is not None else None
    items = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        # FastAPI puts the character offset of a JSON syntax error where a field name would be.
        name = "body" if err.get("type") == "json_invalid" else _field_name(loc)
        problem = _problem(err, allowed)
        if name == "body" and err.get("type") == "missing":
            problem = "a JSON object body is required"
        items.append({"field": name, "problem": problem})
    return items


def describe_validation_error(exc: Any, model: type[BaseModel] | None = None) -> str:
    """One line, ``"field: problem; field: problem"``, from a pydantic ``ValidationError``.

    Also accepts FastAPI's ``RequestValidationError`` (anything with ``errors()``), whose locations start
    with ``body``/``query``: that prefix is dropped so the operator sees the field name as they sent it.
    List items are named ``engine_urls.2``. Duplicate lines are folded. ``model`` (the body class) lets an
    unknown field be answered with the allowed ones; pydantic's own errors carry it already.
    """
    items = _error_items(exc, model)
    if not items:
        return str(exc)
    lines = _dedupe(f"{item['field']}: {item['problem']}" for item in items)
    return "; ".join(lines)


# -- responses ------------------------------------------------------------------------------------------

_RESPONSE = ConfigDict(extra="forbid")


class ErrorResponse(BaseModel):
    """Body of every 4xx answer; ``running_request_id`` comes with a 409 (the operation to wait for)."""

    model_config = _RESPONSE

    detail: str
    field: str | None = None
    running_request_id: str | None = None
    errors: list[dict[str, Any]] | None = None


class ScaleAccepted(BaseModel):
    """200 answer to an accepted scale request: poll ``GET /rollout/scale_out/{request_id}``."""

    model_config = _RESPONSE

    request_id: str
    status: str


class ScaleNoop(BaseModel):
    """200 answer when the target is already met (or every URL is already attached / already leaving)."""

    model_config = _RESPONSE

    status: Literal["NOOP"] = "NOOP"
    message: str
    model_name: str
    current_engines: int
    target: int | None = None


class VictimView(BaseModel):
    model_config = _RESPONSE

    engine_id: str
    url: str | None
    kind: str
    in_flight: int


class ScaleInDryRun(BaseModel):
    """200 answer to ``dry_run: true``: what a real scale-in would remove; nothing changed."""

    model_config = _RESPONSE

    status: Literal["DRY_RUN"] = "DRY_RUN"
    dry_run: Literal[True] = True
    model_name: str
    current_engines: int
    target: int | None
    engines_after: int
    victims: list[VictimView]
    force: bool


class TransitionView(BaseModel):
    model_config = _RESPONSE

    status: str
    at: float


class EngineOutcomeView(BaseModel):
    """One engine of a scale-out request: where it got to and how long each phase took (seconds)."""

    model_config = _RESPONSE

    engine_id: str
    url: str | None
    state: str | None
    error: str | None
    placement_wait_s: float | None
    start_s: float | None
    health_s: float | None
    weight_sync_s: float | None
    total_s: float | None


class ScaleOutTimingsView(BaseModel):
    model_config = _RESPONSE

    total_s: float | None
    in_status_s: dict[str, float]
    placement_wait_s: float | None
    start_s: float | None
    health_s: float | None
    weight_sync_s: float | None


class ScaleOutRequestView(BaseModel):
    """A scale-out request record as ``GET /rollout/scale_out[/{id}]`` returns it."""

    model_config = _RESPONSE

    request_id: str
    direction: Literal["scale_out"]
    model_name: str
    kind: Literal["ray_native", "external"]
    status: str
    target: int | None
    urls: list[str]
    engines_before: int
    to_create: int
    timeout_secs: float | None
    engine_ids: list[str]
    engines: list[EngineOutcomeView]
    error: str | None
    cancel_requested: bool
    cancel_requested_at: float | None
    created_at: float
    finished_at: float | None
    transitions: list[TransitionView]
    timings: ScaleOutTimingsView


class VictimOutcomeView(BaseModel):
    model_config = _RESPONSE

    engine_id: str
    url: str | None
    kind: str
    state: str | None
    error: str | None
    aborted_requests: int
    drain_s: float | None
    shutdown_s: float | None


class ScaleInTimingsView(BaseModel):
    model_config = _RESPONSE

    total_s: float | None
    in_status_s: dict[str, float]


class ScaleInRequestView(BaseModel):
    """A scale-in request record as ``GET /rollout/scale_in[/{id}]`` returns it."""

    model_config = _RESPONSE

    request_id: str
    direction: Literal["scale_in"]
    model_name: str
    status: str
    target: int | None
    urls: list[str]
    engines_before: int
    force: bool
    timeout_secs: float | None
    victims: list[VictimOutcomeView]
    error: str | None
    created_at: float
    finished_at: float | None
    transitions: list[TransitionView]
    timings: ScaleInTimingsView


class CancelBatchResponse(BaseModel):
    """Answer of ``POST /rollout/scale_out_cancel``: ids cancelled (or that would be, with ``dry_run``)."""

    model_config = _RESPONSE

    dry_run: bool
    cancelled: list[str]
    skipped: list[dict[str, str]]


class BringUpView(BaseModel):
    """An engine's bring-up: where the seconds from the decision to start it went (docs/elastic.md, "Bring-up
    phases")."""

    model_config = _RESPONSE

    phases: dict[str, float]
    """Finished phases in order, in seconds: capacity, actor, prepare, server_start (or start), first_answer,
    weight_sync, verify."""
    current: str | None
    """The phase it is in now (None once it ended)."""
    current_for_s: float | None
    total_s: float
    """From the decision to now, or to its end."""
    outcome: str | None
    """``ACTIVE``, or why it stopped (``REMOVED: ...`` when it did nothing wrong); None while it runs."""


class EngineView(BaseModel):
    """One engine in ``GET /rollout/engines``; ``status`` is its lifecycle state.

    (docs/architecture.md, "Engine lifecycle".)
    """

    model_config = _RESPONSE

    engine_id: str
    url: str | None
    kind: str
    status: str
    weight_version: int | None
    weight_digest: str | None = None
    """SHA-256 digest of the weights it holds (SGLang's ``per_gpu_checksum`` form), when known."""
    weights_verified: bool = False
    """Its served weights were checked against ``weight_version``'s publication (``--verify-weights``)."""
    in_flight: int
    node_id: str | None
    join_active_s: float | None = None
    """Seconds from the decision to start this engine to ACTIVE on the newest weights."""
    join_first_answer_s: float | None = None
    """Seconds from that decision to its first answer (generated on the current weights); None until then."""
    bring_up: BringUpView | None = None
    """Its bring-up phase by phase (``rollout.fleet.bringup``); None for an engine that was never brought up here."""


class EngineDetailView(EngineView):
    """``GET /rollout/engines/{engine_id}``: one engine, live or recently gone."""

    created_at: float
    last_error: str | None
    transitions: list[TransitionView]


class WeightVerificationView(BaseModel):
    """``POST /rollout/engines/{engine_id}/verify``: one check of an engine's served weights
    (``relax.rollout.refit.rules.Verification``)."""

    model_config = _RESPONSE

    engine_id: str
    version: int
    result: str
    """``verified``, ``mismatch`` (still after one full reload: the engine is failed) or ``uncheckable``."""
    expected_digest: str
    served_digest: str | None
    mismatched: list[str]
    """Tensor names whose checksum differs (the first 20)."""
    seconds: float
    attempt: int
    """0: the first check; 1: the check after one full reload of the version (the first one found a mismatch)."""


class ModelEngines(BaseModel):
    model_config = _RESPONSE

    engines: list[EngineView]


class EnginesResponse(BaseModel):
    """``GET /rollout/engines``: ``total_engines`` counts live engines (pending ones included).

    Removed and failed engines are left out, so that ``len(engines) == total_engines`` and a client polling for
    "8 engines" does not count the ghosts of removed ones (the event log keeps their story).
    """

    model_config = _RESPONSE

    models: dict[str, ModelEngines]
    total_engines: int
    active_engines: int
