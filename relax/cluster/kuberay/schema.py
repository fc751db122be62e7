"""KubeRay v1.7.0's own ``v1`` schemas, checked as the API server's strict field validation checks them.

The vendored files (``schemas/``, derived by ``scripts/kuberay/vendor_schemas.py``, license beside them) are
KubeRay's ``openAPIV3Schema`` unchanged. The API server rejects unknown fields under strict validation, and no
field of these CRDs preserves unknown fields, so ``strict`` closes every object that lists its properties. What
JSON Schema cannot say is added here too: ``int32``/``int64`` ranges, and ``metadata`` (just ``type: object``
in a CRD) as Kubernetes' ObjectMeta. List-map key uniqueness is a rule of its own (``rules``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_DIR = Path(__file__).with_name("schemas")
SCHEMA_FILES = {"RayCluster": "raycluster.v1.json", "RayJob": "rayjob.v1.json"}
API_VERSION = "ray.io/v1"
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The ObjectMeta fields a manifest may write (the server sets the rest).
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "generateName": {"type": "string"},
                   "namespace": {"type": "string"}, "labels": _STRING_MAP, "annotations": _STRING_MAP,
                   "finalizers": {"type": "array", "items": {"type": "string"}},
                   "ownerReferences": {"type": "array", "items": {"type": "object"}}},
}


def strict(schema: Any, key: str | None = None) -> Any:
    """A copy of ``schema`` in which unknown fields are errors and ``metadata`` is ObjectMeta."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if key == "metadata" and schema.get("type") == "object" and "properties" not in schema:
        return copy.deepcopy(OBJECT_META)
    out = {k: (strict(v, k) if k != "properties" else {name: strict(s, name) for name, s in v.items()})
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    for name, (low, high) in _INT_RANGES.items():
        def in_range(value: object, low: int = low, high: int = high) -> bool:
            return not isinstance(value, int) or isinstance(value, bool) or low <= value <= high
        checker.checks(name)(in_range)
    return checker


@cache
def vendored_schema(kind: str) -> dict[str, Any]:
    """KubeRay's ``v1`` schema of ``kind`` as vendored (with its ``x-relax-source`` record)."""
    return json.loads((SCHEMA_DIR / SCHEMA_FILES[kind]).read_text(encoding="utf-8"))


@cache
def _validator(kind: str) -> jsonschema.Draft4Validator:
    schema = strict({k: v for k, v in vendored_schema(kind).items() if k != "x-relax-source"})
    return jsonschema.Draft4Validator(schema, format_checker=_format_checker())


def source_release() -> str:
    """``KubeRay v1.7.0 (commit …)``: the release the vendored schemas come from."""
    source = vendored_schema("RayCluster")["x-relax-source"]
    return f"KubeRay {source['release']} (commit {source['commit'][:12]})"


def _path(error: jsonschema.ValidationError) -> str:
    text = ""
    for part in error.absolute_path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _message(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        known = set(error.schema.get("properties") or {})
        unknown = sorted(k for k in error.instance if k not in known)
        return f"unknown field(s) {', '.join(map(repr, unknown))} (KubeRay's schema has no such field here)"
    if error.validator == "anyOf" and isinstance(error.instance, str):
        return f"{error.instance!r} is not a valid quantity or integer"
    return error.message


def schema_errors(body: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(field path, message)`` for every way ``body`` breaks its kind's strict ``v1`` schema."""
    validator = _validator(str(body.get("kind")))
    errors = sorted(validator.iter_errors(body), key=lambda e: [str(p) for p in e.absolute_path])
    for error in errors:
        yield _path(error), _message(error)


def list_map_keys(schema: Mapping[str, Any], body: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """``(field path, message)`` for repeated keys in the list maps and sets of ``body`` (the API server
    refuses them; JSON Schema cannot say it)."""
    if isinstance(body, Mapping):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, value in body.items():
            child = properties.get(name) or (extra if isinstance(extra, Mapping) else None)
            if child is not None:
                yield from list_map_keys(child, value, f"{path}.{name}" if path else str(name))
        return
    if not isinstance(body, list):
        return
    items = schema.get("items") or {}
    kind = schema.get("x-kubernetes-list-type")
    if kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen: dict[tuple, int] = {}
        for index, item in enumerate(body):
            if not isinstance(item, Mapping):
                continue
            key = tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys)
            if key in seen:
                shown = ", ".join(f"{k}={v}" for k, v in zip(keys, key, strict=True))
                yield f"{path}[{index}]", f"repeats {shown} of {path}[{seen[key]}] (keys of this list must be unique)"
            seen.setdefault(key, index)
    elif kind == "set":
        seen_values: dict[str, int] = {}
        for index, item in enumerate(body):
            token = json.dumps(item, sort_keys=True)
            if token in seen_values:
                yield f"{path}[{index}]", f"repeats {path}[{seen_values[token]}] (this list is a set)"
            seen_values.setdefault(token, index)
    for index, item in enumerate(body):
        yield from list_map_keys(items, item, f"{path}[{index}]")


def kind_schema(kind: str) -> dict[str, Any]:
    return {k: v for k, v in vendored_schema(kind).items() if k != "x-relax-source"}
