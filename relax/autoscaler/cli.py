"""``relax autoscaler simulate``: replay a load trace against a simulated pool and the real autoscaler policy.

    relax autoscaler simulate --trace step --policy relax
    relax autoscaler simulate --trace my-load.csv --policy relax-defaults --config autoscaler.yaml --json
    relax autoscaler simulate --trace rl-phases --policy static:max

Prints a summary table (cost in engine-seconds, queue wait, scale actions, engines over time) or, with
``--json``, the whole report. Exit codes: 0 done; 2 the request is wrong (unknown trace or policy, a
trace file or config that does not parse) -- one line on stderr that says what to fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from relax.autoscaler.traces import Trace, TraceError, load_trace, trace_names

if TYPE_CHECKING:
    from rich.console import Console

    from relax.autoscaler.config import AutoscalerConfig
    from relax.autoscaler.simulator import SimulationResult

__all__ = ["add_autoscaler_parser", "engines_strip", "render_result", "run_simulate"]

EXIT_OK, EXIT_USAGE = 0, 2
_COMMAND = "relax autoscaler simulate"


def add_autoscaler_parser(subparsers: Any) -> None:
    """Register ``autoscaler simulate`` on ``relax``'s sub-parsers; ``func`` returns the exit code."""
    autoscaler = subparsers.add_parser("autoscaler", help="autoscaler tools (simulate a policy on a load trace)",
                                       description="Tools for the rollout pool's autoscaler.")
    actions = autoscaler.add_subparsers(dest="autoscaler_command", metavar="ACTION", required=True)
    sim = actions.add_parser(
        "simulate", help="replay a load trace against the real autoscaler policy on simulated engines",
        description="Replay a request-rate trace against simulated engines driven by the real autoscaler "
        "policy, and report cost (engine-seconds) against queue wait.",
    )
    sim.add_argument("--trace", required=True, metavar="NAME|FILE",
                     help=f"a built-in trace ({', '.join(trace_names())}) or a CSV (t_secs,rate) / JSONL file")
    sim.add_argument("--policy", default="relax", metavar="POLICY",
                     help="relax (tuned settings), relax-defaults (documented defaults), static:N, static:min "
                     "or static:max (N fixed engines, no autoscaler); default relax")
    sim.add_argument("--config", default=None, metavar="YAML",
                     help="an --autoscaler-config file: relax-defaults runs it as is, relax lays the keys it sets "
                     "over the tuned settings, static:min|max take its bounds (default bounds: 4..8)")
    sim.add_argument("--seed", type=int, default=0, help="random seed of arrivals and start-up times (default 0)")
    sim.add_argument("--json", action="store_true", help="print the full report as JSON")
    sim.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    """The ``simulate`` command: resolve trace, config and policy, run, print."""
    # Imported here, not at the top, so registering the command keeps `relax --help` fast.
    from rich.console import Console

    from relax.autoscaler.config import AutoscalerConfigError
    from relax.autoscaler.simulator import PolicyError, SimulationSettings, parse_policy, simulate

    try:
        trace = load_trace(args.trace)
        user_config = _load_config(args.config) if args.config else None
        policy = parse_policy(args.policy, user_config)
        result = simulate(trace, policy, SimulationSettings(seed=args.seed))
    except (TraceError, PolicyError, AutoscalerConfigError) as error:
        print(f"{_COMMAND}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        render_result(result, trace, Console())
    return EXIT_OK


def _load_config(path: str) -> AutoscalerConfig:
    from relax.autoscaler.config import AutoscalerConfigError, load_autoscaler_config

    try:
        return load_autoscaler_config(path)
    except AutoscalerConfigError as error:  # same file format, but this command's flag is --config
        raise AutoscalerConfigError(str(error).replace("--autoscaler-config ", "--config ", 1)) from None


def _clock(secs: float) -> str:
    minutes, seconds = divmod(int(round(secs)), 60)
    return f"{minutes}:{seconds:02d}"


def engines_strip(result: SimulationResult) -> str:
    """ACTIVE engines at each timeline point as one character each (``+`` for 10 or more)."""
    return "".join(str(p["active"]) if p["active"] < 10 else "+" for p in result.timeline)


def _why(reason: str) -> str:
    """The informative part of a policy reason: its first two clauses after the headline, minus coverage."""
    clauses = reason.split(": ", 1)[-1].split("; ")
    kept = [c for c in clauses if not c.startswith("metrics coverage")] or clauses
    return "; ".join(kept[:2])


def render_result(result: SimulationResult, trace: Trace, console: Console) -> None:
    """The human view: what ran, the numbers that matter, engines over time, the scale actions."""
    from rich.table import Table

    summary = result.summary()
    console.print(f"[bold]trace[/] {result.trace} -- {trace.description}")
    console.print(f"[bold]policy[/] {result.policy}, seed {result.seed}, {result.duration_secs / 60:g} min simulated")
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    waits = (summary["queue_wait_p50_s"], summary["queue_wait_p95_s"], summary["queue_wait_p99_s"])
    rows = [
        ("cost (engine-seconds)", f"{summary['engine_seconds']:,.0f}  (mean {summary['mean_engines']:.2f} engines)"),
        ("queue wait P50 / P95 / P99", " / ".join(f"{w:.2f}" for w in waits) + " s"),
        ("queue wait max", f"{summary['queue_wait_max_s']:.1f} s"),
        ("TTFT P95", "-" if summary["ttft_p95_s"] is None else f"{summary['ttft_p95_s']:.2f} s"),
        (f"time with queue wait > {result.queue_wait_objective_secs:g} s", f"{summary['secs_above_objective']:.0f} s"),
        ("scale actions (out / in)", f"{result.scale_actions} ({result.scale_outs} / {result.scale_ins})"),
        ("direction reversals (flapping)", str(result.reversals)),
        ("final / peak engines", f"{result.final_engines} / {result.peak_engines}"),
        ("requests completed", f"{result.completed:,} of {result.requests:,}"),
    ]
    if result.rejected:
        rows.append(("rejected scale requests", str(result.rejected)))
    if result.trainer_wait_secs is not None:
        rows.append(("trainer waiting for data", f"{result.trainer_wait_secs:.0f} s"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"[bold]engines per minute[/] {engines_strip(result)}")
    if result.actions:
        actions = Table(show_header=True, header_style="bold", title="scale actions")
        for column in ("t", "action", "engines", "why"):
            actions.add_column(column)
        for record in result.actions[-20:]:
            status = "" if record.accepted else " (rejected)"
            why = _why(record.reason)
            actions.add_row(_clock(record.t), record.action + status, f"{record.from_engines} -> {record.to_engines}",
                            why)
        console.print(actions)
