"""docs/metrics.md names every metric Relax emits, and Relax's own Prometheus series follow Prometheus's naming.

The emitted names are collected from the code that emits them, not from a list kept beside it:

* ``metrics.jsonl`` / TensorBoard: the rollout step's keys from ``generation_loop.rollout_metrics`` on a tiny prompt
  group, the staleness keys from ``StalenessStats.to_metrics``, the evaluation keys from ``EvalReport.to_metrics``;
  the driver's own keys (``_train_one``'s ``row``, ``_evaluate``'s) and the trainer's (``policy_loss``'s metrics,
  ``TrainerActor.train_step``'s and ``TrainerGroup.train_step``'s additions) are read from the source with
  ``ast``, because producing them for real needs Ray or torch (seconds, not milliseconds).
* the control plane's ``/metrics``: ``render_metrics`` over a status with every key it knows, parsed back.
* the built-in engine's ``/metrics``: ``EngineMetrics.render``, parsed back.
* the SGLang series the autoscaler reads: ``relax.autoscaler.metrics.GAUGES`` and ``HISTOGRAMS``.

Naming rules for Relax's own series (the control plane's and ``relax_engine_served_weight_version``), checked
here as plain rules (``promtool check metrics`` accepts them too, checked by hand; CI has no promtool): names
match ``[a-zA-Z_][a-zA-Z0-9_]*`` with no colon (colons are for recording rules), are lower snake_case under the
``relax_`` prefix, counters end in ``_total`` and nothing else does, and units are spelled out as base-unit
suffixes (``_seconds``, ``_per_second``; never ``_s``, ``_ms``, ``_secs``).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax.autoscaler import metrics as autoscaler_metrics
from relax.data.buffer import StalenessStats
from relax.data.sample import PromptGroup, Sample
from relax.engines.builtin.metrics import EngineMetrics, LoadSnapshot
from relax.rollout.control.metrics import COUNTERS, GAUGES, render_metrics
from relax.rollout.dispatch.generation_loop import StepTimes, rollout_metrics
from relax.rollout.pool.engines import EngineState
from relax.training.evaluation import EvalReport
from relax.training.report import RUN_SECONDS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
DATASET = "DATASET"
"""Stands for an eval dataset's name; docs/metrics.md writes it ``<dataset>`` (and pass@k's ``k`` as ``<k>``)."""


# -- what the code emits ---------------------------------------------------------------------------------------


def _function(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    scope: list[ast.stmt] = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name)


def _written_keys(func: ast.AST, var: str) -> set[str]:
    """String keys ``func`` puts into the dict ``var``: its literal, ``var["k"] = ``, ``var.update(k=...)``."""
    keys: set[str] = set()
    for node in ast.walk(func):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == var for t in node.targets)):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == var
                    and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
                keys.add(target.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == var):
            keys |= {kw.arg for kw in node.keywords if kw.arg}
    return keys


def trainer_keys() -> set[str]:
    """``TrainerGroup.train_sharded``'s metrics: the loss's, the actor's additions, the group's wall time."""
    keys = _written_keys(_function(ROOT / "relax/training/grpo.py", "policy_loss"), "metrics")
    keys |= _written_keys(_function(ROOT / "relax/training/actor.py", "train_step", "TrainerActor"), "out")
    keys |= _written_keys(_function(ROOT / "relax/training/group.py", "train_sharded", "TrainerGroup"), "metrics")
    return keys


def _sample(index: int) -> Sample:
    return Sample(prompt_index=0, group_id="g", sample_index=index, prompt_token_ids=(1, 2), response_token_ids=(3,),
                  response_text="x", label="y", weight_version=0, rollout_step=0, reward=1.0)


@cache
def step_keys() -> frozenset[str]:
    """Every key of a train or eval row of ``metrics.jsonl`` (eval names in ``DATASET``/``pass@<k>`` form)."""
    train = _function(ROOT / "relax/entrypoints/train.py", "_train_one", "Driver")
    evaluate = _function(ROOT / "relax/entrypoints/train.py", "_evaluate", "Driver")
    keys = {"step", "kind", RUN_SECONDS}
    keys |= _written_keys(train, "row") | _written_keys(evaluate, "row")
    keys |= set(rollout_metrics([PromptGroup("g", 0, 0, (_sample(0), _sample(1)))], StepTimes(started=0.0,
                                                                                                  finished=1.0)))
    keys |= set(StalenessStats(2, 0.5, 0, 1, {0: 1, 1: 1}).to_metrics())
    keys |= {f"train/{k}" for k in trainer_keys()}
    report = EvalReport(DATASET, num_prompts=1, num_samples=4, mean_reward=1.0, pass_at_k={1: 1.0, 4: 1.0},
                        truncation_ratio=0.0, mean_response_length=3.0)
    keys |= {re.sub(r"pass@\d+$", "pass@<k>", k) for k in report.to_metrics()}
    return frozenset(k.replace(DATASET, "<dataset>") for k in keys)


def _families(text: str) -> dict[str, str]:
    """``{family: type}``, counters under their ``_total`` name as the exposition writes them.

    A histogram's ``<name>_created`` (prometheus_client's creation time, which the parser reads as a family of
    its own) is part of the histogram, documented with it.
    """
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    histograms = {n for n, t in families.items() if t == "histogram"}
    return {n + "_total" if t == "counter" else n: t for n, t in families.items()
            if not (n.endswith("_created") and n.removesuffix("_created") in histograms)}


def full_status() -> dict[str, object]:
    status: dict[str, object] = {}
    for key, _, _ in GAUGES + COUNTERS:  # ``a.b``: key b of the status's a (RunStatus.migration)
        outer, _, inner = key.partition(".")
        if inner:
            status.setdefault(outer, {})[inner] = 1.0  # type: ignore[index]
        else:
            status[key] = 1.0
    status["engines_by_state"] = {s.value: 1 for s in EngineState}
    status["scale_events_total"] = {"scale_out_requested": 1}
    status["weight_verifications"] = {"verified": 2, "mismatch": 1, "uncheckable": 0}
    return status


@cache
def control_plane_series() -> dict[str, str]:
    return _families(render_metrics(full_status()).decode())


@cache
def engine_series() -> dict[str, str]:
    text = EngineMetrics("m").render(LoadSnapshot(1, 2, 3, 4), weight_version="5").decode()
    return _families(text)


def autoscaler_series() -> set[str]:
    return set(autoscaler_metrics.GAUGES.values()) | set(autoscaler_metrics.HISTOGRAMS.values())


def documented(name: str) -> bool:
    return f"`{name}`" in DOC.read_text(encoding="utf-8")


# -- every emitted name is documented ----------------------------------------------------------------------------


def test_the_collection_finds_what_the_code_emits():
    """Guards the collectors themselves: an AST walk that finds nothing would pass every check below."""
    keys = step_keys()
    assert {"rollout/reward_mean", "staleness/max", "train/loss", "train/grad_norm", "train/wall_time_s",
            "time/step_s", "time/eval_s", "engines/active", "eval/<dataset>/pass@<k>"} <= keys
    assert {"relax_engines", "relax_training_step", "relax_rollout_tokens_total",
            "relax_scale_events_total", "relax_weight_verifications_total"} <= set(control_plane_series())
    assert {"sglang:num_queue_reqs", "sglang:time_to_first_token_seconds",
            "relax_engine_served_weight_version"} <= set(engine_series())


def test_every_metrics_jsonl_key_is_documented():
    missing = sorted(k for k in step_keys() if not documented(k))
    assert not missing, f"docs/metrics.md does not document these metrics.jsonl keys: {missing}"


def test_every_control_plane_series_is_documented():
    missing = sorted(n for n in control_plane_series() if not documented(n))
    assert not missing, f"docs/metrics.md does not document these control-plane series: {missing}"


def test_every_engine_series_is_documented():
    missing = sorted(n for n in engine_series() if not documented(n))
    assert not missing, f"docs/metrics.md does not document these built-in engine series: {missing}"


def test_every_series_the_autoscaler_reads_is_documented():
    missing = sorted(n for n in autoscaler_series() if not documented(n))
    assert not missing, f"docs/metrics.md does not document these SGLang series: {missing}"


def test_the_builtin_engine_exports_every_series_the_autoscaler_reads():
    assert autoscaler_series() <= set(engine_series())


# -- Prometheus naming of Relax's own series -------------------------------------------------------------------

_BAD_UNIT_SUFFIXES = ("_s", "_ms", "_us", "_secs", "_sec", "_millis", "_milliseconds", "_per_s", "_mb", "_kb",
                      "_bytes_total_bytes")


def relax_series() -> dict[str, str]:
    own = {n: t for n, t in engine_series().items() if not n.startswith("sglang:")}
    return {**control_plane_series(), **own}


@pytest.mark.parametrize("name", sorted(relax_series()))
def test_relax_series_follow_prometheus_naming(name):
    kind = relax_series()[name]
    assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name), f"{name}: not a valid metric name"
    assert ":" not in name, f"{name}: colons are reserved for recording rules"
    assert re.fullmatch(r"relax_[a-z0-9]+(_[a-z0-9]+)*", name), f"{name}: not lower snake_case under relax_"
    if kind == "counter":
        assert name.endswith("_total"), f"{name}: a counter ends in _total"
    else:
        assert not name.endswith("_total"), f"{name}: only counters end in _total"
    base = name.removesuffix("_total")
    assert not base.endswith(_BAD_UNIT_SUFFIXES), f"{name}: spell the unit as a base-unit suffix (_seconds...)"


def test_no_relax_series_outside_the_relax_prefix():
    """The engine's only non-SGLang series is Relax's, and SGLang's own keep SGLang's names."""
    assert all(n.startswith(("sglang:", "relax_")) for n in engine_series())


# -- examples/monitoring: the dashboard queries only series that exist ------------------------------------------

MONITORING = ROOT / "examples" / "monitoring"
SGLANG_FIXTURES = sorted((ROOT / "tests" / "fixtures" / "sglang").glob("*.txt"))
PROMETHEUS_SERIES = {"up"}
"""Series Prometheus itself writes for every target."""
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promql_series(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (functions, keywords, labels, strings and durations removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        rest = expr[match.end():].lstrip()
        if rest.startswith("(") or match.group().lower() in _PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def dashboard_exprs() -> list[str]:
    import json

    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text(encoding="utf-8"))
    panels = list(dashboard["panels"])
    panels += [p for row in dashboard["panels"] for p in row.get("panels", [])]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def exported_series() -> dict[str, str]:
    """Every series the control plane or an engine exports: Relax's, the built-in engine's, real SGLang's."""
    out = {**control_plane_series(), **engine_series()}
    for fixture in SGLANG_FIXTURES:
        out.update(_families(fixture.read_text(encoding="utf-8")))
    return out


def test_promql_series_parsing():
    assert promql_series('histogram_quantile(0.95, sum by (le) (rate(sglang:ttft_seconds_bucket{a="b(c)"}[1m])))') \
        == {"sglang:ttft_seconds_bucket"}
    assert promql_series("relax_a - relax_b > 0") == {"relax_a", "relax_b"}
    assert promql_series('count(up{job="x"} == 1)') == {"up"}


def test_every_series_the_dashboard_queries_is_exported():
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    exported = exported_series()
    missing = set()
    for expr in exprs:
        for name in promql_series(expr):
            base = next((name.removesuffix(s) for s in _HISTOGRAM_SUFFIXES
                         if name.endswith(s) and exported.get(name.removesuffix(s)) == "histogram"), name)
            if base not in exported and name not in PROMETHEUS_SERIES:
                missing.add(name)
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"


def test_the_dashboard_reads_only_what_both_engine_kinds_export_or_relax():
    """A panel over the engines works whether they run the built-in engine or SGLang."""
    builtin = set(engine_series())
    sglang = {name for name in exported_series() if name.startswith("sglang:")} - builtin
    used = {n.removesuffix(s) for e in dashboard_exprs() for n in promql_series(e) for s in ("_bucket", "")
            if n.endswith(s)}
    assert not used & sglang, f"series only a real SGLang server exports: {sorted(used & sglang)}"


def test_prometheus_config_scrapes_the_control_plane_and_discovers_the_engines():
    import yaml

    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["relax"]["metrics_path"] == "/metrics"
    sd = jobs["relax-engines"]["http_sd_configs"][0]
    assert sd["url"].endswith("/rollout/prometheus_sd")
    assert sd["authorization"]["credentials_file"].endswith("/api-token")
