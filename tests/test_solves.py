"""The built-in presets solve CartPole-v1 on their default settings (minutes, not seconds)."""

from __future__ import annotations

import pytest

from flows.improve import improve
from tests.conftest import local_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("preset", ["cartpole-ppo", "cartpole-dqn"])
def test_preset_reaches_475_on_cartpole(preset, prefect_api, workspace):
    summary = improve(preset, local_overrides(workspace))
    assert summary.solved
    assert summary.final_return >= 475
    assert summary.env_steps <= {"cartpole-ppo": 100_000, "cartpole-dqn": 100_000}[preset]
