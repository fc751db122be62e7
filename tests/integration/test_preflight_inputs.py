"""The last inputs that failed late: each now fails in pre-flight, before Ray, with one line and no traceback.

In-process (``preflight`` is what the driver runs before it connects to Ray), on copies of the tiny preset
damaged the way a user damages them; plus the two mistakes that only deserve a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from relax.config.checks import check_weight_shapes
from relax.config.flags import parse_args
from relax.entrypoints.train import preflight


def _args(preset, tmp_path: Path, *extra: str, model: Path | None = None):
    return parse_args(["--fully-async", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--hf-checkpoint",
                       str(model or preset.model_dir), "--prompt-data", str(preset.train_path),
                       "--apply-chat-template", "--rm-type", "tiny", "--num-rollout", "2", "--rollout-batch-size",
                       "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--api-port", "0",
                       "--output-dir", str(tmp_path / "out"), *extra])


def _one_line_failure(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        preflight(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "Traceback" not in err, err
    return err


def _copy(preset, tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(preset.model_dir, model)
    return model


def test_load_of_a_missing_directory(tiny_preset, tmp_path, capsys) -> None:
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--load", str(tmp_path / "nope")), capsys)
    assert "--load" in err and "no such directory" in err


def test_load_of_the_save_directory_on_a_first_start_is_fine(tiny_preset, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    preflight(_args(tiny_preset, tmp_path, "--load", ckpt, "--save", ckpt))  # slime's idiom: nothing there yet


def test_load_of_a_hugging_face_model_directory(tiny_preset, tmp_path, capsys) -> None:
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--load", str(tiny_preset.model_dir)), capsys)
    assert "is a Hugging Face model directory, not a Relax checkpoint" in err and "--hf-checkpoint" in err


def test_a_model_type_transformers_does_not_know(tiny_preset, tmp_path, capsys) -> None:
    model = _copy(tiny_preset, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "qwen9"}))
    err = _one_line_failure(_args(tiny_preset, tmp_path, model=model), capsys)
    assert "model_type 'qwen9' is not a model type transformers" in err


def test_weights_of_another_shape_with_a_valid_header(tiny_preset, tmp_path, capsys) -> None:
    model = _copy(tiny_preset, tmp_path)
    state = load_file(str(model / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(state["model.norm.weight"].numel() * 2)
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    err = _one_line_failure(_args(tiny_preset, tmp_path, model=model), capsys)
    assert "tensor model.norm.weight has shape" in err and "different models" in err
    # the same from transformers' meta model, for architectures the built-in decoder does not know
    (problem,) = check_weight_shapes(model)
    assert "tensor model.norm.weight has shape" in problem
    assert check_weight_shapes(tiny_preset.model_dir) == []


def test_a_garbage_tokenizer(tiny_preset, tmp_path, capsys) -> None:
    model = _copy(tiny_preset, tmp_path)
    (model / "tokenizer.json").write_text("{not json")
    err = _one_line_failure(_args(tiny_preset, tmp_path, model=model), capsys)
    assert "its tokenizer cannot be loaded" in err


def test_a_prompt_file_smaller_than_one_batch_is_warned_about(tiny_preset, tmp_path, caplog) -> None:
    small = tmp_path / "small.jsonl"
    small.write_text("".join(tiny_preset.train_path.read_text().splitlines(keepends=True)[:2]))
    args = dataclasses.replace(_args(tiny_preset, tmp_path), prompt_data=str(small))
    with caplog.at_level(logging.WARNING, logger="relax.train"):
        preflight(args)
    assert "has 2 prompt(s), fewer than one batch (--rollout-batch-size 4)" in caplog.text


def test_a_resume_past_num_rollout_is_warned_about(tiny_preset, tmp_path, caplog) -> None:
    from relax.training.checkpoint import STATE_FILE, checkpoint_name

    save = tmp_path / "ckpt"
    done = save / checkpoint_name(5)
    done.mkdir(parents=True)
    (done / STATE_FILE).write_text(json.dumps({"format_version": 1, "step": 5, "world_size": 1}))
    with caplog.at_level(logging.WARNING, logger="relax.train"):
        preflight(_args(tiny_preset, tmp_path, "--load", str(done)))
    assert "resumes at step 5 and --num-rollout is 2: there is nothing left to train" in caplog.text


# ---------------------------------------------------------------------------------------------- --load and --output-dir


def _fake_checkpoint(save: Path, step: int) -> Path:
    from relax.training.checkpoint import OPTIMIZER_FILE, STATE_FILE, checkpoint_name, write_latest

    path = save / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w")
    (path / OPTIMIZER_FILE).write_bytes(b"o")
    (path / STATE_FILE).write_text(json.dumps({"format_version": 1, "step": step, "world_size": 1}))
    write_latest(save, path)
    return path


def test_load_of_a_directory_without_checkpoints_starts_from_hf_checkpoint_with_one_warning(
        tiny_preset, tmp_path, caplog) -> None:
    from relax.entrypoints.train import Driver

    empty = tmp_path / "empty"
    (empty / ".tmp-step_000010-abcd1234").mkdir(parents=True)  # an interrupted first save
    args = _args(tiny_preset, tmp_path, "--load", str(empty))
    preflight(args)
    with caplog.at_level(logging.INFO):
        assert Driver(args, plan=None)._maybe_resume() == (0, None)  # type: ignore[arg-type]
    (record,) = [r for r in caplog.records if r.name == "relax.train"]
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert f"--load {empty} holds no checkpoint" in record.getMessage()
    assert f"starting from --hf-checkpoint {tiny_preset.model_dir}" in record.getMessage()


def test_load_of_an_unfinished_checkpoint_directory(tiny_preset, tmp_path, capsys) -> None:
    unfinished = tmp_path / "ckpt" / "step_000010"
    unfinished.mkdir(parents=True)
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--load", str(unfinished)), capsys)
    assert "is not a complete checkpoint" in err


def _write_events(tb: Path, steps: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb))
    for step in range(1, steps + 1):
        writer.add_scalar("rollout/reward_mean", 0.5, step)
    writer.close()


def test_a_fresh_start_into_another_runs_output_dir_is_refused(tiny_preset, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    _write_events(out / "tensorboard", 3)
    err = _one_line_failure(_args(tiny_preset, tmp_path), capsys)
    assert f"--output-dir {out} holds another run's outputs (1 TensorBoard event file in tensorboard)" in err
    assert "fresh --output-dir" in err and "--load" in err
    # with --load == --save and no checkpoint there yet (slime's idiom), the rows are still not that run's
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}) + "\n")
    ckpt = str(tmp_path / "ckpt")
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--load", ckpt, "--save", ckpt), capsys)
    assert "metrics up to step 1" in err and f"--load {ckpt} holds no complete checkpoint" in err


def test_a_start_into_a_run_that_stopped_before_its_first_step_is_fine(tiny_preset, tmp_path) -> None:
    out = tmp_path / "out"
    _write_events(out / "tensorboard", 0)  # the header every writer starts its file with, nothing logged
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (out / "metrics.jsonl").write_text("")
    (out / "sample_versions.jsonl").write_text("")
    preflight(_args(tiny_preset, tmp_path))


def test_a_resume_continues_the_run_directory(tiny_preset, tmp_path) -> None:
    out, save = tmp_path / "out", tmp_path / "ckpt"
    _write_events(out / "tensorboard", 12)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "kind": "train"}) + "\n" for s in (1, 2)))
    _fake_checkpoint(save, 1)
    preflight(_args(tiny_preset, tmp_path, "--load", str(save), "--save", str(save)))


# -- the flags a real start and --dry-run both refuse (one line each) -------------------------------------


def test_reserved_sglang_flags_fail_in_preflight(tiny_preset, tmp_path, capsys) -> None:
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--sglang-port", "30000", "--sglang-tp", "2"), capsys)
    assert "--sglang-port: SGLang's --port is set by Relax" in err and "--sglang-tp: SGLang's --tp" in err


def test_a_missing_sglang_python_fails_in_preflight(tiny_preset, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RELAX_SGLANG_PYTHON", raising=False)
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--sglang-python", str(tmp_path / "py")), capsys)
    assert f"--sglang-python {tmp_path / 'py'}: no such file" in err
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", str(tmp_path))
    err = _one_line_failure(_args(tiny_preset, tmp_path), capsys)
    assert f"RELAX_SGLANG_PYTHON {tmp_path}: not an executable file" in err


def test_a_wide_api_host_without_a_token_fails_in_preflight(tiny_preset, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)
    err = _one_line_failure(_args(tiny_preset, tmp_path, "--api-host", "0.0.0.0"), capsys)
    assert "--api-host 0.0.0.0" in err and "set RELAX_API_TOKEN" in err
    monkeypatch.setenv("RELAX_API_TOKEN", "an-operators-token")
    preflight(_args(tiny_preset, tmp_path, "--api-host", "0.0.0.0"))


def test_the_builtin_backend_ignores_sglang_flags(tiny_preset, tmp_path) -> None:
    preflight(_args(tiny_preset, tmp_path, "--rollout-backend", "builtin", "--sglang-port", "1"))


def test_an_output_dir_that_is_a_file_is_one_line(tiny_preset, tmp_path, capsys) -> None:
    (tmp_path / "out").write_text("not a directory")
    err = _one_line_failure(_args(tiny_preset, tmp_path), capsys)
    assert f"--output-dir {tmp_path / 'out'}: cannot be used as the run's directory" in err
