"""What a flood of anonymous probes costs training: 32 scrapers on the control plane's ``/metrics``, then 32
probers on one engine's ``/health_generate``, against the same run's quiet steps per second.

Both endpoints are open (Prometheus and liveness probes need no secret), so anyone on the host can call them
as fast as they like. Runs the tiny recipe (2 trainer ranks, 2 built-in engines) and, ``--cycles`` times, each
flood between quiet windows: ``/metrics``, ``/health_generate``, the same ``/health_generate`` flood sent with
the engine's key (a caller of the run, which the servers do not pace), and a guarded route asked without the
secret, on the control plane (``/rollout/engines``) and on an engine (``/model_info``): every answer a 401.
A flood's cost is its windows' steps per second against the mean of the quiet windows beside them; steps per
second drift by ±10 % over a run here, so each flood is measured several times, between its own neighbours. The
flood's own CPU is on the same host, as an abusive neighbour's would be; it runs on raw keep-alive sockets in
one thread, so it is small (reported per window).

``--tree DIR`` runs another checkout of Relax (for example the commit before a change, from ``git worktree
add``) with the same workload, so the two compare on one machine:

    python benchmarks/scrape_flood.py [--window 20 --cycles 3] [--floods metrics,engine_401]
                                      [--tree /tmp/relax-before --label before]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import selectors
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from report import save_report

from relax.demo.local import train_argv
from relax.presets.tiny import build_tiny_preset

SCRAPERS = 32
FLOODS = ("metrics", "health_generate", "health_generate_keyed", "control_plane_401", "engine_401")


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


class _Scraper:
    """One keep-alive connection asking for ``request`` again as soon as the last answer is in."""

    def __init__(self, address: tuple[str, int], request: bytes) -> None:
        self.request = request
        self.sock = socket.create_connection(address, timeout=30)
        self.sock.setblocking(False)
        self.buf = bytearray()
        self.sock.send(request)

    def read(self) -> list[int]:
        """The status codes of the answers completed by what arrived (each one sends the next request)."""
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data
        statuses = []
        while (head_end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buf[:head_end]).decode("latin-1").split("\r\n")
            length = next((int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:")), None)
            if length is None:
                raise ConnectionError(f"an answer without Content-Length: {head[0]}")
            if len(self.buf) < head_end + 4 + length:
                break
            del self.buf[:head_end + 4 + length]
            statuses.append(int(head[0].split()[1]))
            self.sock.send(self.request)
        return statuses


def flood(url: str, headers: dict[str, str], seconds: float, scrapers: int) -> dict[str, float]:
    """``scrapers`` keep-alive connections asking ``url`` back to back for ``seconds``, multiplexed on raw
    sockets in this one thread: the flood's own CPU stays small beside what it costs the server (an HTTP
    library would spend more per request than the server does). Returns the answers' rate and the flood's own
    CPU seconds per second."""
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{extra}\r\n".encode()
    selector = selectors.DefaultSelector()
    for _ in range(scrapers):
        scraper = _Scraper(address, request)
        selector.register(scraper.sock, selectors.EVENT_READ, scraper)
    answered = failed = 0
    cpu_began, began = time.process_time(), time.monotonic()
    try:
        while time.monotonic() - began < seconds:
            for key, _ in selector.select(timeout=0.5):
                for status in key.data.read():
                    answered += status == 200
                    failed += status != 200
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()
    took = time.monotonic() - began
    return {"requests_per_s": round((answered + failed) / took, 1), "failed": failed,
            "flood_cpu_s_per_s": round((time.process_time() - cpu_began) / took, 3)}


def window(metrics: Path, seconds: float, load: dict | None = None) -> dict[str, float]:
    """Training steps per second over ``seconds``, with ``load`` (a flood's arguments) running meanwhile."""
    began, rows = time.monotonic(), train_rows(metrics)
    result = flood(**load, seconds=seconds) if load else (time.sleep(seconds) or {})
    took = time.monotonic() - began
    return {"steps_per_s": round((train_rows(metrics) - rows) / took, 3), **result}


def measure(out: Path, preset, seconds: float, tree: str | None, scrapers: int, cycles: int,
            chosen: list[str]) -> dict:
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
        floods = {
            "metrics": {"url": f"{url}/metrics", "headers": {}, "scrapers": scrapers},
            "health_generate": {"url": f"{engine}/health_generate", "headers": {}, "scrapers": scrapers},
            # the same flood from a holder of the engine's key (a router, a script of the run): not paced
            "health_generate_keyed": {"url": f"{engine}/health_generate",
                                      "headers": {"Authorization": f"Bearer {engine_key}"}, "scrapers": scrapers},
            # guarded routes asked without a secret: every answer is a 401
            "control_plane_401": {"url": f"{url}/rollout/engines", "headers": {}, "scrapers": scrapers},
            "engine_401": {"url": f"{engine}/model_info", "headers": {}, "scrapers": scrapers},
        }
        floods = {name: load for name, load in floods.items() if name in chosen}
        windows: list[dict] = []
        for cycle in range(cycles):
            for name, load in floods.items():
                windows.append({"cycle": cycle, "flood": None, **window(metrics, seconds)})
                windows.append({"cycle": cycle, "flood": name, **window(metrics, seconds, load)})
        windows.append({"cycle": cycles, "flood": None, **window(metrics, seconds)})
    finally:
        if driver.poll() is None:
            driver.terminate()  # its SIGTERM path: stop after the step, shut everything down
            try:
                driver.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(driver.pid, 9)
                driver.wait()
    return {"windows": windows, **{f"{name}_flood": flood_cost(windows, name) for name in floods}}


def flood_cost(windows: list[dict], name: str) -> dict[str, float]:
    """A flood's cost: 1 - its windows' mean steps per second over the mean of the quiet windows on either side
    of each (each flood window is compared with its own neighbours, so a drift over the run cancels out)."""
    flooded, quiet, rates = [], [], []
    for i, w in enumerate(windows):
        if w["flood"] == name:
            flooded.append(w["steps_per_s"])
            quiet += [windows[i - 1]["steps_per_s"], windows[i + 1]["steps_per_s"]]
            rates.append(w["requests_per_s"])
    mean_quiet = sum(quiet) / len(quiet)
    return {"cost": round(1 - sum(flooded) / len(flooded) / mean_quiet, 3) if mean_quiet else float("nan"),
            "steps_per_s": round(sum(flooded) / len(flooded), 3), "quiet_steps_per_s": round(mean_quiet, 3),
            "requests_per_s": round(sum(rates) / len(rates), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=20.0, help="seconds per window")
    parser.add_argument("--cycles", type=int, default=3, help="times each flood runs, each between quiet windows")
    parser.add_argument("--scrapers", type=int, default=SCRAPERS)
    parser.add_argument("--floods", default=",".join(FLOODS), help=f"which floods, of {','.join(FLOODS)}")
    parser.add_argument("--tree", help="another checkout of Relax to run instead of this one")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", default="benchmarks/results/scrape_flood.json")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.floods.split(",") if name.strip()]
    if unknown := sorted(set(chosen) - set(FLOODS)):
        parser.error(f"--floods: unknown {', '.join(unknown)}; choose from {', '.join(FLOODS)}")
    with tempfile.TemporaryDirectory(prefix="relax-flood-") as tmp:
        preset = build_tiny_preset(Path(tmp) / "tiny")
        result = measure(Path(tmp) / "run", preset, args.window, args.tree, args.scrapers, args.cycles, chosen)
    save_report({
        "benchmark": "scrape_flood",
        "label": args.label,
        "tree": args.tree or str(Path(__file__).resolve().parents[1]),
        "workload": f"tiny preset, 2 trainer ranks + 2 built-in engines; {args.scrapers} scrapers per flood, "
                    f"{args.cycles} cycles of {args.window:g} s windows",
        **result,
    }, args.out)


if __name__ == "__main__":
    main()
