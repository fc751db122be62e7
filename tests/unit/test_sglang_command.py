"""SGLang launch command construction (SGLang itself is never imported or run here)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from relax.engines.launcher import format_argv
from relax.engines.sglang import SGLANG_MODULE, SGLangOptions, parse_extra_args, sglang_command, sglang_spec

BASE = [
    sys.executable, "-m", "sglang.launch_server",
    "--model-path", "/models/qwen3-4b", "--host", "127.0.0.1", "--port", "30001", "--tp-size", "1",
]  # fmt: skip


def flag_value(argv: list[str] | tuple[str, ...], flag: str) -> str:
    return argv[list(argv).index(flag) + 1]


def test_minimal_command_enables_metrics() -> None:
    argv = sglang_command("/models/qwen3-4b", "127.0.0.1", 30001)
    assert argv == [*BASE, "--enable-metrics"]


def test_full_command() -> None:
    argv = sglang_command(
        "/models/qwen3-4b",
        "10.0.0.7",
        30001,
        tp_size=2,
        mem_fraction_static=0.7,
        weight_version=5,
        extra_args=["--dtype", "bfloat16", "--log-level", "warning"],
        trust_remote_code=True,
        nccl_port=40001,
        api_key="k",
        python="/opt/sglang/bin/python",
    )
    assert argv == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen3-4b", "--host", "10.0.0.7", "--port", "30001", "--tp-size", "2",
        "--mem-fraction-static", "0.7", "--enable-metrics", "--weight-version", "5", "--nccl-port", "40001",
        "--trust-remote-code", "--api-key", "k",
        "--dtype", "bfloat16", "--log-level", "warning",
    ]  # fmt: skip


def test_every_value_is_a_string_and_flags_are_unique() -> None:
    argv = sglang_command("/m", "h", 1, tp_size=4, mem_fraction_static=0.5, weight_version=0, nccl_port=2)
    assert all(isinstance(a, str) for a in argv)
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) == len(set(flags))


def test_weight_version_zero_is_passed() -> None:
    # Version 0 (the initial checkpoint) must not be dropped as falsy.
    assert flag_value(sglang_command("/m", "h", 1, weight_version=0), "--weight-version") == "0"


def test_metrics_can_be_turned_off_and_are_not_duplicated() -> None:
    assert "--enable-metrics" not in sglang_command("/m", "h", 1, enable_metrics=False)
    argv = sglang_command("/m", "h", 1, extra_args=["--enable-metrics"])
    assert argv.count("--enable-metrics") == 1
    argv = sglang_command("/m", "h", 1, trust_remote_code=True, extra_args=["--trust-remote-code"])
    assert argv.count("--trust-remote-code") == 1


def test_extra_args_string_is_split_like_a_shell() -> None:
    argv = sglang_command("/m", "h", 1, extra_args="--chat-template '/path with space/t.jinja' --disable-radix-cache")
    assert argv[-3:] == ["--chat-template", "/path with space/t.jinja", "--disable-radix-cache"]
    assert parse_extra_args(None) == []
    assert parse_extra_args(("--a", "1")) == ["--a", "1"]
    with pytest.raises(TypeError, match="strings"):
        parse_extra_args(["--max-running-requests", 8])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "extra",
    [
        ["--port", "1"],
        ["--port=1"],
        ["--host", "0.0.0.0"],
        ["--model-path", "/other"],
        ["--model", "/other"],
        ["--tp-size", "2"],
        ["--tp", "2"],
        ["--tensor-parallel-size=2"],
        ["--weight-version", "9"],
        ["--mem-fraction-static", "0.9"],
        ["--nccl-port", "5"],
        ["--api-key", "x"],
    ],
)
def test_extra_args_may_not_override_managed_flags(extra: list[str]) -> None:
    with pytest.raises(ValueError, match="is set by Relax"):
        sglang_command("/m", "h", 1, extra_args=extra)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": -1}, "tp_size"),
        ({"tp_size": 1.5}, "tp_size"),
        ({"tp_size": True}, "tp_size"),
        ({"mem_fraction_static": 0.0}, "mem_fraction_static"),
        ({"mem_fraction_static": 1.2}, "mem_fraction_static"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"port": "30000"}, "port"),
        ({"nccl_port": 0}, "nccl_port"),
        ({"model_path": ""}, "model_path"),
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"model_path": "/m", "host": "h", "port": 30000}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sglang_command(**args)


def test_spec_uses_the_shared_contract(tmp_path: Path) -> None:
    opts = SGLangOptions(tp_size=1, mem_fraction_static=0.8, api_key="tok", extra_args=("--dtype", "bfloat16"))
    spec = sglang_spec(
        "/m", "0.0.0.0", 30002, str(tmp_path / "e.log"), weight_version=3, options=opts, nccl_port=40002,
        env={"NCCL_DEBUG": "WARN"}, name="engine_4",
    )  # fmt: skip
    assert spec.argv[1:3] == ("-m", SGLANG_MODULE)
    assert spec.health_path == "/health_generate"
    assert spec.url == "http://127.0.0.1:30002"  # wildcard bind is reached over loopback
    assert spec.token == "tok"
    assert "tok" not in format_argv(spec.argv)  # the key never reaches a log line
    assert spec.env == {"PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN"}
    assert flag_value(spec.argv, "--weight-version") == "3"
    assert flag_value(spec.argv, "--nccl-port") == "40002"
    assert spec.argv[-2:] == ("--dtype", "bfloat16")
    assert spec.name == "engine_4"


def test_format_argv_masks_secrets() -> None:
    assert format_argv(["x", "--api-key", "k1", "--admin-api-key=k2", "a b"]) == (
        "x --api-key '***' '--admin-api-key=***' 'a b'"
    )


def test_sglang_is_never_imported() -> None:
    sglang_command("/m", "h", 1)
    sglang_spec("/m", "h", 1, "/tmp/x.log")
    assert "sglang" not in sys.modules
