#!/usr/bin/env python3
"""Snapshot of the SGLang interface Relax depends on, read from a release's source without importing it.

    python scripts/sglang_contract.py --version 0.5.23          # pip download --no-deps, then read
    python scripts/sglang_contract.py --wheel sglang-0.5.23-*.whl

writes ``scripts/sglang-contract-<version>.json``: the server's CLI flags, its HTTP routes (path -> methods)
and the request fields of the ``io_struct`` types Relax sends. ``tests/unit/test_sglang_contract.py`` checks
what Relax emits and calls against that file, so an SGLang release that renames a flag or drops a route
shows up as a failing unit test on a CPU machine instead of an engine that never starts on a GPU node.

Why read the source instead of importing SGLang: it needs CUDA, pins its own torch and cannot be installed
next to Relax. Only names are recorded (no code, no help texts). For 0.5.23 the result was checked against
the live objects once (SGLang's argparse parser and FastAPI app, imported with its GPU dependencies stubbed):
the same flags and routes. What is read:

* flags: every typed field of the namespace classes ``ServerArgs`` is assembled from
  (``srt/arg_groups/fields/*.py``; ``--`` + field name with ``-``, or ``Arg(cli_name=...)``, plus
  ``Arg(aliases=...)``; ``Arg(no_cli=True)`` skipped) and every ``add_argument("--...")`` of
  ``srt/server_args.py`` (dynamic choices, deprecated spellings; all flags in older releases);
* routes: the ``@app.<method>`` / ``@app.api_route`` decorators of ``srt/entrypoints/http_server.py``, the
  routers it includes and what it mounts, conditional ones included (``/metrics`` exists only with
  ``--enable-metrics``); FastAPI's own ``/docs`` and ``/openapi.json`` are left out;
* request fields: the annotated fields, inherited ones included, of ``REQUEST_TYPES``; ``route_bodies``
  names the request type each route's handler declares.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
SERVER_ARGS = "srt/server_args.py"
FIELDS_DIR = "srt/arg_groups/fields/"
HTTP_SERVER = "srt/entrypoints/http_server.py"
IO_STRUCT = "srt/managers/io_struct.py"
SAMPLING_PARAMS = "srt/sampling/sampling_params.py"
# Request types whose fields are recorded: what Relax sends (generate, weight updates, pause/continue, abort)
# and the session calls a distributed weight update needs in 0.5.23. Module -> class names.
REQUEST_TYPES: dict[str, tuple[str, ...]] = {
    IO_STRUCT: (
        "AbortReq",
        "BeginWeightUpdateReqInput",
        "ContinueGenerationReqInput",
        "DestroyWeightsUpdateGroupReqInput",
        "EndWeightUpdateReqInput",
        "GenerateReqInput",
        "InitWeightsUpdateGroupReqInput",
        "PauseGenerationReqInput",
        "UpdateWeightFromDiskReqInput",
        "UpdateWeightVersionReqInput",
        "UpdateWeightsFromDistributedReqInput",
    ),
    SAMPLING_PARAMS: ("SamplingParams",),
}
_HTTP_METHODS = ("get", "post", "put", "delete", "patch", "head", "options")


class ContractError(RuntimeError):
    """The archive is not an SGLang release this script can read (one line saying what is missing)."""


# -- reading the archive --------------------------------------------------------------------------------


@dataclass
class Sources:
    """The ``sglang`` package's text files in a wheel or sdist, by path relative to the package root."""

    files: dict[str, str]
    version: str

    def read(self, path: str) -> str:
        if path not in self.files:
            raise ContractError(f"{path} is not in the SGLang archive; is this an SGLang server release?")
        return self.files[path]

    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.read(path), filename=f"sglang/{path}")

    def under(self, prefix: str) -> list[str]:
        return sorted(p for p in self.files if p.startswith(prefix) and p.endswith(".py"))


def _members(archive: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file in a wheel (zip) or an sdist (tar.gz)."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, zf.read(info)
        return
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                handle = tf.extractfile(member) if member.isfile() else None
                if handle is not None:
                    yield member.name, handle.read()
        return
    raise ContractError(f"{archive} is neither a wheel nor an sdist; pass an sglang-*.whl or sglang-*.tar.gz")


def load_sources(archive: Path) -> Sources:
    """The package's ``.py`` files and the release version (``Version:`` of METADATA / PKG-INFO)."""
    wanted: dict[str, str] = {}
    version: str | None = None
    for name, data in _members(archive):
        parts = name.split("/")
        if parts[-1] in ("METADATA", "PKG-INFO") and len(parts) <= 2 and version is None:
            version = _metadata_version(data.decode("utf-8", errors="replace"))
        if name.endswith(".py") and "sglang" in parts[:-1]:
            rel = "/".join(parts[parts.index("sglang") + 1 :])
            wanted.setdefault(rel, data.decode("utf-8", errors="replace"))
    if SERVER_ARGS not in wanted:
        raise ContractError(f"{archive} has no sglang/{SERVER_ARGS}; is it an SGLang server release?")
    if version is None:
        raise ContractError(f"{archive} has no METADATA or PKG-INFO with a Version: line")
    return Sources(wanted, version)


def _metadata_version(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
        if not line.strip():  # the headers end at the first blank line
            break
    return None


def download_wheel(version: str, dest: Path) -> Path:
    """``pip download --no-deps sglang==version`` into ``dest``; the archive it fetched."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={version}", "-d", str(dest)]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ContractError(f"pip download sglang=={version} failed: {tail}; download it elsewhere and pass --wheel")
    found = sorted(dest.glob("sglang-*.whl")) + sorted(dest.glob("sglang-*.tar.gz"))
    if not found:
        raise ContractError(f"pip download sglang=={version} left no sglang archive in {dest}")
    return found[0]


# -- small AST helpers ----------------------------------------------------------------------------------


def _const_str(node: ast.AST | None) -> str | None:
    """A string literal, or the default of ``os.environ.get("VAR", "/default")`` (env-overridable routes)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and _dotted(node.func).endswith("environ.get") and len(node.args) == 2:
        return _const_str(node.args[1])
    return None


def _str_list(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [s for s in (_const_str(e) for e in node.elts) if s is not None]
    return []


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _imported_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (module, name there), for ``from sglang.x.y import name [as local]``; ``*`` too."""
    out: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang."):
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _module_path(src: Sources, module: str) -> str | None:
    """``sglang.srt.utils`` -> ``srt/utils/__init__.py`` (or ``srt/utils.py``), if the archive has it."""
    base = module.removeprefix("sglang.").replace(".", "/")
    return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in src.files), None)


def _find_definition(src: Sources, module: str, name: str, hops: int = 4) -> tuple[str, ast.AST] | None:
    """(module path, top-level def or assignment) of ``name`` as seen from ``module``, following re-exports
    (``from .common import *`` in a package ``__init__``) a few hops."""
    path = _module_path(src, module)
    if path is None or hops == 0:
        return None
    tree = src.tree(path)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return path, node
        if isinstance(node, ast.Assign) and any(_dotted(t) == name for t in node.targets):
            return path, node
    for local, (source, original) in _imported_names(tree).items():
        if local == name or original == "*":
            found = _find_definition(src, source, name if original == "*" else original, hops - 1)
            if found is not None:
                return found
    return None


# -- flags ----------------------------------------------------------------------------------------------


def _cli_names(field_name: str, annotation: ast.AST) -> list[str]:
    """The flags SGLang's ``add_cli_args_from_dataclass`` makes of one annotated field (none if no CLI)."""
    if not (isinstance(annotation, ast.Subscript) and _dotted(annotation.value) in ("A", "Annotated")):
        return []
    elements = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    for meta in elements[1:]:  # like _unwrap_annotated: the first help string or Arg(...) decides
        if _const_str(meta) is not None:
            return ["--" + field_name.replace("_", "-")]
        if isinstance(meta, ast.Call) and _dotted(meta.func).split(".")[-1] == "Arg":
            no_cli = _keyword(meta, "no_cli")
            if isinstance(no_cli, ast.Constant) and no_cli.value is True:
                return []
            name = _const_str(_keyword(meta, "cli_name")) or "--" + field_name.replace("_", "-")
            return _with_negations([name, *_str_list(_keyword(meta, "aliases"))], _keyword(meta, "action"))
    return []


def _with_negations(names: list[str], action: ast.AST | None) -> list[str]:
    """argparse's ``BooleanOptionalAction`` adds ``--no-X`` for every ``--X``."""
    if action is None or _dotted(action).split(".")[-1] != "BooleanOptionalAction":
        return names
    return names + ["--no-" + n[2:] for n in names if n.startswith("--")]


def _class_fields(cls: ast.ClassDef, classes: Mapping[str, ast.ClassDef]) -> Iterator[tuple[str, ast.AST]]:
    """(name, annotation) of a class's annotated fields, bases defined in the same place first."""
    for base in cls.bases:
        parent = classes.get(_dotted(base).split(".")[-1])
        if parent is not None and parent is not cls:
            yield from _class_fields(parent, classes)
    for statement in cls.body:
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and not _is_classvar(statement.annotation)
        ):
            yield statement.target.id, statement.annotation


def _is_classvar(annotation: ast.AST) -> bool:
    head = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return _dotted(head).split(".")[-1] == "ClassVar"


def _input_namespaces(tree: ast.Module) -> list[str] | None:
    """Class names listed in ``_INPUT_NAMESPACES`` of server_args.py (None in releases without it)."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(_dotted(t) == "_INPUT_NAMESPACES" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            return [_dotted(e) for e in node.value.elts]
    return None


def extract_flags(src: Sources) -> list[str]:
    """Every ``--flag`` ``python -m sglang.launch_server`` accepts (argparse's ``--help`` aside)."""
    server_args = src.tree(SERVER_ARGS)
    classes: dict[str, ast.ClassDef] = {}
    for path in src.under(FIELDS_DIR):
        classes.update(_classes(src.tree(path)))
    own = _classes(server_args)
    classes.update({name: cls for name, cls in own.items() if name not in classes})
    names = _input_namespaces(server_args)
    sources = [classes[n] for n in names if n in classes] if names is not None else []
    if "ServerArgs" in own:  # releases where ServerArgs itself declares typed fields
        sources.append(own["ServerArgs"])
    flags = {"--help"}  # argparse's own; prepare_server_args keeps add_help on
    for cls in sources:
        for name, annotation in _class_fields(cls, classes):
            flags.update(_cli_names(name, annotation))
    for node in ast.walk(server_args):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [s for s in (_const_str(a) for a in node.args) if s and s.startswith("--")]
            flags.update(_with_negations(names, _keyword(node, "action")))
    if not flags:
        raise ContractError("found no server flags; SGLang changed how ServerArgs declares them, update this script")
    return sorted(flags)


# -- routes ---------------------------------------------------------------------------------------------


@dataclass
class _Route:
    path: str
    methods: list[str]
    body: str | None  # the request type the handler declares, if one of REQUEST_TYPES


def _decorated_routes(tree: ast.Module, owners: Iterable[str], prefix: str = "") -> Iterator[_Route]:
    """Routes declared with ``@<owner>.get(path)``, ``@<owner>.api_route(path, methods=[...])`` and the like."""
    owners = set(owners)
    bodies = {name for names in REQUEST_TYPES.values() for name in names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = _handler_body(node, bodies)
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
                continue
            if _dotted(decorator.func.value) not in owners or not decorator.args:
                continue
            path = _const_str(decorator.args[0])
            kind = decorator.func.attr
            if path is None:
                continue
            if kind in _HTTP_METHODS:
                yield _Route(prefix + path, [kind.upper()], body)
            elif kind == "api_route":
                methods = [m.upper() for m in _str_list(_keyword(decorator, "methods"))]
                yield _Route(prefix + path, methods or ["GET"], body)  # FastAPI's default is GET
            elif kind == "websocket":
                yield _Route(prefix + path, ["WEBSOCKET"], None)


def _handler_body(func: ast.FunctionDef | ast.AsyncFunctionDef, bodies: set[str]) -> str | None:
    """The request type named by a handler's parameter annotation (``obj: X`` or ``Annotated[X, Body()]``)."""
    for arg in func.args.args:
        if arg.annotation is None:
            continue
        for node in ast.walk(arg.annotation):
            if isinstance(node, ast.Name) and node.id in bodies:
                return node.id
    return None


def _routers(tree: ast.Module) -> dict[str, str]:
    """Name -> prefix of the ``APIRouter(...)`` objects a module defines."""
    out: dict[str, str] = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and _dotted(node.value.func).split(".")[-1] == "APIRouter"
        ):
            for target in node.targets:
                out[_dotted(target)] = _const_str(_keyword(node.value, "prefix")) or ""
    return out


def _included_routes(src: Sources, tree: ast.Module) -> Iterator[_Route]:
    """Routes of the routers ``app.include_router(...)`` adds, found through the module they come from."""
    imports = _imported_names(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _dotted(node.func) == "app.include_router" and node.args):
            continue
        local = _dotted(node.args[0])
        if local not in imports:
            continue
        found = _find_definition(src, *imports[local])
        if found is None:
            continue
        router_tree = src.tree(found[0])
        name = imports[local][1]
        own_prefix = _routers(router_tree).get(name, "")
        prefix = _const_str(_keyword(node, "prefix")) or ""
        yield from _decorated_routes(router_tree, [name], prefix + own_prefix)


def _mounted_routes(src: Sources, tree: ast.Module) -> Iterator[_Route]:
    """``Mount("/path", ...)`` inside helpers http_server.py calls (``add_prometheus_middleware``), and
    ``app.mount``. Recorded as GET: what Relax does with them (``/metrics`` is a Prometheus ASGI app)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func) == "app.mount" and node.args:
            path = _const_str(node.args[0])
            if path:
                yield _Route(path, ["GET"], None)
    imports = _imported_names(tree)
    called = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for name in sorted(called & set(imports)):
        found = _find_definition(src, *imports[name])
        if found is None or not isinstance(found[1], ast.FunctionDef):
            continue
        for call in ast.walk(found[1]):
            if isinstance(call, ast.Call) and _dotted(call.func).split(".")[-1] == "Mount" and call.args:
                path = _const_str(call.args[0])
                if path:
                    yield _Route(path, ["GET"], None)


def extract_routes(src: Sources) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(path -> sorted methods, path -> request type of its body) of SGLang's HTTP server."""
    tree = src.tree(HTTP_SERVER)
    routes: dict[str, set[str]] = {}
    bodies: dict[str, str] = {}
    found = [*_decorated_routes(tree, ["app"]), *_included_routes(src, tree), *_mounted_routes(src, tree)]
    for route in found:
        routes.setdefault(route.path, set()).update(route.methods)
        if route.body:
            bodies[route.path] = route.body
    if not routes:
        raise ContractError(f"found no routes in sglang/{HTTP_SERVER}; update this script")
    return {path: sorted(methods) for path, methods in sorted(routes.items())}, dict(sorted(bodies.items()))


# -- request fields -------------------------------------------------------------------------------------


def extract_request_fields(src: Sources) -> dict[str, list[str]]:
    """Class -> sorted field names, for every class of ``REQUEST_TYPES`` (a missing class is an error)."""
    out: dict[str, list[str]] = {}
    for module, names in REQUEST_TYPES.items():
        classes = _classes(src.tree(module))
        for name in names:
            if name not in classes:
                raise ContractError(f"sglang/{module} has no class {name}; SGLang renamed it, update REQUEST_TYPES")
            out[name] = sorted({field for field, _ in _class_fields(classes[name], classes)})
    return dict(sorted(out.items()))


# -- the snapshot and the check -------------------------------------------------------------------------


def build_snapshot(src: Sources) -> dict[str, object]:
    """The JSON document: stable (sorted everywhere) so a diff between releases reads as a changelog."""
    routes, bodies = extract_routes(src)
    return {
        "sglang_version": src.version,
        "flags": extract_flags(src),
        "routes": routes,
        "route_bodies": bodies,
        "request_fields": extract_request_fields(src),
    }


def missing_from_snapshot(
    snapshot: Mapping[str, object],
    *,
    flags: Iterable[str] = (),
    routes: Iterable[str | tuple[str, str]] = (),
    request_fields: Mapping[str, Iterable[str]] | None = None,
) -> list[str]:
    """What Relax uses that ``snapshot`` lacks, one readable name per item (empty: all there).

    ``routes`` are paths, or (method, path) pairs to check the method too; ``request_fields`` maps a
    request type (``GenerateReqInput``) or a route (``/generate``, resolved through ``route_bodies``) to
    the body fields Relax sends there.
    """
    known_flags = set(snapshot.get("flags", ()))  # type: ignore[arg-type]
    known_routes: Mapping[str, Sequence[str]] = snapshot.get("routes", {})  # type: ignore[assignment]
    bodies: Mapping[str, str] = snapshot.get("route_bodies", {})  # type: ignore[assignment]
    fields: Mapping[str, Sequence[str]] = snapshot.get("request_fields", {})  # type: ignore[assignment]
    missing = [f"flag {flag}" for flag in sorted(set(flags)) if flag not in known_flags]
    for route in sorted(set(routes), key=str):
        method, path = route if isinstance(route, tuple) else (None, route)
        if path not in known_routes:
            if f"route {path}" not in missing:  # once per path, whether asked with a method or not
                missing.append(f"route {path}")
        elif method is not None and method.upper() not in known_routes[path]:
            missing.append(f"route {method.upper()} {path} (has {', '.join(known_routes[path])})")
    for owner, sent in sorted((request_fields or {}).items()):
        kind = bodies.get(owner, owner)
        if kind not in fields:
            missing.append(f"request type {owner}" if kind == owner else f"request body of {owner} ({kind})")
            continue
        missing += [f"request field {kind}.{name}" for name in sorted(set(sent)) if name not in fields[kind]]
    return missing


def write_snapshot(snapshot: Mapping[str, object], out: Path) -> None:
    out.write_text(json.dumps(snapshot, indent=1) + "\n")  # every mapping in it is built sorted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--wheel", type=Path, help="a downloaded sglang-*.whl (or sdist)")
    source.add_argument("--version", help="download this sglang release from PyPI (pip download --no-deps)")
    parser.add_argument("--out", type=Path, help="output file (default: scripts/sglang-contract-<version>.json)")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="sglang-contract-") as tmp:
            archive = args.wheel if args.wheel is not None else download_wheel(args.version, Path(tmp))
            if not archive.is_file():
                raise ContractError(f"{archive} does not exist; pass a downloaded sglang wheel")
            src = load_sources(archive)
            if args.version is not None and src.version != args.version:
                raise ContractError(f"asked for sglang {args.version} but the archive is {src.version}")
            snapshot = build_snapshot(src)
    except ContractError as error:
        print(f"sglang_contract: {error}", file=sys.stderr)
        return 1
    out = args.out or SCRIPTS / f"sglang-contract-{snapshot['sglang_version']}.json"
    write_snapshot(snapshot, out)
    routes = snapshot["routes"]
    print(f"{out}: sglang {snapshot['sglang_version']}, {len(snapshot['flags'])} flags, {len(routes)} routes")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
