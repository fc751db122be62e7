"""Checks made before a run starts: a complete checkpoint, a free API port."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from relax.config.checks import (
    RunOutputs,
    check_hf_checkpoint,
    check_port_free,
    find_run_outputs,
    run_dir_decision,
    safetensors_problem,
)


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    save_file({"a": torch.ones(64), "b": torch.zeros(8, 8)}, str(d / "model.safetensors"))
    return d


def test_a_complete_checkpoint_has_no_problem(tmp_path: Path) -> None:
    assert check_hf_checkpoint(str(model_dir(tmp_path))) == []


def test_truncation_is_found_by_the_header_and_the_size(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])
    (problem,) = check_hf_checkpoint(str(d))
    assert "is truncated" in problem and f"{len(data) - 1} bytes, its header needs {len(data)}" in problem


def test_garbage_and_headers_that_lie_are_not_safetensors(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"abc")
    assert "shorter than its header" in safetensors_problem(f)
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert "does not fit" in safetensors_problem(f)
    f.write_bytes(struct.pack("<Q", 4) + b"nope")
    assert "not JSON" in safetensors_problem(f)
    f.write_bytes(struct.pack("<Q", 12) + b'{"t": {"x":1}}'[:12])
    assert safetensors_problem(f) is not None


def test_config_problems_are_named(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "config.json").write_text("{broken")
    (problem,) = check_hf_checkpoint(str(d))
    assert "config.json is not valid JSON" in problem
    (d / "config.json").write_text("[1, 2]")
    assert "not a Hugging Face model config" in check_hf_checkpoint(str(d))[0]
    (d / "config.json").unlink()
    assert "has no config.json" in check_hf_checkpoint(str(d))[0]
    assert "no such file" in check_hf_checkpoint(str(tmp_path / "nope"))[0]
    assert "is required" in check_hf_checkpoint(None)[0]


def test_a_sharded_checkpoint_missing_a_shard_is_named(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model.safetensors",
                                                                               "b": "model-2.safetensors"}}))
    assert check_hf_checkpoint(str(d)) == [f"{d / 'model.safetensors.index.json'} names model-2.safetensors, "
                                           "which is missing"]


def test_a_port_in_use_is_named_and_a_free_one_passes() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        message = check_port_free("127.0.0.1", port)
        assert message is not None and f"--api-port {port}: 127.0.0.1:{port} is already in use" in message
    assert check_port_free("127.0.0.1", port) is None
    assert check_port_free("127.0.0.1", 0) is None


# ---------------------------------------------------------------------------------------------- one run per directory


def test_an_empty_output_directory_starts_fresh_and_a_resume_resumes() -> None:
    assert run_dir_decision(RunOutputs(), None, "out").action == "fresh"
    assert run_dir_decision(RunOutputs(), 20, "out", "ckpt").action == "resume"


def test_another_runs_outputs_are_continued_by_a_resume_only() -> None:
    held = RunOutputs(("metrics.jsonl", "sample_versions.jsonl"), 12)
    assert run_dir_decision(held, 10, "out", "ckpt").action == "resume"  # rows after step 10 are dropped
    decision = run_dir_decision(held, None, "out")
    assert decision.action == "refuse"
    assert decision.problem == (
        "--output-dir out holds another run's outputs (metrics.jsonl, sample_versions.jsonl; metrics up to step 12) "
        "and this run would log its steps again beside them: give this run a fresh --output-dir, or resume that "
        "run with --load <its --save directory>")


def test_a_load_without_a_checkpoint_into_another_runs_outputs_is_refused() -> None:
    decision = run_dir_decision(RunOutputs(("1 TensorBoard event file in tensorboard",)), None, "out", "ckpt")
    assert decision.action == "refuse"
    assert "--load ckpt holds no complete checkpoint to resume it from" in decision.problem
    assert "1 TensorBoard event file in tensorboard" in decision.problem and "\n" not in decision.problem


def _record(data: bytes) -> bytes:  # TFRecord framing (the CRCs are not read)
    return struct.pack("<Q", len(data)) + b"\0" * 4 + data + b"\0" * 4


def test_find_run_outputs_counts_only_files_with_step_rows(tmp_path: Path) -> None:
    out, tb = tmp_path / "out", tmp_path / "out" / "tensorboard"
    tb.mkdir(parents=True)
    assert find_run_outputs(out, tb) == RunOutputs()
    # what a run that stopped before its first step leaves: empty logs, an event file with its header only
    (out / "metrics.jsonl").write_text("")
    (out / "sample_versions.jsonl").write_text("\n")
    (tb / "events.out.tfevents.1.host.1.0").write_bytes(_record(b"version"))
    (out / "summary.json").write_text("{}")
    assert find_run_outputs(out, tb) == RunOutputs()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "kind": "eval"}) + "\n"
                                       + json.dumps({"step": 3, "kind": "train"}) + "\n" + '{"step": 4, "ki')
    (tb / "events.out.tfevents.2.host.2.0").write_bytes(_record(b"version") + _record(b"scalar"))
    (tb / "events.out.tfevents.3.host.3.0").write_bytes(_record(b"version") + _record(b"scal")[:-6])  # torn
    assert find_run_outputs(out, tb) == RunOutputs(("metrics.jsonl", "1 TensorBoard event file in tensorboard"), 3)
    elsewhere = tmp_path / "tb"
    elsewhere.mkdir()
    (elsewhere / "events.out.tfevents.4.host.4.0").write_bytes(_record(b"v") + _record(b"s") + _record(b"s"))
    assert find_run_outputs(out, elsewhere).files[-1] == f"1 TensorBoard event file in {elsewhere}"


# -- --sglang-python and --api-host ----------------------------------------------------------------------


def test_sglang_python_must_be_an_executable_file(tmp_path: Path) -> None:
    from relax.config.checks import check_sglang_python

    assert check_sglang_python(None) is None
    missing = check_sglang_python(str(tmp_path / "nope"))
    assert missing is not None and missing.startswith(f"--sglang-python {tmp_path / 'nope'}: no such file")
    plain = tmp_path / "python"
    plain.write_text("#!/bin/sh\n")
    assert "not an executable file" in (check_sglang_python(str(plain)) or "")
    assert "not an executable file" in (check_sglang_python(str(tmp_path), flag="RELAX_SGLANG_PYTHON") or "")
    plain.chmod(0o755)
    assert check_sglang_python(str(plain)) is None


def test_a_non_loopback_api_host_needs_relax_api_token() -> None:
    from relax.config.checks import check_api_host, is_loopback_host

    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback_host(host) and check_api_host(host, {}) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", ""):
        assert not is_loopback_host(host)
        problem = check_api_host(host, {})
        assert problem is not None and "\n" not in problem
        assert problem.startswith(f"--api-host {host} ") and "set RELAX_API_TOKEN" in problem and "ssh -L" in problem
        assert check_api_host(host, {"RELAX_API_TOKEN": "s3cret"}) is None
        assert check_api_host(host, {"RELAX_API_TOKEN": "  "}) is not None  # blank is unset
