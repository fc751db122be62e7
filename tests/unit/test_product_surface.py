"""No public function or method of ``relax/`` is called only from tests.

Product classes carry no scaffolding. A method that only tests call is either dead (the product stopped needing
it, and the tests keep it alive) or a test helper that a reader of the product takes for part of it. Either way
it leaves the product: into a helper in ``tests/`` (or ``relax/testing/``, the scaffolding shared with
``benchmarks/``), or into the product code that should have used it.

The check is by name, over the syntax trees: a function *is used* where its name occurs as a variable, an
attribute, an imported name or an identifier-like string constant, a method only as an attribute or a string
(``getattr``, a Ray method named by string), in product code:
``relax/``, ``benchmarks/``, ``scripts/``, ``examples/``. So a name that product code uses for something else hides
an offender (a file's ``closed`` hid ``SampleBuffer.closed``, ``Victim.from_record`` hid ``EngineView.from_record``):
a false negative, never a false positive. Names that
no code references at all (framework hooks such as pydantic validators, overrides of a library's methods) are
not this check's business, nor are dunders and ``_private`` names. A hook that a library calls by a name no
product code spells out is listed in :data:`ALLOWED`, with why.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("relax", "benchmarks", "scripts", "examples")
TESTS = "tests"
#: Scaffolding by design: helpers here are meant for tests and benchmarks.
SCAFFOLDING = ("relax/testing/",)

#: ``path: Class.method`` -> why nothing in the product calls it by name, yet it is no scaffolding.
ALLOWED: dict[str, str] = {
    "relax/rollout/control/metrics.py: RelaxStatusCollector.collect":
        "prometheus_client's registry calls collect() on every collector registered with it",
}


def _files(top: str) -> Iterator[Path]:
    yield from sorted((REPO / top).rglob("*.py"))


def _trees(tops: tuple[str, ...], mentioning: re.Pattern[str] | None = None) -> dict[str, ast.Module]:
    """The modules under ``tops`` by path; with ``mentioning``, only those whose text matches it (parsing is
    most of the check's time)."""
    out = {}
    for top in tops:
        for path in _files(top):
            text = path.read_text(encoding="utf-8")
            if mentioning is None or mentioning.search(text):
                out[str(path.relative_to(REPO))] = ast.parse(text, str(path))
    return out


def used_names(trees: dict[str, ast.Module]) -> tuple[set[str], set[str], set[str]]:
    """(every name these modules mention, the names they reach as attributes, identifier-like strings).

    A function is used where its name occurs at all (a call, an import, ``module.function``); a method only as an
    attribute (``obj.method``) or, in product code, a string (``getattr``, a Ray method named by string): a local
    variable or a test's string that happens to share a method's name does not use it.
    """
    names: set[str] = set()
    attributes: set[str] = set()
    strings: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
                attributes.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
                strings.add(node.value)
            elif isinstance(node, ast.alias):
                names.add(node.name.rsplit(".", 1)[-1])
    return names, attributes, strings


def public_definitions(path: str, tree: ast.Module) -> Iterator[tuple[str, str, bool]]:
    """(name, ``path: Class.method`` or ``path: function``, whether it is a method) of the module's public
    functions and its classes' public methods (properties included); dunders and ``_private`` names are left out."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and not node.name.startswith("_"):
            yield node.name, f"{path}: {node.name}", False
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, functions) and not sub.name.startswith("_"):
                    yield sub.name, f"{path}: {node.name}.{sub.name}", True


def find_offenders() -> tuple[list[str], list[str]]:
    """(offenders, every public definition checked), both as ``path: Class.method``."""
    product = _trees(PRODUCT)
    product_names, product_attributes, product_strings = used_names(product)
    product_reached = product_attributes | product_strings
    defined, unused = [], {}
    for path, tree in product.items():
        if not path.startswith("relax/") or path.startswith(SCAFFOLDING):
            continue
        for name, where, method in public_definitions(path, tree):
            defined.append(where)
            if name not in (product_reached if method else product_names) and where not in ALLOWED:
                unused[where] = (name, method)
    if not unused:
        return [], defined
    names = sorted({name for name, _ in unused.values()})
    test_names, test_attributes, _ = used_names(_trees((TESTS,), re.compile(r"\b(?:" + "|".join(names) + r")\b")))
    return [where for where, (name, method) in unused.items()
            if name in (test_attributes if method else test_names)], defined


def test_no_product_method_is_called_only_from_tests() -> None:
    offenders, defined = find_offenders()
    assert not offenders, (
        "only tests call these (product classes carry no scaffolding):\n  " + "\n  ".join(offenders)
        + "\nMove each to a test helper in tests/ or relax/testing/ and have the tests call that, or use it in the "
        "product (tests/unit/test_product_surface.py says why)."
    )
    stale = sorted(set(ALLOWED) - set(defined))
    assert not stale, f"ALLOWED names what no longer exists; drop it: {stale}"
