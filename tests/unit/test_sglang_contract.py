"""What Relax emits and calls against a snapshot of SGLang's real interface (scripts/sglang-contract-*.json).

The snapshot is read from SGLang's released source by ``scripts/sglang_contract.py`` (no network here). Flags
come from ``sglang_command`` built with every option set; routes from ``relax.engines.client`` plus the
requests a real ``EngineClient`` sends to a loopback server; body fields from those same requests. A renamed
flag or a removed route in a new SGLang release then fails here, on a CPU machine.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import inspect
import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from packaging.specifiers import SpecifierSet

import relax.engines.client as engine_client
from relax.engines import sglang
from relax.engines.client import EngineClient
from relax.rollout.settings import SamplingSettings
from tests.loopback import LoopbackServer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "sglang_contract.py"
SNAPSHOT_PATH = REPO / "scripts" / f"sglang-contract-{sglang.VERIFIED_SGLANG}.json"

ROUTES_USED: tuple[str, ...] = engine_client.SGLANG_ROUTES_USED  # next to the calls, the source of truth


def load_contract_module() -> ModuleType:
    """scripts/ is not a package: load the script by path (registered so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location("sglang_contract", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


contract = load_contract_module()
SNAPSHOT: dict[str, Any] = json.loads(SNAPSHOT_PATH.read_text())


# -- what Relax uses ------------------------------------------------------------------------------------

# Every keyword of sglang_command set to a value that makes it emit its flag.
ALL_OPTIONS: dict[str, Any] = {
    "tp_size": 2,
    "mem_fraction_static": 0.8,
    "weight_version": 3,
    "extra_args": None,
    "trust_remote_code": True,
    "nccl_port": 40001,
    "config_path": "/run/engine_0.keys.yaml",
    "enable_metrics": True,
    "max_running_requests": 64,
    "random_seed": 1,
    "python": "/opt/sglang/bin/python",
    "load_format": "dummy",
}


def emitted_flags() -> list[str]:
    """The flags ``sglang_command`` emits with every option on (the test fails if an option is left out)."""
    params = inspect.signature(sglang.sglang_command).parameters
    unset = set(params) - {"model_path", "host", "port"} - set(ALL_OPTIONS)
    assert not unset, f"set the new sglang_command options {sorted(unset)} in ALL_OPTIONS"
    argv = sglang.sglang_command("/models/m", "127.0.0.1", 30000, **ALL_OPTIONS)
    return [arg for arg in argv if arg.startswith("--")]


def fake_sglang() -> tuple[FastAPI, list[tuple[str, str, Any]]]:
    """An SGLang double that records (method, path, JSON body) and answers like 0.5.23 does."""
    app = FastAPI()
    seen: list[tuple[str, str, Any]] = []
    answers: dict[str, Any] = {
        "/generate": {"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": {"type": "length"},
                                                                   "weight_version": "3"}},
        "/update_weights_from_disk": {"success": True, "message": "ok", "num_paused_requests": 0},
        "/pause_generation": {"message": "Generation paused successfully.", "status": "ok"},
        "/continue_generation": {"message": "Generation continued successfully.", "status": "ok"},
        "/model_info": {"model_path": "/models/m", "weight_version": "3"},
        "/server_info": {"version": "0.5.23", "weight_version": "3"},
        "/init_weights_update_group": {"success": True, "message": "ok"},
        "/update_weights_from_distributed": {"success": True, "message": "ok"},
        "/begin_weight_update": {"success": True, "message": "ok"},
        "/end_weight_update": {"success": True, "message": "ok"},
        "/destroy_weights_update_group": {"success": True, "message": "ok"},
        "/update_weight_version": {"success": True, "message": "ok"},
    }  # fmt: skip

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
    async def record(path: str, request: Request) -> Response:
        raw = await request.body()
        route = "/" + path
        seen.append((request.method, route, json.loads(raw) if raw else None))
        if route == "/metrics":
            return PlainTextResponse("sglang:num_queue_reqs 0\n")
        if route in answers:
            return JSONResponse(answers[route])
        return Response(status_code=200)  # /abort_request and /flush_cache answer with an empty body

    return app, seen


async def drive_client(url: str) -> None:
    """Every request the rollout path makes, through the real client (manager, fleet and weight sync)."""
    params = SamplingSettings(n_samples=1, max_new_tokens=8).to_params()
    async with EngineClient(url, timeout=10) as client:
        await client.generate(input_ids=[1, 2, 3], sampling_params=params, rid="r", return_logprob=True)
        await client.generate("hi", sampling_params=params)
        await client.update_weights_from_disk("/ckpt/step_3", 3, load_format="auto")
        await client.pause_generation("retract")
        await client.init_weights_update_group("10.0.0.1", 29500, 1, 2, group_name="g", backend="nccl")
        await client.begin_weight_update()
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 2]], group_name="g", weight_version=4,
                                                     load_format="flattened_bucket")
        await client.end_weight_update()
        await client.destroy_weights_update_group("g")
        await client.continue_generation()
        await client.abort_request("r")
        await client.abort_request(abort_all=True)
        await client.flush_cache()
        await client.health()
        await client.health_generate()
        await client.metrics_text()
        for name in ("get_server_info", "get_weight_version"):  # names may change
            if hasattr(client, name):
                await getattr(client, name)()


@pytest.fixture(scope="module")
def client_requests() -> Iterator[list[tuple[str, str, Any]]]:
    app, seen = fake_sglang()
    with LoopbackServer(app, name="fake-sglang", lifespan="off") as server:
        asyncio.run(drive_client(server.url))
    yield seen


def relax_uses(requests: list[tuple[str, str, Any]]) -> dict[str, Any]:
    """Keywords for ``missing_from_snapshot``: everything Relax depends on."""
    fields: dict[str, set[str]] = {}
    for _, path, body in requests:
        if isinstance(body, dict):
            fields.setdefault(path, set()).update(body)
            if isinstance(body.get("sampling_params"), dict):
                fields.setdefault("SamplingParams", set()).update(body["sampling_params"])
    return {
        "flags": emitted_flags(),
        "routes": [*ROUTES_USED, *((method, path) for method, path, _ in requests)],
        "request_fields": fields,
    }


# -- the checks -----------------------------------------------------------------------------------------


def test_snapshot_is_of_the_verified_supported_release() -> None:
    assert SNAPSHOT["sglang_version"] == sglang.VERIFIED_SGLANG
    assert SpecifierSet(sglang.SUPPORTED_SGLANG).contains(SNAPSHOT["sglang_version"])


def test_snapshot_is_stable_sorted_json() -> None:
    # Regenerating for the same release must give the same bytes, so a diff between releases is a changelog.
    assert SNAPSHOT["flags"] == sorted(SNAPSHOT["flags"])
    for mapping in (SNAPSHOT["routes"], SNAPSHOT["route_bodies"], SNAPSHOT["request_fields"]):
        assert list(mapping) == sorted(mapping)
    assert all(fields == sorted(fields) for fields in SNAPSHOT["request_fields"].values())
    assert json.dumps(SNAPSHOT, indent=1) + "\n" == SNAPSHOT_PATH.read_text()


def test_every_flag_relax_emits_exists(client_requests: list[tuple[str, str, Any]]) -> None:
    flags = emitted_flags()
    expected = {"--weight-version", "--enable-metrics", "--config", "--max-running-requests", "--random-seed"}
    assert expected <= set(flags)
    keys_file = yaml.safe_load(sglang.keys_config("g", "a"))  # the --config file's entries are SGLang flags too
    flags += ["--" + name for name in keys_file]
    missing = contract.missing_from_snapshot(SNAPSHOT, flags=flags)
    assert not missing, f"SGLang {SNAPSHOT['sglang_version']} lacks what Relax uses: {', '.join(missing)}"


def test_every_route_and_body_field_relax_uses_exists(client_requests: list[tuple[str, str, Any]]) -> None:
    uses = relax_uses(client_requests)
    bodies = {"/generate", "/update_weights_from_disk", "/pause_generation", "/abort_request", "SamplingParams",
              "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"}
    assert bodies <= set(uses["request_fields"])
    missing = contract.missing_from_snapshot(SNAPSHOT, **uses)
    assert not missing, f"SGLang {SNAPSHOT['sglang_version']} lacks what Relax uses: {', '.join(missing)}"


def test_the_routes_used_list_covers_what_the_client_calls(client_requests: list[tuple[str, str, Any]]) -> None:
    legacy = getattr(engine_client, "LEGACY_WEIGHT_VERSION_ROUTE", None)  # a fallback for pre-0.5.23 builds
    called = {path for _, path, _ in client_requests} - {legacy}
    assert called <= set(ROUTES_USED), f"add {sorted(called - set(ROUTES_USED))} to SGLANG_ROUTES_USED"


def test_relax_never_bumps_a_version_with_sglangs_abort_all_default(
    client_requests: list[tuple[str, str, Any]],
) -> None:
    """SGLang's /update_weight_version aborts every request in flight unless told not to (the version-bump trap):
    Relax never calls it. Versions travel with the weight updates' ``weight_version``."""
    assert all(path != "/update_weight_version" for _, path, _ in client_requests)
    callers = sorted(str(f.relative_to(REPO)) for f in (REPO / "relax").rglob("*.py")
                     if "/update_weight_version" in f.read_text() and "builtin" not in f.parts
                     and f.name != "keys.py"  # keys.py lists control routes; it calls none
                     and "vllm" not in f.parts)  # vLLM's route of that name only labels (tests/vllm/CONTRACT.md)
    assert callers == [], (f"{callers} call /update_weight_version: set versions through the weight update, or send "
                           "abort_all_requests: false (SGLang's default aborts every request in flight)")


def test_managed_flags_are_sglang_flags_or_abbreviations_of_one() -> None:
    flags = SNAPSHOT["flags"]
    for managed in sglang._MANAGED_FLAGS:
        matches = [f for f in flags if f.startswith(managed)]
        assert managed in flags or len(matches) == 1, f"{managed} is neither an SGLang flag nor an abbreviation of one"


def test_rejecting_abbreviations_never_rejects_a_real_sglang_flag() -> None:
    # Relax rejects extra args that abbreviate a managed flag; a real SGLang flag must never look like one.
    clashes = [f for f in SNAPSHOT["flags"] if f not in sglang._MANAGED_FLAGS and sglang._managed_prefix_matches(f)]
    assert clashes == []


def test_abbreviations_too_short_to_be_rejected_are_ambiguous_to_sglang() -> None:
    # argparse refuses an ambiguous prefix, so prefixes below the minimum need no rejection by Relax.
    flags = SNAPSHOT["flags"]
    for managed in sglang._MANAGED_FLAGS:
        for length in range(1, sglang._MIN_PREFIX_CHARS):
            prefix = managed[: 2 + length]
            assert len([f for f in flags if f.startswith(prefix)]) > 1, f"SGLang takes {prefix} for {managed}"


# -- the check fails when the snapshot lacks something --------------------------------------------------


def without(snapshot: dict[str, Any], *, flag: str | None = None, route: str | None = None) -> dict[str, Any]:
    mutated = copy.deepcopy(snapshot)
    if flag is not None:
        mutated["flags"].remove(flag)
    if route is not None:
        del mutated["routes"][route]
    return mutated


@pytest.mark.parametrize(("flag", "route", "reported"), [
    ("--weight-version", None, "flag --weight-version"),
    ("--enable-metrics", None, "flag --enable-metrics"),
    (None, "/model_info", "route /model_info"),
    (None, "/abort_request", "route /abort_request"),
])  # fmt: skip
def test_check_reports_a_removed_flag_or_route(
    client_requests: list[tuple[str, str, Any]], flag: str | None, route: str | None, reported: str
) -> None:
    missing = contract.missing_from_snapshot(without(SNAPSHOT, flag=flag, route=route), **relax_uses(client_requests))
    assert missing == [reported]


def test_check_reports_removed_fields_methods_and_types(client_requests: list[tuple[str, str, Any]]) -> None:
    mutated = copy.deepcopy(SNAPSHOT)
    mutated["request_fields"]["AbortReq"].remove("abort_all")
    mutated["request_fields"]["SamplingParams"].remove("top_k")
    mutated["routes"]["/generate"] = ["PUT"]
    del mutated["request_fields"]["PauseGenerationReqInput"]
    missing = contract.missing_from_snapshot(mutated, **relax_uses(client_requests))
    assert missing == [
        "route POST /generate (has PUT)",
        "request field AbortReq.abort_all",
        "request body of /pause_generation (PauseGenerationReqInput)",
        "request field SamplingParams.top_k",
    ]


# -- the extractor, on a synthetic release (names only, none of SGLang's code) -------------------------

FAKE_RELEASE: dict[str, str] = {
    "sglang-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n\nbody\n",
    "sglang/srt/arg_groups/fields/one.py": (
        "import argparse\nfrom typing import Optional\nimport msgspec\n"
        "from sglang.srt.arg_groups.arg_utils import A, Arg\n"
        "class Base(msgspec.Struct):\n    inherited_flag: A[int, 'h'] = 0\n"
        "class One(Base):\n    _NS_PATH = 'one'\n"
        "    model_path: A[str, Arg(help='h', aliases=['--model'])]\n"
        "    tp_size: A[int, Arg(help='h', cli_name='--tp-size', aliases=['--tensor-parallel-size'])] = 1\n"
        "    hidden: A[int, Arg(no_cli=True)] = 0\n"
        "    toggle: A[bool, Arg(help='h', action=argparse.BooleanOptionalAction)] = True\n"
        "    bare: Optional[int] = None\n"
        "class Unused(msgspec.Struct):\n    not_listed: A[int, 'h'] = 0\n"
    ),
    "sglang/srt/server_args.py": (
        "from sglang.srt.arg_groups.fields.one import One\n_INPUT_NAMESPACES = [One]\n"
        "class ServerArgs:\n    def add_cli_args(parser):\n"
        "        parser.add_argument('--manual', type=str)\n"
    ),
    "sglang/srt/entrypoints/http_server.py": (
        "import os\nfrom sglang.srt.managers.io_struct import Req\nfrom sglang.srt.utils import add_metrics\n"
        "from sglang.srt.entrypoints.extra import router as extra_router\n"
        "@app.get('/health')\n@app.get('/health_generate')\nasync def health(): ...\n"
        "@app.api_route('/generate', methods=['POST', 'PUT'])\nasync def generate(obj: Req, request): ...\n"
        "@app.post(os.environ.get('ROUTE', '/env_default'))\nasync def env(): ...\n"
        "app.include_router(extra_router, prefix='/x')\nadd_metrics(app)\n"
    ),
    "sglang/srt/entrypoints/extra.py": (
        "router = APIRouter(prefix='/r')\n@router.get('/loads')\nasync def loads(): ...\n"
    ),
    "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
    "sglang/srt/utils/common.py": "def add_metrics(app):\n    app.routes.append(Mount('/metrics', None))\n",
    "sglang/srt/managers/io_struct.py": (
        "from typing import ClassVar\nimport msgspec\n"
        "class BaseReq(msgspec.Struct):\n    rid: str = ''\n"
        "class Req(BaseReq):\n    text: str = ''\n    kind: ClassVar[str] = 'x'\n"
    ),
    "sglang/srt/sampling/sampling_params.py": "class SamplingParams:\n    temperature: float = 1.0\n",
}


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    types = {contract.IO_STRUCT: ("Req",), contract.SAMPLING_PARAMS: ("SamplingParams",)}
    monkeypatch.setattr(contract, "REQUEST_TYPES", types)
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in FAKE_RELEASE.items():
            zf.writestr(name, text)
    return wheel


def test_extractor_reads_flags_routes_and_fields(fake_wheel: Path) -> None:
    snapshot = contract.build_snapshot(contract.load_sources(fake_wheel))
    assert snapshot == {
        "sglang_version": "9.9.9",
        "flags": ["--help", "--inherited-flag", "--manual", "--model", "--model-path", "--no-toggle",
                  "--tensor-parallel-size", "--toggle", "--tp-size"],
        "routes": {"/env_default": ["POST"], "/generate": ["POST", "PUT"], "/health": ["GET"],
                   "/health_generate": ["GET"], "/metrics": ["GET"], "/x/r/loads": ["GET"]},
        "route_bodies": {"/generate": "Req"},
        "request_fields": {"Req": ["rid", "text"], "SamplingParams": ["temperature"]},
    }  # fmt: skip


def test_cli_writes_the_snapshot(fake_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "contract.json"
    assert contract.main(["--wheel", str(fake_wheel), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["sglang_version"] == "9.9.9"
    assert "9 flags, 6 routes" in capsys.readouterr().out


def test_cli_explains_a_bad_archive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "sglang.whl"
    bogus.write_text("not a zip")
    assert contract.main(["--wheel", str(bogus), "--out", str(tmp_path / "x.json")]) == 1
    assert "neither a wheel nor an sdist" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
