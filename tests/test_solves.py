"""The built-in presets reach their targets on their default settings (minutes, not seconds):
CartPole-v1 >= 475 (SYNC PPO, SYNC DQN, ASYNC DQN, ASYNC APPO; recurrent PPO with the velocities hidden) and
Pendulum-v1 >= -200 (ASYNC SAC)."""

from __future__ import annotations

import pytest

from gymflow.flows.improve import improve
from tests.conftest import local_overrides

pytestmark = [pytest.mark.e2e]
# Long tier: each family learns in the default run elsewhere: PPO Catch from pixels (tests/test_pixels.py), DQN and
# SAC from a picture (tests/test_dict_observations.py), APPO Catch (tests/test_appo.py). Recurrent PPO stays here.
SLOW = {"cartpole-ppo", "cartpole-dqn", "cartpole-dqn-async", "pendulum-sac", "cartpole-appo"}

TARGETS = {  # preset: (target return, env-step budget it must be reached within)
    "cartpole-ppo": (475, 100_000),
    "cartpole-dqn": (475, 100_000),
    "cartpole-dqn-async": (475, 100_000),
    "cartpole-appo": (475, 100_000),
    "cartpole-po-ppo": (475, 100_000),
    "pendulum-sac": (-200, 20_000),
}


# a target within 100k steps: 84-223 s on the AVX-512 kind beside another test, past 300 s on the AVX2 kind
LONG_TIER = [pytest.mark.slow, pytest.mark.timeout(900)]


# default tier (one of its 25 slowest): recurrent PPO's one learning test (cartpole-po-ppo); the other presets' targets are in the long tier
@pytest.mark.parametrize("preset", [pytest.param(p, marks=LONG_TIER) if p in SLOW else p for p in TARGETS])
def test_preset_reaches_its_target(preset, prefect_api, workspace):
    target, budget = TARGETS[preset]
    summary = improve(preset, local_overrides(workspace))
    assert summary.solved
    assert summary.final_return >= target
    assert summary.env_steps <= budget
    if preset.endswith(("async", "sac", "appo")):
        assert summary.shards_inserted > 0 and summary.policy_lag_max <= 8
