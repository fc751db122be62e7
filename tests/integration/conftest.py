"""One real local Ray cluster per test session (MACHINE-NOTES: ray.init costs 5-8 s)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ctx = ray.init(
        address="local",
        num_cpus=8,
        num_gpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}},
    )
    try:
        yield ctx
    finally:
        ray.shutdown()
