"""Autoscaler policies on every built-in trace: cost (engine-seconds) against queue wait.

Runs the simulator (``relax.autoscaler.simulator``) for each built-in trace × policy -- ``relax`` (tuned),
``relax-defaults`` (the documented defaults), ``static:min`` and ``static:max`` (the recipe's 4 and 8
engines, no autoscaler) -- prints a table and saves JSON (benchmarks/results/autoscaler_policies.json).
The static pools bracket the trade-off: ``static:min`` is the cheapest pool and ``static:max`` the one
that never queues; a policy is good when it costs much less than the second and waits much less than
the first. Deterministic: the same ``--seeds`` give the same numbers on any machine.

    python benchmarks/autoscaler_policies.py [--seeds 0 1 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from relax.autoscaler.cli import engines_strip
from relax.autoscaler.simulator import (
    RELAX_TUNED,
    SimulationResult,
    SimulationSettings,
    parse_policy,
    simulate,
)
from relax.autoscaler.traces import builtin_trace, trace_names

POLICIES = ("relax", "relax-defaults", "static:min", "static:max")
_AVERAGED = (
    "engine_seconds",
    "mean_engines",
    "queue_wait_p95_s",
    "queue_wait_p99_s",
    "secs_above_objective",
    "scale_actions",
    "reversals",
)


def _row(policy_text: str, results: list[SimulationResult]) -> dict[str, Any]:
    """One trace × policy: the first seed's full summary, with the averages over seeds beside it."""
    first = results[0]
    label = policy_text if policy_text == first.policy else f"{policy_text} ({first.policy.split(':')[1]})"
    row = {**first.summary(), "policy": label, "seeds": [r.seed for r in results]}
    if len(results) > 1:
        row["mean_over_seeds"] = {
            key: round(statistics.fmean(r.summary()[key] for r in results), 3) for key in _AVERAGED
        }
    # Compact on purpose: the CLI's --json has the full timeline; here one character a minute is enough to
    # see the shape, and actions keep their headline ("scale out 4 -> 8 (+4)") without the full reason.
    row["active_engines_per_minute"] = engines_strip(first)
    row["actions"] = [{**a.to_dict(), "reason": a.reason.split(":", 1)[0]} for a in first.actions]
    return row


def run(seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for name in trace_names():
        trace = builtin_trace(name)
        for policy_text in POLICIES:
            policy = parse_policy(policy_text)
            results = [simulate(trace, policy, SimulationSettings(seed=seed)) for seed in seeds]
            rows.append(_row(policy_text, results))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    averaged = "mean_over_seeds" in rows[0]
    header = (
        f"{'trace':<10} {'policy':<16} {'engine-s':>9} {'mean eng':>8} {'P95 wait':>9} {'P99 wait':>9} "
        f"{'>5s (s)':>8} {'actions':>7} {'revs':>4} {'final':>5}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        values = row["mean_over_seeds"] if averaged else row
        print(
            f"{row['trace']:<10} {row['policy']:<16} {values['engine_seconds']:>9.0f} {values['mean_engines']:>8.2f} "
            f"{values['queue_wait_p95_s']:>8.1f}s {values['queue_wait_p99_s']:>8.1f}s "
            f"{values['secs_above_objective']:>8.0f} {values['scale_actions']:>7.1f} {values['reversals']:>4.1f} "
            f"{row['final_engines']:>5}"
        )
    if averaged:
        print(f"(means over seeds {rows[0]['seeds']}; 'final' is seed {rows[0]['seeds'][0]})")


def _values(row: dict[str, Any]) -> dict[str, Any]:
    return row.get("mean_over_seeds", row)


def verdict(by_policy: dict[str, dict[str, Any]]) -> str:
    """Where `relax` sits against the line between the static extremes, and against `relax-defaults`.

    On or beyond the line = at its engine-seconds, P95 wait no higher than the straight-line mix of
    static:min and static:max (the best a fixed pool size in between could be expected to do).
    """
    ours, defaults = _values(by_policy["relax"]), _values(by_policy["relax-defaults"])
    lo, hi = _values(by_policy["static:min"]), _values(by_policy["static:max"])
    c, w = ours["engine_seconds"], ours["queue_wait_p95_s"]
    span = hi["engine_seconds"] - lo["engine_seconds"]
    frac = 0.0 if span <= 0 else min(1.0, max(0.0, (c - lo["engine_seconds"]) / span))
    line_w = lo["queue_wait_p95_s"] + frac * (hi["queue_wait_p95_s"] - lo["queue_wait_p95_s"])
    frontier = (
        "on/beyond the static line" if w <= line_w + 0.5 else f"behind the static line ({w:.1f}s > {line_w:.1f}s)"
    )
    cost = (c - defaults["engine_seconds"]) / defaults["engine_seconds"] if defaults["engine_seconds"] else 0.0
    wait = w - defaults["queue_wait_p95_s"]
    versus = f"vs relax-defaults: engine-seconds {cost:+.0%}, P95 wait {wait:+.1f}s"
    return f"{frontier}; {versus}"


def write_markdown(rows: list[dict[str, Any]], path: Path, seeds: list[int]) -> None:
    lines = [
        "# Autoscaler policies on the shipped traces",
        "",
        "Generated by `python benchmarks/autoscaler_policies.py` (simulated engines; the real `AutoscalerPolicy` "
        "decides and the real `ScaleExecutor` carries the requests out, with the run's default partial-success "
        f"policy `rollback_all`; means over seeds {seeds}). Cost = engine-seconds; wait = P95 queue wait.",
        "",
        "| trace | policy | engine-s | mean engines | P95 wait (s) | time over 5 s objective (s) | actions |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by_trace: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        v = _values(row)
        lines.append(
            f"| {row['trace']} | {row['policy']} | {v['engine_seconds']:.0f} | {v['mean_engines']:.2f} | "
            f"{v['queue_wait_p95_s']:.1f} | {v['secs_above_objective']:.0f} | {v['scale_actions']:.1f} |"
        )
        by_trace.setdefault(row["trace"], {})[row["policy"].split(" ")[0]] = row
    lines += ["", "## Where `relax` sits", ""]
    for trace, policies in by_trace.items():
        lines.append(f"- **{trace}**: {verdict(policies)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/autoscaler_policies.json")
    parser.add_argument("--markdown", default="benchmarks/results/autoscaler.md")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args.seeds)
    elapsed = time.perf_counter() - started
    print_table(rows)
    settings = SimulationSettings()
    report = {
        "benchmark": "autoscaler_policies",
        "what": "simulated engine pool driven by the real AutoscalerPolicy; cost vs queue wait per trace × policy",
        "seeds": args.seeds,
        "policies": list(POLICIES),
        "relax_tuned": RELAX_TUNED,
        "settings": {
            "engine": vars(settings.engine),
            "startup": vars(settings.startup),
            "tokens_per_request": settings.tokens_per_request,
            "group_size": settings.group_size,
            "queue_wait_objective_secs": settings.queue_wait_objective_secs,
            "flap_window_secs": settings.flap_window_secs,
        },
        "traces": {name: builtin_trace(name).description for name in trace_names()},
        "results": rows,
        "elapsed_s": round(elapsed, 1),
        "python": platform.python_version(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(rows, Path(args.markdown), args.seeds)
    print(f"saved {out} and {args.markdown} ({elapsed:.0f}s)")


if __name__ == "__main__":
    main()
