"""SGLang launch command construction (SGLang itself is never imported or run here)."""

from __future__ import annotations

import importlib.util
import logging
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from relax.engines.keys import EngineKeys, engine_keys
from relax.engines.launcher import ServerProcess, format_argv
from relax.engines.sglang import (
    SGLANG_API_KEY_ENV,
    SGLANG_MODULE,
    SUPPORTED_SGLANG,
    SGLangOptions,
    SGLangVersionError,
    api_key_from_env,
    check_sglang_version,
    engine_secret,
    parse_extra_args,
    sglang_command,
    sglang_spec,
)

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
        config_path="/run/e.keys.yaml",
        python="/opt/sglang/bin/python",
    )
    assert argv == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen3-4b", "--host", "10.0.0.7", "--port", "30001", "--tp-size", "2",
        "--mem-fraction-static", "0.7", "--enable-metrics", "--weight-version", "5", "--nccl-port", "40001",
        "--trust-remote-code", "--config", "/run/e.keys.yaml",
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
        ["--max-running-requests", "8"],
        ["--random-seed=3"],
    ],
)
def test_extra_args_may_not_override_managed_flags(extra: list[str]) -> None:
    with pytest.raises(ValueError, match="is set by Relax"):
        sglang_command("/m", "h", 1, extra_args=extra)


@pytest.mark.parametrize(
    ("extra", "managed"),
    [
        (["--mem-frac", "0.9"], "--mem-fraction-static"),
        (["--mem-frac=0.9"], "--mem-fraction-static"),
        (["--weight-v", "9"], "--weight-version"),
        (["--tp-s", "2"], "--tp-size"),
        (["--tensor-p", "2"], "--tensor-parallel-size"),
        (["--model-pa", "/other"], "--model-path"),
        (["--nccl-p", "5"], "--nccl-port"),
        (["--max-run", "8"], "--max-running-requests"),
        (["--random-s", "1"], "--random-seed"),
        # two letters are enough for SGLang 0.5.23's argparse: `--po 1` sets --port
        (["--po", "1"], "--port"),
        (["--ho", "0.0.0.0"], "--host"),
        (["--ap", "x"], "--api-key"),
        (["--te", "2"], "--tensor-parallel-size"),
    ],
)
def test_extra_args_may_not_abbreviate_managed_flags(extra: list[str], managed: str) -> None:
    with pytest.raises(ValueError, match="is set by Relax") as error:
        sglang_command("/m", "h", 1, extra_args=["--dtype", "bfloat16", *extra])
    message = str(error.value)
    assert repr(extra[0].split("=")[0]) in message and managed in message and "\n" not in message


def test_unrelated_flags_that_share_a_beginning_pass() -> None:
    extra = ["--model-impl", "sglang", "--enable-metrics-for-all-schedulers", "--port-range", "x", "--m", "y"]
    assert sglang_command("/m", "h", 1, extra_args=extra)[-len(extra) :] == extra


def test_max_running_requests_and_random_seed_are_passed() -> None:
    argv = sglang_command("/m", "h", 1, max_running_requests=64, random_seed=0)
    assert flag_value(argv, "--max-running-requests") == "64"
    assert flag_value(argv, "--random-seed") == "0"  # seed 0 is a seed, not "unset"
    plain = sglang_command("/m", "h", 1)
    assert "--max-running-requests" not in plain and "--random-seed" not in plain


def test_options_carry_max_running_requests_and_random_seed(tmp_path: Path) -> None:
    opts = SGLangOptions(max_running_requests=32, random_seed=7)
    spec = sglang_spec("/m", "h", 1, str(tmp_path / "e.log"), options=opts)
    assert flag_value(spec.argv, "--max-running-requests") == "32"
    assert flag_value(spec.argv, "--random-seed") == "7"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"max_running_requests": -3}, "max_running_requests"),
        ({"max_running_requests": True}, "max_running_requests"),
        ({"max_running_requests": 2.5}, "max_running_requests"),
        ({"max_running_requests": "8"}, "max_running_requests"),
        ({"random_seed": -1}, "random_seed"),
        ({"random_seed": 2**32}, "random_seed"),
        ({"random_seed": False}, "random_seed"),
        ({"random_seed": "1"}, "random_seed"),
    ],
)
def test_invalid_limits_and_seeds_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sglang_command("/m", "h", 1, **kwargs)
    with pytest.raises(ValueError, match=match):
        SGLangOptions(**kwargs)  # fails where the options are made, not when an engine starts


# -- the API key ----------------------------------------------------------------------------------------


def test_api_key_from_env() -> None:
    assert api_key_from_env({}) is None
    assert api_key_from_env({SGLANG_API_KEY_ENV: ""}) is None
    assert api_key_from_env({SGLANG_API_KEY_ENV: "  \n"}) is None
    assert api_key_from_env({SGLANG_API_KEY_ENV: "s3cret\n"}) == "s3cret"  # $(cat keyfile) leaves a newline


def test_every_run_has_a_fresh_engine_secret_and_each_engine_its_own_keys() -> None:
    first, second = engine_secret(), engine_secret()
    assert first != second and len(first) >= 40  # 32 random bytes, URL-safe: a fresh one per run
    a, b = engine_keys(first, "engine_0"), engine_keys(first, "engine_1")
    assert len({a.generation, a.admin, b.generation, b.admin, first}) == 5  # no engine holds another's key
    assert engine_keys(first, "engine_0") == a  # derived again, never stored
    mine = engine_keys(first, "engine_0", generation="mine")  # RELAX_ENGINE_API_KEY: generation only
    assert mine.generation == "mine" and mine.admin == a.admin
    assert engine_keys(None, "engine_0") == EngineKeys()


def test_the_builtin_engine_gets_its_key_in_the_environment_not_argv() -> None:
    from relax.engines.launcher import BuiltinOptions, builtin_spec

    spec = builtin_spec("/m", "127.0.0.1", 30000, "/tmp/e.log", options=BuiltinOptions(api_key="k3y"))
    assert "k3y" not in " ".join(spec.argv) and "k3y" not in repr(spec)
    assert spec.env["RELAX_ENGINE_API_KEY"] == "k3y" and spec.token == "k3y"  # the health probe sends it


def test_api_key_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAX_SGLANG_API_KEY", "from-env")
    assert api_key_from_env() == "from-env"
    monkeypatch.delenv("RELAX_SGLANG_API_KEY")
    assert api_key_from_env() is None


def test_options_repr_hides_the_api_key() -> None:
    assert "s3cret" not in repr(SGLangOptions(api_key="s3cret"))


def test_keys_reach_sglang_in_a_private_config_file_never_its_argv(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The generation and admin keys go into a 0600 --config YAML next to the log; no argv and no log line of
    Relax carries either, and the file goes when the server stops."""
    fake_python = fake_interpreter(tmp_path, "exit 0")
    opts = SGLangOptions(api_key="gen-s3cret", admin_api_key="adm-s3cret", python=str(fake_python))
    with caplog.at_level(logging.DEBUG):
        spec = sglang_spec("/m", "127.0.0.1", 30003, str(tmp_path / "e.log"), options=opts, name="engine_9")
        assert not any("s3cret" in arg for arg in spec.argv)
        config = flag_value(spec.argv, "--config")
        assert config == str(tmp_path / "e.log") + ".keys.yaml"
        server = ServerProcess(spec)
        try:
            server.start()
            assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
            assert yaml.safe_load(Path(config).read_text()) == {"api-key": "gen-s3cret", "admin-api-key": "adm-s3cret"}
            assert stat.S_IMODE(os.stat(tmp_path / "e.log").st_mode) == 0o600  # SGLang logs its keys there
        finally:
            server.stop(grace_s=5)
    assert not os.path.exists(config)
    assert "argv=" in caplog.text and "s3cret" not in caplog.text


# -- the SGLang version ---------------------------------------------------------------------------------


def fake_interpreter(tmp_path: Path, body: str, name: str = "python") -> Path:
    """An executable standing in for SGLang's interpreter (a real subprocess, no mocking)."""
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("version", ["0.5.0", "0.5.23", "0.5.23.post1", "0.5.24.dev0", "0.5.30rc1"])
def test_supported_versions_are_returned(tmp_path: Path, version: str) -> None:
    python = fake_interpreter(tmp_path, f"echo {version}")
    assert check_sglang_version(str(python)) == version


@pytest.mark.parametrize("version", ["0.4.9", "0.5.0rc0", "0.6.0", "1.0.0"])
def test_versions_outside_the_range_are_rejected(tmp_path: Path, version: str) -> None:
    python = fake_interpreter(tmp_path, f"echo {version}")
    with pytest.raises(SGLangVersionError) as error:
        check_sglang_version(str(python))
    message = str(error.value)
    assert f"SGLang {version} is installed for {python}" in message
    assert SUPPORTED_SGLANG in message and "0.5.23" in message and "\n" not in message
    assert isinstance(error.value, ValueError)


def test_the_probe_reads_package_metadata_without_importing_sglang(tmp_path: Path) -> None:
    seen = tmp_path / "argv.txt"
    python = fake_interpreter(tmp_path, f'printf "%s\\n" "$@" > {seen}; echo 0.5.23')
    check_sglang_version(str(python))
    flag, code = seen.read_text().splitlines()
    assert flag == "-c" and "importlib.metadata" in code and "version('sglang')" in code
    assert "import sglang" not in code


NOT_INSTALLED = (
    "SGLang is not installed for {python} (the interpreter this engine asked): install it into that interpreter "
    "(pip install 'sglang==0.5.23'), or pass --sglang-python PATH (a Python that has it, e.g. SGLang's own "
    "environment), or pass --rollout-backend builtin"
)


def test_sglang_not_installed(tmp_path: Path) -> None:
    body = 'echo "importlib.metadata.PackageNotFoundError: No package metadata was found for sglang" >&2; exit 1'
    python = fake_interpreter(tmp_path, body)
    with pytest.raises(SGLangVersionError) as error:
        check_sglang_version(str(python))
    assert str(error.value) == NOT_INSTALLED.format(python=python)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="this interpreter has sglang installed")
def test_sglang_not_installed_for_a_real_interpreter() -> None:
    with pytest.raises(SGLangVersionError) as error:
        check_sglang_version(sys.executable)
    assert str(error.value) == NOT_INSTALLED.format(python=sys.executable)


def test_missing_interpreter(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "python"
    with pytest.raises(SGLangVersionError, match=f"cannot run {missing}"):
        check_sglang_version(str(missing))


def test_interpreter_that_fails_otherwise(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path, 'echo "Traceback ..." >&2; echo "OSError: bad magic" >&2; exit 3')
    with pytest.raises(SGLangVersionError, match=r"failed to report its SGLang version \(exit 3\): OSError: bad magic"):
        check_sglang_version(str(python))


def test_output_that_is_not_a_version(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path, "echo unknown")
    with pytest.raises(SGLangVersionError, match="'unknown', which is not a version number"):
        check_sglang_version(str(python))


def test_a_hanging_interpreter_times_out(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path, "exec sleep 30")
    with pytest.raises(SGLangVersionError, match="timed out after 0.5 s"):
        check_sglang_version(str(python), timeout=0.5)


def test_injected_runner_gets_the_probe_and_the_timeout() -> None:
    calls: list[tuple[Sequence[str], float]] = []

    def runner(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
        calls.append((argv, timeout))
        return 0, "0.5.23\n", ""

    assert check_sglang_version("/opt/sglang/bin/python", runner=runner) == "0.5.23"
    [(argv, timeout)] = calls
    assert argv[:2] == ["/opt/sglang/bin/python", "-c"] and timeout == 60


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


def test_missing_interpreter_names_the_fixes(tmp_path: Path) -> None:
    with pytest.raises(SGLangVersionError) as error:
        check_sglang_version(str(tmp_path / "no" / "python"))
    assert "--sglang-python PATH" in str(error.value) and "--rollout-backend builtin" in str(error.value)
    assert "\n" not in str(error.value)


def test_a_version_outside_the_range_names_the_fixes(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path, 'echo "0.4.10"')
    with pytest.raises(SGLangVersionError) as error:
        check_sglang_version(str(python))
    message = str(error.value)
    assert message.startswith(f"SGLang 0.4.10 is installed for {python}")
    assert "sglang==0.5.23" in message and "--sglang-python PATH" in message and "--rollout-backend builtin" in message


@pytest.mark.parametrize(("passthrough", "needles"), [
    ((("port", ("30000",)),), ["--sglang-port: SGLang's --port is set by Relax (port)"]),
    ((("tp-size", ("2",)), ("dtype", ("bfloat16",))), ["--sglang-tp-size: SGLang's --tp-size"]),
    ((("mem-frac", ("0.5",)),), ["--sglang-mem-frac: SGLang's --mem-fraction-static is set by Relax"]),
    ((("api-key", ("k",)), ("weight-version", ("3",))), ["--sglang-api-key", "--sglang-weight-version"]),
])
def test_reserved_passthrough_flags_are_one_line_each(passthrough, needles) -> None:
    from relax.engines.sglang import reserved_flag_problems

    problems = reserved_flag_problems(passthrough)
    assert len(problems) == len(needles)
    for problem, needle in zip(problems, needles, strict=True):
        assert needle in problem and "remove" in problem and "\n" not in problem


def test_ordinary_passthrough_flags_pass() -> None:
    from relax.engines.sglang import reserved_flag_problems

    assert reserved_flag_problems((("dtype", ("bfloat16",)), ("enable-torch-compile", ()), ("p", ("1",)))) == []
