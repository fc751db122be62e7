"""Fixtures shared by the unit tests of the control plane's routes."""

from __future__ import annotations

import pytest

from relax.testing.local_rollout import LocalRollout


@pytest.fixture
async def backend():
    """The rollout manager's control API over a stepped fleet of 2 initial engines (no Ray, no engines)."""
    rollout = LocalRollout(initial_engines=2)
    yield rollout
    await rollout.aclose()
