"""relax.training.tracking's pure rules: the W&B config never holds a secret, the run id a resume reuses, the
mode, the flags, and the pre-flight line for a missing wandb package (no wandb needed, milliseconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from relax.config.checks import WANDB_INSTALL, check_wandb
from relax.config.flags import ConfigError, parse_args
from relax.training import tracking

KEY = "0123456789abcdef0123456789abcdef01234567"


def _args(*extra: str):
    return parse_args(["--use-wandb", "--wandb-project", "proj", "--wandb-key", KEY, "--wandb-team", "team",
                       "--sglang-api-key", "engine-secret", "--sglang-chunked-prefill-size", "4096",
                       "--sglang-admin-api-key=admin-secret", "--input-key", "question", *extra])


def test_the_wandb_flags_are_real_not_ignored():
    args = _args("--wandb-group", "g", "--wandb-run-id", "abc", "--wandb-host", "https://wandb.example",
                 "--wandb-mode", "offline")
    assert (args.use_wandb, args.wandb_project, args.wandb_group, args.wandb_team, args.wandb_run_id,
            args.wandb_key, args.wandb_host, args.wandb_mode) == (
        True, "proj", "g", "team", "abc", KEY, "https://wandb.example", "offline")
    assert not any("wandb" in flag for flag in args.ignored_flags)
    assert KEY not in repr(args)


def test_a_bad_wandb_mode_is_one_line():
    with pytest.raises(ConfigError) as error:
        parse_args(["--wandb-mode", "sometimes"])
    message = str(error.value)
    assert "\n" not in message and message.startswith("--wandb-mode: invalid choice: 'sometimes'")
    assert "online" in message and "offline" in message


def test_the_config_holds_every_flag_but_no_secret():
    config = tracking.run_config(_args())
    text = json.dumps(config)  # JSON-able, as W&B stores it
    for secret in (KEY, "engine-secret", "admin-secret"):
        assert secret not in text
    assert "wandb_key" not in config
    assert config["wandb_project"] == "proj" and config["input_key"] == "question"  # a data column is no secret
    assert config["rollout_batch_size"] == 32 and config["weight_sync"] == "broadcast"  # defaults, enums by value
    assert config["sglang_passthrough"] == {"chunked-prefill-size": ["4096"]}
    assert config["argv"][config["argv"].index("--wandb-key") + 1] == tracking.MASK
    assert "--sglang-admin-api-key=***" in config["argv"] and "question" in config["argv"]


@pytest.mark.parametrize("name, secret", [
    ("--wandb-key", True), ("wandb_key", True), ("--sglang-api-key=x", True), ("api_key", True),
    ("--hf-token", True), ("client_secret", True), ("--password", True),
    ("--input-key", False), ("label_key", False), ("--reward-key", False), ("--max-tokens-per-gpu", False),
    ("--apply-chat-template", False), ("tokenizer", False),
])
def test_secret_names(name, secret):
    assert tracking.is_secret_name(name) is secret


def test_scrub_argv_masks_values_by_flag_and_by_value():
    argv = ["--wandb-key", KEY, "--lr", "1e-6", "--wandb-key=" + KEY, "--note", KEY, "--use-wandb"]
    assert tracking.scrub_argv(argv, [KEY]) == [
        "--wandb-key", "***", "--lr", "1e-6", "--wandb-key=***", "--note", "***", "--use-wandb"]
    assert tracking.scrub_argv(["--wandb-key", "--lr", "1"]) == ["--wandb-key", "--lr", "1"]  # no value to hide


@pytest.mark.parametrize("flag_id, stored, resuming, expected", [
    (None, None, False, "fresh"),  # first start: a new id
    (None, "first", False, "fresh"),  # a fresh start never takes over the directory's old id
    (None, "first", True, "first"),  # a resume continues the run it resumes
    (None, None, True, "fresh"),  # a resume of a run that had no W&B run
    ("given", "first", True, "given"),  # --wandb-run-id always wins
    ("given", None, False, "given"),
])
def test_the_run_id_rule(flag_id, stored, resuming, expected):
    assert tracking.choose_run_id(flag_id, stored, resuming, "fresh") == expected


def test_the_stored_id(tmp_path: Path):
    assert tracking.read_run_id(tmp_path) is None
    (tmp_path / tracking.RUN_ID_FILE).write_text("abc123\n")
    assert tracking.read_run_id(tmp_path) == "abc123"
    new = tracking.new_run_id()
    assert len(new) == 8 and new.isalnum() and new == new.lower() and new != tracking.new_run_id()


@pytest.mark.parametrize("flag, env, mode", [
    (None, None, "online"), ("offline", "online", "offline"), ("online", "offline", "online"),
    (None, "offline", "offline"), (None, "dryrun", "offline"), (None, "disabled", "disabled"),
    (None, "bogus", "online"),
])
def test_the_mode_flag_wins_over_wandb_mode(flag, env, mode):
    assert tracking.resolve_mode(flag, {} if env is None else {"WANDB_MODE": env}) == mode


def test_scalars_are_the_numbers_of_a_row():
    row = {"step": 3, "kind": "train", "rollout/reward_mean": 0.5, "engines/active": 2, "x/flag": True,
           "note": "text", "lens": [1, 2]}
    assert tracking.scalars(row) == {"rollout/reward_mean": 0.5, "engines/active": 2, "x/flag": True}


def test_without_use_wandb_nothing_starts_and_wandb_is_not_imported(tmp_path: Path):
    loaded = "wandb" in sys.modules
    assert tracking.start(parse_args([]), tmp_path, resuming=False) is tracking.NO_TRACKING
    assert ("wandb" in sys.modules) == loaded
    tracking.NO_TRACKING.log({"step": 1, "a": 1.0})
    tracking.NO_TRACKING.end({}, None)
    tracking.NO_TRACKING.finish()
    assert not (tmp_path / tracking.RUN_ID_FILE).exists()


def test_wandb_mode_disabled_starts_nothing(tmp_path: Path):
    args = parse_args(["--use-wandb"])
    assert tracking.start(args, tmp_path, False, environ={"WANDB_MODE": "disabled"}) is tracking.NO_TRACKING


def test_preflight_names_the_fix_when_wandb_is_missing(monkeypatch):
    import importlib.util

    assert check_wandb(False) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    problem = check_wandb(True)
    assert problem is not None and "\n" not in problem and WANDB_INSTALL in problem
    assert problem.startswith("--use-wandb needs the wandb package")
    assert check_wandb(False) is None


class _FailingRun:
    """A W&B run whose disk is full: every log raises."""

    id = "abc12345"

    def __init__(self) -> None:
        self.finished: list[int | None] = []
        self.logged = 0

    def log(self, values, step=None):
        self.logged += 1
        raise OSError(28, "No space left on device")

    def finish(self, exit_code=None):
        self.finished.append(exit_code)


class _FakeWandb:
    def __init__(self) -> None:
        self.teardowns = 0

    def teardown(self) -> None:
        self.teardowns += 1


def test_a_wandb_failure_during_the_run_is_one_line_and_tracking_stops(caplog):
    run, wandb = _FailingRun(), _FakeWandb()
    tracker = tracking.WandbTracking(wandb, run)
    with caplog.at_level("WARNING", logger="relax.train"):
        for step in (1, 2, 3):
            tracker.log({"step": step, "kind": "train", "rollout/reward_mean": 0.5})  # never raises
        tracker.end({"training_steps": 3}, None)
        tracker.finish()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "No space left on device" in warnings[0] and "training goes on without W&B" in warnings[0]
    assert run.logged == 1 and run.finished == [1] and wandb.teardowns == 1
