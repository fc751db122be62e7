"""Which process gets which of the run's secrets (``relax.cluster.secret_env``, the engine launcher's list)."""

from __future__ import annotations

from relax.cluster.secret_env import DRIVER_ONLY, withhold, without
from relax.config.checks import wandb_key_warning
from relax.engines import sglang
from relax.engines.launcher import ENGINE_ADMIN_API_KEY_ENV, ENGINE_API_KEY_ENV, WITHHELD_FROM_ENGINES


def test_the_driver_takes_its_secrets_out_of_the_environment_ray_inherits() -> None:
    environ = {"WANDB_API_KEY": "w", "RELAX_API_TOKEN": "t", "PATH": "/bin", "HF_TOKEN": "h"}
    assert withhold(environ, DRIVER_ONLY) == {"WANDB_API_KEY": "w", "RELAX_API_TOKEN": "t"}
    assert environ == {"PATH": "/bin", "HF_TOKEN": "h"}  # a model download may need HF_TOKEN: it stays
    assert withhold(environ, DRIVER_ONLY) == {}


def test_an_engine_server_inherits_none_of_the_runs_secrets() -> None:
    for name in (*DRIVER_ONLY, "RAY_AUTH_TOKEN", ENGINE_API_KEY_ENV, ENGINE_ADMIN_API_KEY_ENV,
                 sglang.SGLANG_API_KEY_ENV, sglang.EXTERNAL_ENGINE_API_KEY_ENV):
        assert name in WITHHELD_FROM_ENGINES, name
    inherited = {name: "secret" for name in WITHHELD_FROM_ENGINES} | {"PATH": "/bin", "HF_TOKEN": "h"}
    assert without(inherited, WITHHELD_FROM_ENGINES) == {"PATH": "/bin", "HF_TOKEN": "h"}


def test_wandb_key_on_the_command_line_gets_a_warning_naming_the_better_ways() -> None:
    assert wandb_key_warning(None) is None and wandb_key_warning("") is None
    warning = wandb_key_warning("secret-9f3a")
    assert warning is not None and "ps" in warning and "WANDB_API_KEY" in warning and "wandb login" in warning
    assert "secret-9f3a" not in warning
