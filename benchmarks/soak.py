"""Memory soak: does any process of a long training run grow? RSS per process over minutes of training.

Runs the tiny recipe (fully async, 2 trainer ranks, 2 built-in engines, embedded Ray cluster) with a step budget
it never reaches, for ``--minutes``, and samples every ``--interval`` seconds the resident memory of every process
of the run: the driver, Ray's ``gcs_server`` and ``raylet`` (and its dashboard, monitor and agents), the
RolloutManager, the trainer ranks, the engines and the control plane. The run's processes are found by their
session id: the driver starts in a new session (``start_new_session``) and everything of its embedded cluster —
GCS, raylet, every worker — inherits it (Ray gives workers their own process group, not their own session).

Per process the report gives its growth in MB/min, the least-squares slope of RSS over the *second half* of the
samples (the first half is warm-up: imports, allocator pools, the first weight versions), and MB per training
step (the slope of RSS against the step count over the same half). The GCS's own count of task events it keeps
(``Current num of task events stored`` in ``gcs_server.out``) is reported beside it, since that is Ray's main
per-task store.

Everything started is stopped at the end, also on Ctrl-C: SIGTERM to the driver (it shuts its cluster down),
then SIGKILL to whatever of its session is still there.

    python benchmarks/soak.py [--minutes 20] [--interval 30] [--env RAY_x=y ...] [--tree DIR --label L]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from report import machine, save_report

from relax.demo.local import train_argv
from relax.presets.tiny import GRPO_DEFAULTS, build_tiny_preset

MB = 1024 * 1024
RAY_HELPERS = {"dashboard.py": "dashboard", "monitor.py": "autoscaler_monitor", "log_monitor.py": "log_monitor"}
TASK_EVENTS = re.compile(r"Current num of task events stored: (\d+)")


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs; None with fewer than 3 points or no spread in xs."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def train_steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    n = 0
    for line in metrics.read_text().splitlines():
        with contextlib.suppress(ValueError):
            n += json.loads(line).get("kind") == "train"
    return n


def role_of(proc: psutil.Process, driver_pid: int) -> str | None:
    """What a process of the run is; None for an idle pooled worker (it holds nothing of the run)."""
    if proc.pid == driver_pid:
        return "driver"
    name = proc.name()
    if name in ("gcs_server", "raylet"):
        return name
    cmd = proc.cmdline()
    title = cmd[0] if cmd else name
    if title.startswith("ray::"):
        actor = title[5:].split(".", 1)[0].split(" ", 1)[0]  # "ray::TrainerActor.train_step" -> TrainerActor
        return None if actor == "IDLE" else actor
    for arg in cmd[1:3]:
        if Path(arg).name in RAY_HELPERS:
            return RAY_HELPERS[Path(arg).name]
    if "relax.cli" in cmd and "serve" in cmd:  # a built-in engine's HTTP server, started by its EngineActor
        return "engine_guard" if proc.children() else "engine_server"  # relax.engines.guard: the parent watches
    return name


def run_processes(driver_pid: int) -> list[psutil.Process]:
    """The driver's session, and what its processes started in sessions of their own (the engine servers)."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == driver_pid:
                found[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
    alive = []
    for proc in found.values():
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def sample(driver_pid: int, seen: dict[int, psutil.Process]) -> dict[int, tuple[str, float]]:
    """pid -> (role, RSS in MB) for the run's processes now; every process met is kept in ``seen``."""
    out = {}
    for proc in run_processes(driver_pid):
        seen.setdefault(proc.pid, proc)
        try:
            role = role_of(proc, driver_pid)
            if role is not None:
                out[proc.pid] = (role, proc.memory_info().rss / MB)
        except psutil.Error:
            continue
    return out


def task_events_stored(session: Path | None) -> int | None:
    if session is None:
        return None
    path = session / "logs" / "gcs_server.out"
    with contextlib.suppress(OSError):
        found = TASK_EVENTS.findall(path.read_text(errors="replace"))
        return int(found[-1]) if found else None
    return None


def stop_run(driver: subprocess.Popen, seen: dict[int, psutil.Process], grace_s: float = 60.0) -> list[str]:
    """SIGTERM the driver (its own clean stop takes the cluster down), then SIGKILL what is left: its session, and
    any process of the run met while sampling (``psutil.Process`` compares start times, so no reused pid)."""
    sid = driver.pid
    with contextlib.suppress(psutil.Error):
        for proc in run_processes(sid):
            seen.setdefault(proc.pid, proc)
    if driver.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGKILL)
            driver.wait()

    def leftovers() -> list[psutil.Process]:
        procs = {p.pid: p for p in run_processes(sid)}
        for proc in seen.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.setdefault(proc.pid, proc)
        return list(procs.values())

    deadline = time.monotonic() + 15
    left = leftovers()
    while left and time.monotonic() < deadline:  # Ray's processes and the engine servers finish their own exit
        time.sleep(0.5)
        left = leftovers()
    killed = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{proc.pid} {' '.join(proc.cmdline())[:60]}")
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    return killed


def summarise(series: dict[int, dict[str, Any]], times: list[float], steps: list[int],
              warmup_fraction: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per process: growth over the samples after warm-up (MB/min, MB/step); and the run's step rate there."""
    start = int(len(times) * warmup_fraction)
    t_late, s_late = times[start:], steps[start:]
    counts: dict[str, int] = {}
    per_process: dict[str, Any] = {}
    for pid in sorted(series, key=lambda p: (series[p]["role"], p)):
        item = series[pid]
        role = item["role"]
        counts[role] = counts.get(role, 0) + 1
        key = f"{role}-{counts[role] - 1}" if role not in ("driver", "gcs_server", "raylet") else role
        late = [(t, s, r) for t, s, r in item["points"] if t >= t_late[0]] if t_late else []
        if late and late[-1][0] < t_late[-1]:
            late = []  # the process left before the end: no steady-state figure for it
        per_min = slope([t / 60 for t, _, _ in late], [r for _, _, r in late]) if late else None
        per_step = slope([s for _, s, _ in late], [r for _, _, r in late]) if late else None
        per_process[key] = {
            "pid": pid,
            "rss_first_mb": round(item["points"][0][2], 1),
            "rss_last_mb": round(item["points"][-1][2], 1),
            "growth_mb_per_min": None if per_min is None else round(per_min, 3),
            "growth_mb_per_step": None if per_step is None else round(per_step, 5),
            "samples": len(item["points"]),
        }
    minutes_late = (t_late[-1] - t_late[0]) / 60 if len(t_late) > 1 else 0
    run = {
        "samples": len(times),
        "minutes": round(times[-1] / 60, 2) if times else 0,
        "steps": steps[-1] if steps else 0,
        "measured_from_minute": round(t_late[0] / 60, 2) if t_late else None,
        "steps_per_min_measured": round((s_late[-1] - s_late[0]) / minutes_late, 1) if minutes_late else None,
    }
    return per_process, run


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    preset = build_tiny_preset(tmp / "tiny")
    out = tmp / "run"
    grpo = {**GRPO_DEFAULTS, "max_new_tokens": args.max_new_tokens}
    argv = train_argv(preset, out, num_rollout=args.max_steps, max_staleness=1, grpo=grpo)
    env = dict(os.environ)
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    if args.tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.tree, env.get("PYTHONPATH")) if p)
    log_path = tmp / "driver.log"
    launched = time.time()
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  cwd=args.tree or None)
    print(f"soak: driver pid {driver.pid}, {args.minutes} min, sampling every {args.interval} s", file=sys.stderr)
    series: dict[int, dict[str, Any]] = {}
    times: list[float] = []
    steps: list[int] = []
    events: list[int | None] = []
    session: Path | None = None
    seen: dict[int, psutil.Process] = {}
    failed = None
    t0 = time.monotonic()
    try:
        while True:
            now = time.monotonic() - t0
            if driver.poll() is not None:
                failed = f"the driver exited ({driver.returncode}) after {now / 60:.1f} min"
                break
            if session is None:  # this run's: pids wrap around, so an older session may end in the same pid
                root = Path(env.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
                mine = [d for d in root.glob(f"session_*_{driver.pid}") if d.stat().st_mtime >= launched - 1]
                session = max(mine, key=lambda d: d.name, default=None)
            n = train_steps(out / "metrics.jsonl")
            if n > 0:  # the clock starts at the first training step: start-up is not steady state
                if not times:
                    t0 = time.monotonic()
                    now = 0.0
                times.append(now)
                steps.append(n)
                events.append(task_events_stored(session))
                for pid, (role, rss) in sample(driver.pid, seen).items():
                    entry = series.setdefault(pid, {"role": role, "points": []})
                    entry["role"] = role  # an actor's title settles once it is created
                    entry["points"].append((now, n, rss))
                print(f"soak: {now / 60:5.1f} min, step {n}, "
                      + ", ".join(f"{series[p]['role']} {series[p]['points'][-1][2]:.0f}"
                                  for p in sorted(series) if series[p]["points"][-1][0] == now),
                      file=sys.stderr)
                if now >= args.minutes * 60:
                    break
            elif now > args.start_timeout:
                failed = f"no training step after {args.start_timeout} s"
                break
            time.sleep(args.interval if times else 2)
    finally:
        killed = stop_run(driver, seen)
    if failed:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"soak: {failed}; the driver's last lines:\n" + "\n".join(tail))
    per_process, run = summarise(series, times, steps, args.warmup_fraction)
    late = [e for t, e in zip(times, events, strict=True) if e is not None and t >= run["measured_from_minute"] * 60]
    return {
        "run": run,
        "processes": per_process,
        "gcs_task_events_stored": {"first": next((e for e in events if e is not None), None),
                                   "last": events[-1] if events else None,
                                   "max_after_warmup": max(late) if late else None},
        "left_after_stop": killed,
        "series": {k: [(round(t, 1), s, round(r, 1)) for t, s, r in series[v["pid"]]["points"]]
                   for k, v in per_process.items()},
    }


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="training time measured (after the first step)")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--warmup-fraction", type=float, default=0.5,
                        help="the share of samples left out of the growth figures")
    parser.add_argument("--max-new-tokens", type=int, default=int(GRPO_DEFAULTS["max_new_tokens"]))
    parser.add_argument("--max-steps", type=int, default=1_000_000, help="the run's --num-rollout (never reached)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the run (e.g. a RAY_* setting), repeatable")
    parser.add_argument("--tree", help="another checkout of Relax to run instead of this one")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stopped from outside: still stop the run (soak's finally)
        signal.signal(sig, _interrupt)
    with tempfile.TemporaryDirectory(prefix="relax-soak-") as tmp:
        result = soak(args, Path(tmp))
    report = {
        "benchmark": "soak",
        "label": args.label,
        "tree": args.tree or str(Path(__file__).resolve().parents[1]),
        "workload": f"tiny preset, fully async, 2 trainer ranks + 2 built-in engines, embedded Ray cluster, "
                    f"{GRPO_DEFAULTS['rollout_batch_size']}x{GRPO_DEFAULTS['n_samples_per_prompt']} samples/step, "
                    f"{args.max_new_tokens} new tokens",
        "env": args.env,
        "machine": machine(),
        **result,
    }
    series = report.pop("series")
    save_report(report, args.out)
    series_path = Path(args.out).with_suffix(".series.json")  # (t_s, steps, rss_mb) per sample, for plots
    series_path.write_text(json.dumps(series) + "\n")
    worst = max(((k, v["growth_mb_per_min"]) for k, v in report["processes"].items()
                 if v["growth_mb_per_min"] is not None), key=lambda kv: kv[1], default=None)
    if worst:
        print(f"soak: fastest growth {worst[0]} {worst[1]:+.2f} MB/min over minutes "
              f"{report['run']['measured_from_minute']}..{report['run']['minutes']}, "
              f"{report['run']['steps_per_min_measured']} steps/min", file=sys.stderr)


if __name__ == "__main__":
    main()
