"""Preemption and crashes with generations in flight: migrate, drain-then-retry, abort-and-restart, crash (JSON).

Runs ``relax.testing.eviction_scenario`` (a local elastic cluster, a notice through Ray's drain API while an
elastic engine is mid-way through its requests) once per mode and reports, per mode: tokens kept vs
regenerated, the time to complete the affected samples, samples lost, and notice → engine gone. The last
line printed is a JSON object with the migrate mode's ``lost_samples``, ``tokens_kept_fraction`` and
``gone_before_deadline``, and ``crash``: the same engine SIGKILLed half-way through its responses without notice
(``{"lost_samples", "tokens_kept_fraction"}``, the share of the tokens generated before the kill that the samples
kept); every mode in full under ``modes`` of the saved report.

    python benchmarks/eviction.py [--quick] [--deadline 20] [--out FILE]

``--quick`` runs the migrate and crash modes only (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from report import machine, save_report

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def main() -> int:
    from relax.testing import eviction_scenario

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the migrate and crash modes only")
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "eviction.json"))
    args = parser.parse_args()
    modes = "migrate,crash" if args.quick else "migrate,crash,retry,abort"
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = eviction_scenario.main(["--modes", modes, "--deadline", str(args.deadline), "--json"])
    results = [json.loads(line) for line in captured.getvalue().splitlines() if line.startswith("{")]
    by_mode = {r["mode"]: r for r in results}
    migrate = by_mode.get("migrate", {})
    crash = by_mode.get("crash", {})
    report = {"benchmark": "eviction", "machine": machine(), "deadline_s": args.deadline, "modes": by_mode,
              "lost_samples": sum(r["lost_samples"] for r in results),
              "tokens_kept_fraction": migrate.get("tokens_kept_fraction"),
              "gone_before_deadline": migrate.get("gone_before_deadline"),
              "crash": {"lost_samples": crash.get("lost_samples"),
                        "tokens_kept_fraction": crash.get("tokens_kept_fraction")}}
    save_report(report, args.out)
    print(json.dumps({k: report[k] for k in ("lost_samples", "tokens_kept_fraction", "gone_before_deadline", "crash")}))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
