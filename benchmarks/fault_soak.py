"""Fault soak: the tiny run under engine crashes and scaling at set intervals; what was lost, what failed and why.

The soak of a new user's first week, on one machine: the tiny recipe trains (fully async, built-in engines,
embedded Ray cluster, ``--record-samples``) for ``--minutes``; every ``--kill-every`` seconds an ACTIVE engine's
server process group is SIGKILLed (a crash without notice: the OOM killer, a GPU fault), and every
``--scale-every`` seconds the pool is scaled out to ``--high`` engines or back in to the initial ones through the
REST API. Then the run is stopped with SIGTERM, as ``ray job stop`` does.

Reported:

- **samples**: steps trained; per step, groups missing a sample or holding one twice (``samples.jsonl``); the
  migration counters of the run's summary;
- **engines**: failures by cause (the ``last_error`` of every engine, from ``GET /rollout/engines/{id}``);
- **bring-ups**: per kind of join (initial, replacement, scale-out), decision → ACTIVE and each phase, median;
- **scaling**: every scale request's status and total time;
- **leftovers**: ``/dev/shm`` entries and processes of the run's session that outlive it.

    python benchmarks/fault_soak.py [--minutes 10] [--kill-every 150] [--scale-every 100] [--high 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from report import machine, save_report

from relax.cluster.network import free_port
from relax.demo.elastic import RunApi
from relax.demo.local import train_argv
from relax.presets.tiny import build_tiny_preset
from relax.testing.engine_processes import engine_server_pid

SHM = Path("/dev/shm")


def server_group(driver_pid: int, url: str) -> int | None:
    """The process group of the engine server serving ``url`` (the server leads its own group)."""
    pid = engine_server_pid(driver_pid, url)
    return None if pid is None else os.getpgid(pid)


def samples_report(run_dir: Path) -> dict[str, Any]:
    """Steps, and per step the groups that miss a sample or hold one twice."""
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    by_step: dict[int, dict[int, list[int]]] = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).setdefault(row["prompt_index"], []).append(row["sample_index"])
    n = max((len(v) for groups in by_step.values() for v in groups.values()), default=0)
    incomplete = sum(1 for groups in by_step.values() for v in groups.values() if sorted(set(v)) != list(range(n)))
    duplicated = sum(len(v) - len(set(v)) for groups in by_step.values() for v in groups.values())
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return {"steps": len(by_step), "samples": len(rows), "groups_incomplete": incomplete,
            "samples_duplicated": duplicated,
            **{k: summary.get(k)
               for k in ("migrated_requests", "migration_tokens_kept", "migration_tokens_regenerated")}}


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    preset = build_tiny_preset(tmp / "tiny")
    port, token, out = free_port(), secrets.token_hex(16), tmp / "run"
    argv = train_argv(preset, out, num_rollout=1_000_000, max_staleness=1,
                      extra=("--api-port", str(port), "--record-samples"))
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                       timeout=30, trust_env=False)
    run = RunApi(f"http://127.0.0.1:{port}", token=token)
    shm_before = {p.name for p in SHM.iterdir()}
    log = (tmp / "driver.log").open("w")
    driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "RELAX_API_TOKEN": token})
    session = driver.pid
    kills: list[dict[str, Any]] = []
    scales: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:  # the first step trained
            if driver.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"fault_soak: the run did not start; see {tmp / 'driver.log'}")
            try:
                if run.training_step() >= 1:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(1.0)
        began = time.monotonic()
        next_kill, next_scale, up = began + args.kill_every, began + args.scale_every, True
        while time.monotonic() - began < args.minutes * 60 and driver.poll() is None:
            engines = api.get("/rollout/engines").json()["models"]["default"]["engines"]
            seen.update(e["engine_id"] for e in engines)
            now = time.monotonic()
            if now >= next_kill:
                active = [e for e in engines if e["status"] == "ACTIVE" and e["url"]]
                victim = active[len(kills) % len(active)] if active else None
                group = server_group(driver.pid, victim["url"]) if victim else None
                if group is not None:
                    os.killpg(group, signal.SIGKILL)
                    kills.append({"engine_id": victim["engine_id"], "at_s": round(now - began, 1)})
                next_kill = now + args.kill_every
            if now >= next_scale:
                path, target = ("/rollout/scale_out", args.high) if up else ("/rollout/scale_in", args.low)
                answer = api.post(path, json={"num_replicas": target})
                scales.append({"path": path, "target": target, "status_code": answer.status_code,
                               "answer": answer.json(), "at_s": round(now - began, 1)})
                up, next_scale = not up, now + args.scale_every
            time.sleep(1.0)
        requests = {direction: api.get(f"/rollout/{direction}").json() for direction in ("scale_out", "scale_in")}
        details = {}
        for engine_id in sorted(seen | {f"engine_{i}" for i in range(64)}):
            answer = api.get(f"/rollout/engines/{engine_id}")
            if answer.status_code == 200:
                details[engine_id] = answer.json()
    finally:
        stop_began = time.monotonic()
        if driver.poll() is None:
            driver.send_signal(signal.SIGTERM)
            try:
                driver.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(session, signal.SIGKILL)
                driver.wait()
        stop_s = time.monotonic() - stop_began
        log.close()
        api.close()
    time.sleep(2.0)  # let the kernel reap what the driver's end stopped
    left = [p.pid for p in psutil.process_iter() if _session(p) == session]
    shm_left = sorted({p.name for p in SHM.iterdir()} - shm_before)
    return {"samples": samples_report(out), "kills": kills, "scale_calls": scales,
            "scale_requests": {d: [{k: r.get(k) for k in ("request_id", "status", "error", "timings")} for r in rs]
                               for d, rs in requests.items()},
            "failures_by_cause": _causes(details), "bring_ups": _bring_ups(details), "stop_s": round(stop_s, 1),
            "driver_exit": driver.returncode, "leftover_processes": left, "leftover_shm": shm_left}


def _session(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _causes(details: dict[str, dict[str, Any]]) -> dict[str, int]:
    causes: dict[str, int] = {}
    for view in details.values():
        if view["status"] == "FAILED":
            cause = (view.get("last_error") or "?").split(";")[0][:120]
            causes[cause] = causes.get(cause, 0) + 1
    return causes


def _bring_ups(details: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for engine_id, view in details.items():
        bring_up = view.get("bring_up") or {}
        if bring_up.get("outcome") != "ACTIVE":
            continue
        kind = view["kind"] if view["kind"] != "initial" or engine_id in ("engine_0", "engine_1") else "replacement"
        kinds.setdefault(kind, []).append(bring_up)
    return {kind: {"count": len(rows), "decision_to_active_s_median": statistics.median(r["total_s"] for r in rows),
                   "phases_median_s": {p: round(statistics.median(r["phases"].get(p, 0.0) for r in rows), 3)
                                       for p in sorted({p for r in rows for p in r["phases"]})}}
            for kind, rows in kinds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=150.0, help="seconds between two engine crashes")
    parser.add_argument("--scale-every", type=float, default=100.0, help="seconds between two scale requests")
    parser.add_argument("--high", type=int, default=3, help="scale-out target (the initial engines are 2)")
    parser.add_argument("--low", type=int, default=2, help="scale-in target")
    parser.add_argument("--start-timeout", type=float, default=420.0)
    parser.add_argument("--out", default="benchmarks/results/fault_soak.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-fault-soak-") as tmp:
        result = soak(args, Path(tmp))
    save_report({"benchmark": "fault_soak", "machine": machine(), "minutes": args.minutes,
                 "kill_every_s": args.kill_every, "scale_every_s": args.scale_every, **result}, args.out)


if __name__ == "__main__":
    main()
