"""One way to say what is wrong with a YAML file: ``not valid YAML at line L, column C (problem)``.

Every reader of a user's YAML (the autoscaler config, the plan's bounds, KubeRay manifests) names the place
and PyYAML's own words for the problem in one line, never a traceback.
"""

from __future__ import annotations


def yaml_error_text(error: Exception) -> str:
    """The one-line description of a ``yaml.YAMLError``, without the file's name (the caller adds it)."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or "syntax error"
    return f"not valid YAML{where} ({problem})"
