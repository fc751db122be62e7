"""``relax engines | scale-out | scale-in | events``: the operator's view of a running Relax control plane.

Thin HTTP clients of the ``/rollout`` REST contract (docs/elastic.md): they send what the operator typed
and print what the control plane answered. No scaling rule is re-checked here (``num_replicas`` below the
initial count, unknown fields...): the server owns the rules and its messages name the field, so the CLI
shows them as they are.

The control plane URL comes from ``--url``, else ``$RELAX_API_URL``, else ``http://127.0.0.1:8000``. The
bearer token comes only from ``$RELAX_API_TOKEN``: a token on the command line would end up in shell
history and in ``ps`` output on a shared login node.

Exit codes: 0 done; 1 the operation did not succeed (control plane unreachable, server error, 409 conflict,
or with ``--wait`` a request that ended FAILED, PARTIAL or CANCELLED); 2 the request itself is wrong
(bad arguments, 401, other 4xx).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from rich.text import Text

from relax import argtypes

__all__ = ["DEFAULT_URL", "ApiClient", "ApiError", "add_client_parsers"]

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "RELAX_API_URL"
TOKEN_ENV = "RELAX_API_TOKEN"
HTTP_TIMEOUT_S = 10.0

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

TERMINAL = {
    "scale_out": frozenset({"ACTIVE", "PARTIAL", "FAILED", "CANCELLED"}),
    "scale_in": frozenset({"COMPLETED", "FAILED"}),
}
SUCCESS = frozenset({"ACTIVE", "COMPLETED"})

_STATUS_STYLE = {
    "ACTIVE": "green",
    "COMPLETED": "green",
    "PENDING": "yellow",
    "STARTING": "yellow",
    "CREATING": "yellow",
    "CONNECTING": "yellow",
    "HEALTH_CHECKING": "yellow",
    "WEIGHT_SYNCING": "cyan",
    "DRAINING": "magenta",
    "REMOVING": "magenta",
    "REMOVED": "dim",
    "PARTIAL": "red",
    "FAILED": "bold red",
    "CANCELLED": "dim",
    "NOOP": "green",
    "DRY_RUN": "cyan",
}


class ApiError(Exception):
    """A failed call, already worded for the operator; ``exit_code`` is what the command returns."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status


class ApiClient:
    """A small synchronous client of the control plane, with errors turned into :class:`ApiError`."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = HTTP_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.token = token or None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        except (httpx.InvalidURL, ValueError) as exc:
            raise ApiError(f"invalid control plane URL {url!r}: {exc}", EXIT_USAGE) from None
        self._timeout = timeout

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, json_body: Any = None, params: Mapping[str, Any] | None = None) -> Any:
        """One call; returns the decoded JSON of a 2xx answer, raises :class:`ApiError` otherwise."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, json=json_body, params=query)
        except httpx.UnsupportedProtocol:
            raise ApiError(f"invalid control plane URL {self.url!r}: it must start with http:// or https://",
                           EXIT_USAGE) from None
        except httpx.InvalidURL as exc:
            raise ApiError(f"invalid control plane URL {self.url!r}: {exc}", EXIT_USAGE) from None
        except httpx.TimeoutException:
            raise ApiError(f"the control plane at {self.url} did not answer within {self._timeout:g}s") from None
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            raise ApiError(
                f"cannot reach the Relax control plane at {self.url} ({reason}); is the run up, and is --url "
                f"(or ${URL_ENV}) right?"
            ) from None
        if response.is_success:
            try:
                return response.json()
            except ValueError:
                raise ApiError(f"{self.url}{path} answered {response.status_code} with non-JSON content: "
                               f"{_clip(response.text)!r}; is that a Relax control plane?") from None
        raise self._error(response)

    def _error(self, response: httpx.Response) -> ApiError:
        status = response.status_code
        try:
            body = response.json()
        except ValueError:
            body = None
        detail = body.get("detail") if isinstance(body, dict) else None
        if not isinstance(detail, str):
            detail = _clip(response.text) if detail is None else json.dumps(detail)
        if status == 401:
            if not self.token:
                message = (f"401 unauthorized: this control plane requires the run's token; set {TOKEN_ENV}="
                           "$(cat <output dir>/api-token) (without it, a run on this machine is found only at the "
                           "exact address of its 'relax API:' line)")
            else:
                message = f"401 unauthorized: the run's token ({TOKEN_ENV} or its token file) was rejected ({detail})"
            return ApiError(message, EXIT_USAGE, status=status)
        if status == 409:
            running = body.get("running_request_id") if isinstance(body, dict) else None
            extra = ""
            if isinstance(running, str):
                command = "scale-out" if running.startswith("so-") else "scale-in"
                extra = f" [follow it: relax {command} --show {running}" + (
                    f"; cancel it: relax scale-out --cancel {running}]" if command == "scale-out" else "]"
                )
            return ApiError(f"409 conflict: {detail}{extra}", EXIT_FAILED, status=status)
        if status == 404 and detail == "Not Found":
            return ApiError(f"404: {response.request.url.path} is not a route of {self.url}; is that a Relax "
                            "control plane (and not an engine or the autoscaler URL)?", EXIT_USAGE, status=status)
        if 400 <= status < 500:
            return ApiError(f"{status}: {detail}", EXIT_USAGE, status=status)
        return ApiError(f"server error {status}: {detail}", EXIT_FAILED, status=status)


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- rendering -----------------------------------------------------------------------------------------


def _console(stream: Any = None) -> Console:
    """A console on ``stream`` (stdout by default); wide when piped, so URLs and ids are never cut."""
    stream = stream or sys.stdout
    interactive = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream, width=None if interactive else 200, soft_wrap=False, highlight=False)


def _status(value: Any) -> Text:
    text = "-" if value is None else str(value)
    return Text(text, style=_STATUS_STYLE.get(text, ""))


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _secs(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f}s"


def _when(timestamp: Any) -> str:
    if timestamp is None:
        return "-"
    moment = datetime.fromtimestamp(float(timestamp))
    fmt = "%H:%M:%S" if moment.date() == datetime.now().date() else "%Y-%m-%d %H:%M:%S"
    return moment.strftime(fmt)


def _node(node_id: Any) -> str:
    text = _cell(node_id)
    return text if len(text) <= 16 else text[:12] + "…"


def engines_table(body: Mapping[str, Any]) -> Table:
    """``GET /rollout/engines`` as a table: one row per engine, all models."""
    table = Table(title="Rollout engines", title_justify="left")
    for column in ("ENGINE", "KIND", "STATUS", "URL", "WEIGHTS", "DIGEST", "IN-FLIGHT", "NODE", "JOINED",
                   "BRING-UP"):
        table.add_column(column, no_wrap=True,
                         justify="right" if column in ("WEIGHTS", "IN-FLIGHT", "JOINED") else "left")
    for model, group in (body.get("models") or {}).items():
        for engine in group.get("engines", []):
            version = engine.get("weight_version")
            table.add_row(
                engine.get("engine_id", "?") + ("" if model == "default" else f" ({model})"),
                _cell(engine.get("kind")),
                _status(engine.get("status")),
                _cell(engine.get("url")),
                "-" if version is None else f"v{version}",
                _digest(engine),
                _cell(engine.get("in_flight")),
                _node(engine.get("node_id")),
                _joined(engine),
                bring_up_text(engine.get("bring_up")),
            )
    return table


def _digest(engine: Mapping[str, Any]) -> str:
    """The first 12 hex digits of the weights' digest, marked when a check verified them ("-": not known)."""
    digest = engine.get("weight_digest")
    if not digest:
        return "-"
    return f"{str(digest)[:12]} verified" if engine.get("weights_verified") else str(digest)[:12]


def _joined(engine: Mapping[str, Any]) -> str:
    """Decision → ACTIVE / → first answer, in seconds ("-" for what has not happened)."""
    active, answer = engine.get("join_active_s"), engine.get("join_first_answer_s")
    if active is None:
        return "-"
    return f"{active:.1f}s / {answer:.1f}s" if answer is not None else f"{active:.1f}s / -"


_PHASE_SHORT = {"capacity": "cap", "actor": "actor", "prepare": "prep", "server_start": "server", "start": "start",
                "first_answer": "answer", "weight_sync": "sync", "verify": "verify"}


def bring_up_text(bring_up: Mapping[str, Any] | None) -> str:
    """``cap 12.0 · server 20.1 · sync 0.3 · verify 0.1 = 34.2s``; a bring-up in progress ends with its current
    phase (``… · sync 3.1… ``); "-" when there is none."""
    if not bring_up:
        return "-"
    parts = [f"{_PHASE_SHORT.get(p, p)} {s:.1f}" for p, s in (bring_up.get("phases") or {}).items()
             if s >= 0.05 or p in ("capacity", "server_start")]
    current = bring_up.get("current")
    if current:
        parts.append(f"{_PHASE_SHORT.get(current, current)} {bring_up.get('current_for_s') or 0:.1f}…")
        return " · ".join(parts)
    outcome = bring_up.get("outcome")
    end = f" = {bring_up.get('total_s', 0):.1f}s"
    return " · ".join(parts) + end + ("" if outcome in (None, "ACTIVE") else f" ({str(outcome)[:40]})")


def requests_table(records: Sequence[Mapping[str, Any]], direction: str) -> Table:
    """A list of scale requests: id, status, target, engines, created, duration, error."""
    table = Table(title=f"{direction.replace('_', '-')} requests (newest first)", title_justify="left")
    for column in ("REQUEST", "STATUS", "TARGET", "ENGINES", "CREATED", "TOTAL", "ERROR"):
        table.add_column(column, no_wrap=column != "ERROR")
    for record in records:
        engines = record.get("engine_ids") if direction == "scale_out" else [
            v.get("engine_id") for v in record.get("victims", [])
        ]
        target = record.get("target")
        table.add_row(
            _cell(record.get("request_id")),
            _status(record.get("status")),
            _cell(target) if target is not None else (f"{len(record.get('urls', []))} url(s)"),
            ", ".join(engines or []) or "-",
            _when(record.get("created_at")),
            _secs((record.get("timings") or {}).get("total_s")),
            _cell(record.get("error")),
        )
    return table


_PHASES = ("placement_wait_s", "start_s", "health_s", "weight_sync_s", "total_s")


def print_record(console: Console, record: Mapping[str, Any]) -> None:
    """One scale request: a summary line, then its engines (scale-out) or victims (scale-in) with timings."""
    direction = record.get("direction", "scale_out")
    timings = record.get("timings") or {}
    head = Text.assemble(
        (f"{record.get('request_id')} ", "bold"),
        (f"{direction.replace('_', '-')} ", ""),
        _status(record.get("status")),
    )
    facts = []
    if record.get("kind"):
        facts.append(str(record["kind"]))
    if record.get("target") is not None:
        facts.append(f"target {record['target']} (from {record.get('engines_before')})")
    if record.get("urls"):
        facts.append("urls " + " ".join(record["urls"]))
    if record.get("force"):
        facts.append("force")
    if record.get("cancel_requested"):
        facts.append("cancel requested")
    facts.append(f"created {_when(record.get('created_at'))}")
    facts.append(f"total {_secs(timings.get('total_s'))}")
    console.print(head, "  " + ", ".join(facts))
    if record.get("error"):
        console.print(Text(f"error: {record['error']}", style="red"))
    if direction == "scale_out":
        table = Table(title_justify="left", title="engines")
        for column in ("ENGINE", "STATE", "URL", "PLACEMENT", "START", "HEALTH", "WEIGHTS", "TOTAL", "ERROR"):
            table.add_column(column, no_wrap=column != "ERROR")
        for engine in record.get("engines", []):
            table.add_row(
                _cell(engine.get("engine_id")),
                _status(engine.get("state")),
                _cell(engine.get("url")),
                *(_secs(engine.get(k)) for k in _PHASES),
                _cell(engine.get("error")),
            )
    else:
        table = Table(title_justify="left", title="victims")
        for column in ("ENGINE", "KIND", "STATE", "URL", "DRAIN", "SHUTDOWN", "ABORTED", "ERROR"):
            table.add_column(column, no_wrap=column != "ERROR")
        for victim in record.get("victims", []):
            table.add_row(
                _cell(victim.get("engine_id")),
                _cell(victim.get("kind")),
                _status(victim.get("state")),
                _cell(victim.get("url")),
                _secs(victim.get("drain_s")),
                _secs(victim.get("shutdown_s")),
                _cell(victim.get("aborted_requests")),
                _cell(victim.get("error")),
            )
    if table.row_count:
        console.print(table)
    phases = timings.get("in_status_s") or {}
    if phases:
        console.print("time per status: " + ", ".join(f"{k} {_secs(v)}" for k, v in phases.items()))


def events_table(body: Mapping[str, Any]) -> Table:
    table = Table(title="Events (newest first)", title_justify="left")
    for column in ("SEQ", "TIME", "KIND", "ENGINES", "REQUEST", "MESSAGE"):
        table.add_column(column, no_wrap=column != "MESSAGE", justify="right" if column == "SEQ" else "left")
    for event in body.get("events", []):
        table.add_row(
            _cell(event.get("seq")),
            _when(event.get("timestamp")),
            _cell(event.get("kind")),
            ", ".join(event.get("engine_ids") or []) or "-",
            _cell(event.get("request_id")),
            _cell(event.get("message")),
        )
    return table


# -- commands ------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> ApiClient:
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    from relax.cluster.api_token import find_token

    access = find_token(url)
    return ApiClient(access.url, access.token, timeout=args.http_timeout)


def _print_json(body: Any) -> None:
    print(json.dumps(body, indent=2, sort_keys=True))


def _run(command: str, body: Callable[[argparse.Namespace, ApiClient, Console], int]) -> Callable[..., int]:
    """Wrap a command: one client, errors printed as one line on stderr, the exit code returned."""

    def run(args: argparse.Namespace) -> int:
        try:
            with _client(args) as client:
                return body(args, client, _console())
        except ApiError as exc:
            print(f"relax {command}: {exc.message}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print(f"relax {command}: interrupted", file=sys.stderr)
            return 130

    return run


def _cmd_engines(args: argparse.Namespace, client: ApiClient, console: Console) -> int:
    if args.verify:
        return _verify_engine(args, client, console)
    body = client.request("GET", "/rollout/engines", params={"model_name": args.model_name})
    if args.json:
        _print_json(body)
        return EXIT_OK
    console.print(engines_table(body))
    console.print(f"{body.get('total_engines', 0)} engine(s), {body.get('active_engines', 0)} active")
    return EXIT_OK


def _verify_engine(args: argparse.Namespace, client: ApiClient, console: Console) -> int:
    """``--verify ENGINE``: one line saying what the check found; exit 1 when the engine still differed (failed)."""
    body = client.request("POST", f"/rollout/engines/{args.verify}/verify")
    if args.json:
        _print_json(body)
    else:
        console.print(verification_line(body))
    return EXIT_FAILED if body.get("result") == "mismatch" else EXIT_OK


def verification_line(body: Mapping[str, Any]) -> str:
    """One check (``POST /rollout/engines/{id}/verify``) as one line."""
    engine, version, result = body.get("engine_id", "?"), body.get("version"), body.get("result")
    digest = str(body.get("expected_digest") or "")[:12]
    took = f"in {float(body.get('seconds') or 0.0):.2f}s"
    if result == "verified":
        repaired = " after one full reload (the first check found other weights)" if body.get("attempt") else ""
        return f"{engine}: weights v{version} verified (digest {digest}) {took}{repaired}"
    if result == "mismatch":
        names = ", ".join(body.get("mismatched") or [])
        return (f"{engine}: serves other weights than v{version} even after a full reload (digest "
                f"{str(body.get('served_digest') or '?')[:12]}, published {digest}; differ: {names}): the engine "
                "was failed")
    return f"{engine}: weights v{version} could not be verified (the engine cannot report its checksums)"


def _cmd_events(args: argparse.Namespace, client: ApiClient, console: Console) -> int:
    body = client.request("GET", "/rollout/events", params={"limit": args.limit, "kind": args.kind})
    if args.json:
        _print_json(body)
        return EXIT_OK
    console.print(events_table(body))
    shown, total, dropped = len(body.get("events", [])), body.get("total", 0), body.get("dropped", 0)
    note = f" ({dropped} oldest no longer kept)" if dropped else ""
    console.print(f"showing {shown} of {total} event(s){note}")
    return EXIT_OK


def _wait(client: ApiClient, console: Console, direction: str, request_id: str, interval: float) -> dict[str, Any]:
    """Poll a request until it is terminal, printing each status it passes through."""
    seen = None
    began = time.monotonic()
    while True:
        record = client.request("GET", f"/rollout/{direction}/{request_id}")
        status = record.get("status")
        if status != seen:
            console.print(Text.assemble(f"{request_id}: ", _status(status), f"  (+{time.monotonic() - began:.1f}s)"))
            seen = status
        if status in TERMINAL[direction]:
            return record
        time.sleep(interval)


def _finish(args: argparse.Namespace, client: ApiClient, console: Console, direction: str, answer: Any) -> int:
    """Print a scale answer (accepted / NOOP / dry run / record) and, with ``--wait``, follow it to its end."""
    if not isinstance(answer, dict):
        raise ApiError(f"unexpected answer: {_clip(json.dumps(answer))}")
    status = answer.get("status")
    request_id = answer.get("request_id")
    if args.json and not (args.wait and request_id):
        _print_json(answer)
        return EXIT_OK
    if status == "NOOP":
        console.print(Text.assemble(_status("NOOP"), f"  {answer.get('message', 'nothing to do')}"))
        return EXIT_OK
    if status == "DRY_RUN":
        console.print(
            f"dry run: scaling in from {answer.get('current_engines')} to {answer.get('engines_after')} engine(s) "
            f"would remove{' (force: no drain wait)' if answer.get('force') else ''}:"
        )
        table = Table()
        for column in ("ENGINE", "KIND", "URL", "IN-FLIGHT"):
            table.add_column(column, no_wrap=True)
        for victim in answer.get("victims", []):
            table.add_row(victim.get("engine_id"), _cell(victim.get("kind")), _cell(victim.get("url")),
                          _cell(victim.get("in_flight")))
        console.print(table)
        return EXIT_OK
    if not request_id:
        raise ApiError(f"unexpected answer: {_clip(json.dumps(answer))}")
    if args.json:  # stdout carries only the final JSON record; progress goes to stderr
        console = _console(sys.stderr)
    if "direction" not in answer:  # an acceptance: {request_id, status}
        console.print(Text.assemble(f"{direction.replace('_', '-')} request {request_id} accepted: ", _status(status)))
    if not args.wait:
        if "direction" in answer:
            print_record(console, answer)
        console.print(f"follow it: relax {direction.replace('_', '-')} --show {request_id} (or add --wait)")
        return EXIT_OK
    record = _wait(client, console, direction, request_id, args.poll_interval)
    if args.json:
        _print_json(record)
    else:
        print_record(console, record)
    return EXIT_OK if record.get("status") in SUCCESS else EXIT_FAILED


def _show_or_list(args: argparse.Namespace, client: ApiClient, console: Console, direction: str) -> int | None:
    """``--list`` / ``--show ID``; ``None`` when neither was asked."""
    if args.list:
        records = client.request("GET", f"/rollout/{direction}", params={"status": args.status})
        if args.json:
            _print_json(records)
        else:
            console.print(requests_table(records, direction))
        return EXIT_OK
    if args.show:
        record = client.request("GET", f"/rollout/{direction}/{args.show}")
        if args.json:
            _print_json(record)
        else:
            print_record(console, record)
        return EXIT_OK
    return None


def _scale_body(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_replicas is None and not args.urls:
        raise ApiError("give N (the absolute total of engines wanted) or --urls", EXIT_USAGE)
    body: dict[str, Any] = {"model_name": args.model_name}
    if args.num_replicas is not None:
        body["num_replicas"] = args.num_replicas
    if args.urls:
        body["engine_urls"] = list(args.urls)
    if args.timeout is not None:
        body["timeout_secs"] = args.timeout
    return body


def _cmd_scale_out(args: argparse.Namespace, client: ApiClient, console: Console) -> int:
    shown = _show_or_list(args, client, console, "scale_out")
    if shown is not None:
        return shown
    if args.cancel:
        answer = client.request("POST", f"/rollout/scale_out/{args.cancel}/cancel")
        _console(sys.stderr if args.json else None).print(
            f"cancel requested for {args.cancel}: engines not yet ACTIVE will be rolled back"
        )
        return _finish(args, client, console, "scale_out", answer)
    answer = client.request("POST", "/rollout/scale_out", json_body=_scale_body(args))
    return _finish(args, client, console, "scale_out", answer)


def _cmd_scale_in(args: argparse.Namespace, client: ApiClient, console: Console) -> int:
    shown = _show_or_list(args, client, console, "scale_in")
    if shown is not None:
        return shown
    body = _scale_body(args)
    if args.force:
        body["force"] = True
    if args.dry_run:
        body["dry_run"] = True
    answer = client.request("POST", "/rollout/scale_in", json_body=body)
    return _finish(args, client, console, "scale_in", answer)


# -- parsers -------------------------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, metavar="URL",
                        help=f"control plane base URL (default ${URL_ENV}, else {DEFAULT_URL}); "
                        f"the token is read from ${TOKEN_ENV}")
    common.add_argument("--json", action="store_true", help="print the raw JSON answer instead of tables")
    common.add_argument("--http-timeout", type=argtypes.positive_seconds, default=HTTP_TIMEOUT_S, metavar="SECS",
                        help=f"timeout of each HTTP call (default {HTTP_TIMEOUT_S:g})")
    return common


def _add_scale_arguments(parser: argparse.ArgumentParser, direction: str) -> None:
    verb = "out" if direction == "scale_out" else "in"
    parser.add_argument("num_replicas", nargs="?", type=int, metavar="N",
                        help="absolute target: the TOTAL number of engines wanted (not a number to "
                        f"{'add' if verb == 'out' else 'remove'})")
    parser.add_argument("--urls", nargs="+", metavar="URL",
                        help="engine base URLs to " + ("attach (running SGLang servers)" if verb == "out"
                                                       else "remove (instead of N)"))
    parser.add_argument("--model-name", default="default", help="model (a run serves 'default')")
    parser.add_argument("--timeout", type=argtypes.positive_seconds, default=None, metavar="SECS",
                        help="timeout_secs of the request (default: the run's --scale-" + verb
                        + ("-timeout" if verb == "out" else "-drain-timeout") + ")")
    parser.add_argument("--wait", action="store_true", help="poll the request until it ends and print its record")
    parser.add_argument("--poll-interval", type=argtypes.positive_seconds, default=1.0, metavar="SECS",
                        help="--wait: seconds between polls (default 1)")
    parser.add_argument("--list", action="store_true", help=f"list recent scale-{verb} requests instead")
    parser.add_argument("--status", default=None, help="--list: only requests in this status")
    parser.add_argument("--show", metavar="ID", default=None, help=f"show one scale-{verb} request instead")


def add_client_parsers(subparsers: Any) -> None:
    """Register ``engines``, ``scale-out``, ``scale-in`` and ``events`` on ``relax``'s sub-parsers.

    Each sets ``func`` to a callable taking the parsed namespace and returning the exit code.
    """
    common = _common()

    engines = subparsers.add_parser("engines", parents=[common], help="list the rollout engines and their status",
                                    description="List the rollout engines of a running Relax control plane.")
    engines.add_argument("--model-name", default=None, help="only this model")
    engines.add_argument("--verify", metavar="ENGINE", default=None,
                         help="check ENGINE's served weights against the trainer's publication now (the engine "
                              "pauses for it; other weights are reloaded once, then the engine is failed)")
    engines.set_defaults(func=_run("engines", _cmd_engines))

    scale_out = subparsers.add_parser(
        "scale-out", parents=[common], help="grow the rollout pool to N engines, or attach engine URLs",
        description="Grow the rollout pool to N engines in total (an absolute target: retrying is harmless), "
        "or attach running SGLang servers with --urls. Also --list, --show ID and --cancel ID.",
    )
    _add_scale_arguments(scale_out, "scale_out")
    scale_out.add_argument("--cancel", metavar="ID", default=None,
                           help="cancel a running scale-out (engines not yet ACTIVE are rolled back)")
    scale_out.set_defaults(func=_run("scale-out", _cmd_scale_out))

    scale_in = subparsers.add_parser(
        "scale-in", parents=[common], help="shrink the rollout pool to N engines (elastic ones, newest first)",
        description="Shrink the rollout pool to N engines in total. Elastic engines leave newest first after a "
        "real drain; initial engines are never removed. Also --list and --show ID.",
    )
    _add_scale_arguments(scale_in, "scale_in")
    scale_in.add_argument("--force", action="store_true",
                          help="do not wait for in-flight requests: abort them now (they are retried elsewhere)")
    scale_in.add_argument("--dry-run", action="store_true", help="show the engines that would be removed")
    scale_in.set_defaults(func=_run("scale-in", _cmd_scale_in))

    events = subparsers.add_parser("events", parents=[common], help="show the scaling and engine event history",
                                   description="Scale actions, engine transitions, evictions and failures.")
    events.add_argument("--limit", type=int, default=20, help="newest N events (default 20)")
    events.add_argument("--kind", default=None, help="only events of this kind (e.g. engine_evicted)")
    events.set_defaults(func=_run("events", _cmd_events))
