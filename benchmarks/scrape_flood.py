"""What a flood of anonymous probes costs training: 32 scrapers on the control plane's ``/metrics``, then 32
probers on one engine's ``/health_generate``, against the same run's quiet steps per second.

Both endpoints are open (Prometheus and liveness probes need no secret), so anyone on the host can call them
as fast as they like. Runs the tiny recipe (2 trainer ranks, 2 built-in engines) for several windows: quiet,
``/metrics`` flood, quiet, ``/health_generate`` flood, quiet; the cost of a flood is its steps per second against
the mean of the quiet windows beside it. The flood's own CPU is on the same host, as an abusive neighbour's
would be.

``--tree DIR`` runs another checkout of Relax (for example the commit before a change, from ``git worktree
add``) with the same workload, so the two compare on one machine:

    python benchmarks/scrape_flood.py [--window 40] [--tree /tmp/relax-before --label before]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
from report import save_report

from relax.demo.local import train_argv
from relax.presets.tiny import build_tiny_preset

SCRAPERS = 32


def train_rows(path: Path) -> int:
    if not path.exists():
        return 0
    count = 0
    for line in path.read_text().splitlines():
        try:
            count += json.loads(line).get("kind") == "train"
        except ValueError:
            continue  # a line being written
    return count


def flood(url: str, headers: dict[str, str], seconds: float, scrapers: int) -> dict[str, float]:
    """``scrapers`` threads asking ``url`` back to back for ``seconds``; returns requests answered and their rate."""
    stop = threading.Event()
    answered = [0] * scrapers
    failed = [0] * scrapers

    def scrape(i: int) -> None:
        with httpx.Client(timeout=30, trust_env=False, headers=headers) as client:
            while not stop.is_set():
                try:
                    ok = client.get(url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                answered[i] += ok
                failed[i] += not ok

    threads = [threading.Thread(target=scrape, args=(i,), daemon=True) for i in range(scrapers)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    return {"requests_per_s": round(sum(answered) / seconds, 1), "failed": sum(failed)}


def window(metrics: Path, seconds: float, load: dict | None = None) -> dict[str, float]:
    """Training steps per second over ``seconds``, with ``load`` (a flood's arguments) running meanwhile."""
    began, rows = time.monotonic(), train_rows(metrics)
    result = flood(**load, seconds=seconds) if load else (time.sleep(seconds) or {})
    took = time.monotonic() - began
    return {"steps_per_s": round((train_rows(metrics) - rows) / took, 3), **result}


def measure(out: Path, preset, seconds: float, tree: str | None, scrapers: int) -> dict:
    argv = train_argv(preset, out, num_rollout=100000, max_staleness=1, extra=("--api-port", "0"))
    engine_key = secrets.token_hex(16)
    env = {**os.environ, "RELAX_ENGINE_API_KEY": engine_key}
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    log_path = out.parent / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  cwd=tree or None)
    try:
        deadline, url = time.monotonic() + 600, None
        while url is None or train_rows(out / "metrics.jsonl") < 5:
            if driver.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the run did not start:\n{log_path.read_text()[-3000:]}")
            found = re.search(r"^relax API: (http://\S+)", log_path.read_text(), re.MULTILINE)
            url = found.group(1) if found else None
            time.sleep(0.5)
        token = (out / "api-token").read_text().strip()
        engines = httpx.get(f"{url}/rollout/engines", headers={"Authorization": f"Bearer {token}"},
                            trust_env=False, timeout=10).json()["models"]["default"]["engines"]
        engine = engines[0]["url"]
        metrics = out / "metrics.jsonl"
        phases = {
            "quiet_1": window(metrics, seconds),
            "metrics_flood": window(metrics, seconds, {"url": f"{url}/metrics", "headers": {}, "scrapers": scrapers}),
            "quiet_2": window(metrics, seconds),
            "health_generate_flood": window(metrics, seconds, {
                "url": f"{engine}/health_generate", "headers": {"Authorization": f"Bearer {engine_key}"},
                "scrapers": scrapers}),
            "quiet_3": window(metrics, seconds),
        }
    finally:
        if driver.poll() is None:
            driver.terminate()  # its SIGTERM path: stop after the step, shut everything down
            try:
                driver.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(driver.pid, 9)
                driver.wait()

    def cost(flooded: str, before: str, after: str) -> float:
        quiet = (phases[before]["steps_per_s"] + phases[after]["steps_per_s"]) / 2
        return round(1 - phases[flooded]["steps_per_s"] / quiet, 3) if quiet else float("nan")

    return {"phases": phases, "metrics_flood_cost": cost("metrics_flood", "quiet_1", "quiet_2"),
            "health_generate_flood_cost": cost("health_generate_flood", "quiet_2", "quiet_3")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=40.0, help="seconds per phase")
    parser.add_argument("--scrapers", type=int, default=SCRAPERS)
    parser.add_argument("--tree", help="another checkout of Relax to run instead of this one")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", default="benchmarks/results/scrape_flood.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-flood-") as tmp:
        preset = build_tiny_preset(Path(tmp) / "tiny")
        result = measure(Path(tmp) / "run", preset, args.window, args.tree, args.scrapers)
    save_report({
        "benchmark": "scrape_flood",
        "label": args.label,
        "tree": args.tree or str(Path(__file__).resolve().parents[1]),
        "workload": f"tiny preset, 2 trainer ranks + 2 built-in engines; {args.scrapers} scrapers per flood, "
                    f"{args.window:g} s per phase",
        **result,
    }, args.out)


if __name__ == "__main__":
    main()
