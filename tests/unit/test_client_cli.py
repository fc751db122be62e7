"""``relax engines | scale-out | scale-in | events`` against a real control plane on 127.0.0.1.

One :class:`ControlPlane` (uvicorn on a real socket, token on) serves a :class:`LocalRollout` from a
background thread for the whole module; the CLI talks to it over HTTP exactly as an operator would. Tests
that change the pool put it back, so they do not depend on their order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from relax import cli, client_cli
from relax.rollout.control.server import ControlPlane
from relax.testing.local_rollout import LocalRollout

TOKEN = "cli-test-token"


class Server:
    """A control plane served from its own event loop thread (the CLI under test blocks the caller)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="control-plane", daemon=True)
        self.thread.start()
        self.backend = LocalRollout(initial_engines=2, step_delay_s=0.02, verify=self.verify)
        self.plane = ControlPlane(self.backend, "127.0.0.1", 0, TOKEN)
        self.url = self.call(self.plane.start())

    @staticmethod
    async def verify(engine_id: str) -> dict[str, Any]:
        """A check on demand, as the rollout manager answers it (engine_1's needed one full reload)."""
        return {"engine_id": engine_id, "version": 3, "result": "verified", "expected_digest": "ab12" * 16,
                "served_digest": "ab12" * 16, "mismatched": [], "seconds": 0.25,
                "attempt": 1 if engine_id == "engine_1" else 0}

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self) -> None:
        self.call(self.backend.wait_idle())

    def close(self) -> None:
        self.call(self.plane.stop())
        self.call(self.backend.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.close()


@pytest.fixture
def relax(server, monkeypatch, capsys):
    """Run a client command against the server; returns ``(exit code, stdout, stderr)``."""
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    monkeypatch.delenv("RELAX_API_URL", raising=False)

    def run(*argv: str, url: str | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main([*argv, "--url", url or server.url])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def restore_pool(server, relax):
    """Put the pool back to its two initial engines after a test that scaled it."""
    yield
    server.backend.paused = False
    server.wait_idle()
    code, _, err = relax("scale-in", "2", "--wait", "--poll-interval", "0.05")
    assert code == 0, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- parsers ------------------------------------------------------------------------------------------


def test_add_client_parsers_registers_the_four_commands():
    parser = argparse.ArgumentParser(prog="relax")
    client_cli.add_client_parsers(parser.add_subparsers(dest="command"))
    for argv in (["engines"], ["scale-out", "6"], ["scale-in", "4", "--force", "--dry-run"], ["events"]):
        args = parser.parse_args(argv)
        assert callable(args.func), argv
    args = parser.parse_args(["scale-out", "--urls", "http://a:1", "http://b:2", "--timeout", "60", "--wait"])
    assert args.urls == ["http://a:1", "http://b:2"] and args.timeout == 60.0 and args.wait
    assert parser.parse_args(["events"]).limit == 20


def test_usage_errors_exit_2(relax, capsys):
    assert cli.main(["scale-out", "six"]) == 2
    assert "invalid int value" in capsys.readouterr().err
    code, _, err = relax("scale-out")
    assert code == 2 and "give N" in err
    assert cli.main(["--help"]) == 0


# -- engines ------------------------------------------------------------------------------------------


def test_engines_table(relax):
    code, out, err = relax("engines")
    assert code == 0, err
    for text in ("ENGINE", "engine_0", "engine_1", "initial", "ACTIVE", "http://127.0.0.1:30000", "v0",
                 "node-stable-0", "IN-FLIGHT"):
        assert text in out, text
    assert "2 engine(s), 2 active" in out


def test_the_engines_table_shows_each_engines_weights_digest_and_whether_a_check_verified_it():
    body = {"models": {"default": {"engines": [
        {"engine_id": "engine_0", "status": "ACTIVE", "weight_version": 3, "weight_digest": "ab12" * 16,
         "weights_verified": True},
        {"engine_id": "engine_1", "status": "ACTIVE", "weight_version": 3, "weight_digest": "cd34" * 16},
        {"engine_id": "engine_2", "status": "STARTING", "weight_version": None}]}}}
    console = Console(width=200, record=True)
    console.print(client_cli.engines_table(body))
    text = console.export_text()  # (export_text clears the recording)
    rows = {line.split()[1]: line for line in text.splitlines() if "engine_" in line}
    assert "v3" in rows["engine_0"] and "ab12ab12ab12 verified" in rows["engine_0"]
    assert "cd34cd34cd34" in rows["engine_1"] and "verified" not in rows["engine_1"]
    assert "DIGEST" in text


def test_the_engines_table_shows_each_bring_up_phase_by_phase():
    body = {"models": {"default": {"engines": [
        {"engine_id": "engine_4", "status": "ACTIVE", "bring_up": {
            "phases": {"capacity": 41.2, "actor": 1.0, "prepare": 0.01, "server_start": 19.4, "first_answer": 0.3,
                       "weight_sync": 0.21, "verify": 0.08},
            "current": None, "current_for_s": None, "total_s": 62.2, "outcome": "ACTIVE"}},
        {"engine_id": "engine_5", "status": "HEALTH_CHECKING", "bring_up": {
            "phases": {"capacity": 2.0, "actor": 0.9, "server_start": 18.0}, "current": "first_answer",
            "current_for_s": 0.4, "total_s": 21.3, "outcome": None}}]}}}
    console = Console(width=260, record=True)
    console.print(client_cli.engines_table(body))
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if "engine_" in line}
    assert "cap 41.2 · actor 1.0 · server 19.4 · answer 0.3 · sync 0.2 · verify 0.1 = 62.2s" in rows["engine_4"]
    assert "prep" not in rows["engine_4"]  # a phase under 0.05 s is left out of the line (its figure stays in the API)
    assert "cap 2.0 · actor 0.9 · server 18.0 · answer 0.4… " in rows["engine_5"]
    assert client_cli.bring_up_text(None) == "-"
    assert client_cli.bring_up_text({"phases": {"capacity": 300.0}, "total_s": 300.0,
                                     "outcome": "not ACTIVE within the scale-out timeout (300 s)"}).startswith(
        "cap 300.0 = 300.0s (not ACTIVE within the scale-out timeout")


def test_verify_prints_one_line_per_check_and_fails_for_an_engine_that_still_differs(relax):
    code, out, err = relax("engines", "--verify", "engine_0")
    assert code == 0, err
    assert out.strip() == "engine_0: weights v3 verified (digest ab12ab12ab12) in 0.25s"
    code, out, _ = relax("engines", "--verify", "engine_1")
    assert code == 0 and "after one full reload" in out
    code, out, err = relax("engines", "--verify", "engine_7")
    assert code == 2 and out == "" and "404: unknown engine id 'engine_7'" in err and len(err.strip().splitlines()) == 1
    failed = client_cli.verification_line({"engine_id": "engine_2", "version": 4, "result": "mismatch",
                                           "expected_digest": "ab" * 32, "served_digest": "cd" * 32,
                                           "mismatched": ["model.norm.weight"], "seconds": 0.1, "attempt": 1})
    assert failed.startswith("engine_2: serves other weights than v4 even after a full reload (digest cdcdcdcdcdcd")
    assert "model.norm.weight" in failed and failed.endswith("the engine was failed")


def test_engines_json(relax):
    code, out, _ = relax("engines", "--json")
    assert code == 0
    assert json.loads(out)["total_engines"] == 2


def test_url_from_environment(server, monkeypatch, capsys):
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    monkeypatch.setenv("RELAX_API_URL", server.url + "/")
    assert cli.main(["engines"]) == 0
    assert "engine_0" in capsys.readouterr().out


# -- errors ---------------------------------------------------------------------------------------------


def test_unreachable_url_is_one_line_exit_1(relax):
    code, out, err = relax("engines", url=f"http://127.0.0.1:{_free_port()}")
    assert code == 1 and out == ""
    assert err.startswith("relax engines: cannot reach the Relax control plane at http://127.0.0.1:")
    assert "RELAX_API_URL" in err and len(err.strip().splitlines()) == 1


def test_bad_url_exit_2(relax):
    code, _, err = relax("engines", url="127.0.0.1:8000")
    assert code == 2 and "http://" in err


def test_missing_and_wrong_token_401(relax, monkeypatch, tmp_path):
    monkeypatch.delenv("RELAX_API_TOKEN")
    monkeypatch.setenv("HOME", str(tmp_path))  # no run on this machine wrote a token for the port
    code, _, err = relax("engines")
    assert code == 2 and "401" in err and "set RELAX_API_TOKEN" in err
    monkeypatch.setenv("RELAX_API_TOKEN", "nope")
    code, _, err = relax("events")
    assert code == 2 and "was rejected" in err


def test_the_token_a_run_wrote_on_this_machine_is_found_without_the_variable(relax, server, monkeypatch, tmp_path):
    from relax.cluster.api_token import publish_token

    monkeypatch.delenv("RELAX_API_TOKEN")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    [lookup] = publish_token(TOKEN, server.url)  # what the driver does, for the port the server bound
    code, out, _ = relax("engines", "--json")
    assert code == 0 and "engines" in out
    assert lookup.stat().st_mode & 0o777 == 0o600 and lookup.parent.stat().st_mode & 0o777 == 0o700


class Eavesdropper:
    """Someone else's listener on the run's port at another address: records every Authorization it gets."""

    def __init__(self, host: str, port: int) -> None:
        import http.server

        heard = self.heard = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                heard.append(self.headers.get("Authorization"))
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("Server", (http.server.ThreadingHTTPServer,), {"address_family": family})
        self.server = server_class((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_listener_on_the_same_port_at_another_address_never_gets_the_token(relax, server, monkeypatch, tmp_path):
    from urllib.parse import urlsplit

    from relax.cluster.api_token import publish_token

    monkeypatch.delenv("RELAX_API_TOKEN")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    port = urlsplit(server.url).port
    publish_token(TOKEN, server.url)  # the run listens on 127.0.0.1:port
    others = [Eavesdropper("127.0.0.2", port), Eavesdropper("::1", port)]
    try:
        for url in (f"http://127.0.0.2:{port}", f"http://[::1]:{port}"):
            code, _, err = relax("engines", url=url)
            assert code == 2 and "401" in err, err
        # a name goes to the literal address the run listens on, wherever else it resolves
        code, out, _ = relax("engines", "--json", url=f"http://localhost:{port}")
        assert code == 0 and "engines" in out
    finally:
        for other in others:
            other.close()
    assert [other.heard for other in others] == [[None], [None]]  # each was asked, never with the token


def test_not_a_control_plane_url(relax, server):
    code, _, err = relax("engines", url=server.url + "/autoscaler")
    assert code == 2 and "not a route" in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("scale-in", "1"), "400: num_replicas: 1 is below the initial engine count 2"),
        (("scale-out", "1"), "400: num_replicas: 1 is below the initial engine count 2"),
        (("scale-in", "-1"), "422: num_replicas: input should be greater than or equal to 0"),
        (("scale-out", "--urls", "http://10.0.0.1:30000/generate"), "422: engine_urls.0: engine URL"),
        (("scale-out", "4", "--urls", "http://10.0.0.1:30000"), "not both"),
        (("scale-out", "4", "--model-name", "llama"), "404: model_name: unknown model 'llama'"),
        (("scale-out", "--show", "so-999"), "404: unknown scale_out request id 'so-999'"),
        (("events", "--limit", "0"), "422: limit"),
        (("events", "--kind", "bogus"), "422: kind"),
    ],
)
def test_4xx_details_are_shown_with_exit_2(relax, server, argv, words):
    code, out, err = relax(*argv)
    assert code == 2, (out, err)
    assert err.startswith(f"relax {argv[0]}: ") and words in err, err
    assert server.backend.registry.running() is None


# -- scale-out / scale-in ---------------------------------------------------------------------------------


def test_scale_out_wait_then_scale_in_wait(relax, server, restore_pool):
    code, out, err = relax("scale-out", "4", "--wait", "--poll-interval", "0.05")
    assert code == 0, err
    assert "accepted" in out and "ACTIVE" in out
    request_id = out.split("scale-out request ", 1)[1].split()[0]
    for text in ("ray_native", "target 4 (from 2)", "PLACEMENT", "WEIGHTS", "HEALTH_CHECKING"):
        assert text in out, text

    code, out, _ = relax("scale-out", "--list")
    assert code == 0 and request_id in out and "ACTIVE" in out

    code, out, _ = relax("scale-in", "3", "--dry-run")
    assert code == 0 and "dry run" in out and "would remove" in out
    newest = max(e["engine_id"] for e in server.backend.pool.to_dict()["engines"])
    assert newest in out

    code, out, err = relax("scale-in", "2", "--wait", "--poll-interval", "0.05")
    assert code == 0, err
    assert "COMPLETED" in out and "DRAIN" in out and "SHUTDOWN" in out


def test_scale_out_accepted_without_wait_then_show(relax, server, restore_pool):
    code, out, _ = relax("scale-out", "3")
    assert code == 0 and "accepted" in out and "--show" in out
    request_id = out.split("scale-out request ", 1)[1].split()[0]
    server.wait_idle()
    code, out, _ = relax("scale-out", "--show", request_id, "--json")
    assert code == 0 and json.loads(out)["status"] == "ACTIVE"


def test_noop_exits_0(relax):
    code, out, _ = relax("scale-out", "2")
    assert code == 0 and "NOOP" in out and "already met" in out


def test_409_conflict_then_cancel(relax, server, restore_pool):
    server.backend.paused = True
    code, out, _ = relax("scale-out", "4")
    assert code == 0
    running = out.split("scale-out request ", 1)[1].split()[0]

    code, _, err = relax("scale-out", "5")
    assert code == 1 and "409 conflict" in err and f"relax scale-out --cancel {running}" in err

    code, out, _ = relax("scale-out", "--cancel", running)
    assert code == 0 and "cancel requested" in out
    server.backend.paused = False
    server.wait_idle()
    code, out, _ = relax("scale-out", "--show", running)
    assert code == 0 and "CANCELLED" in out and "cancel requested" in out


def test_wait_on_a_failed_scale_out_exits_1(relax, server, restore_pool):
    server.backend.unreachable_urls.add("http://10.1.2.3:30000")
    try:
        code, out, _ = relax("scale-out", "--urls", "http://10.1.2.3:30000", "--wait", "--poll-interval", "0.05")
    finally:
        server.backend.unreachable_urls.clear()
    assert code == 1
    assert "FAILED" in out and "connection refused" in out


# -- events -----------------------------------------------------------------------------------------------


def test_events_table_newest_first(relax, server, restore_pool):
    assert relax("scale-out", "3", "--wait", "--poll-interval", "0.05")[0] == 0
    code, out, _ = relax("events", "--limit", "3")
    assert code == 0
    assert "SEQ" in out and "scale_completed" in out
    total = server.backend.event_log.total
    assert f"showing 3 of {total} event(s)" in out
    seqs = [int(line.split("│")[1]) for line in out.splitlines() if line.startswith("│")]
    assert seqs == sorted(seqs, reverse=True) and len(seqs) == 3

    code, out, _ = relax("events", "--kind", "scale_out_requested", "--json")
    assert code == 0 and {e["kind"] for e in json.loads(out)["events"]} == {"scale_out_requested"}


def test_wait_with_json_keeps_stdout_parseable(relax, restore_pool):
    code, out, err = relax("scale-out", "3", "--wait", "--json", "--poll-interval", "0.05")
    assert code == 0, err
    record = json.loads(out)
    assert record["status"] == "ACTIVE" and record["direction"] == "scale_out"
    assert "accepted" in err  # progress went to stderr
