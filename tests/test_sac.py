"""SAC end to end under a real Prefect API and Dask workers: it learns to walk toward a goal whose
side it must read (tests/test_agents.py has its learner alone; tests/test_learners.py its losses)."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest

from gymflow.agents.rollout import RandomPolicy, evaluate
from gymflow.envs.vector import SeededVectorEnv
from gymflow.flows.improve import improve
from tests.conftest import local_overrides

TWO_WAY = "gymflow.testing.envs:TwoWayCorridor"


class _AlwaysRight:
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return np.ones((len(obs), 1), np.float32), np.zeros(len(obs), np.float32)


def test_a_policy_that_does_not_read_the_goals_side_wins_half_the_time():
    env = SeededVectorEnv(TWO_WAY, {}, 50, seed=1)
    env.reset()
    always_right = evaluate(_AlwaysRight(), env).returns
    env.reset()
    at_random = evaluate(RandomPolicy(env.action_space, seed=0), env).returns
    assert 0.3 < (always_right > 0).mean() < 0.7 and at_random.mean() < 0.6


# default tier: SAC learning end to end, on vectors: 7.3 s at half the CPU (its learning from a picture, three
# CNNs, is in the long tier: tests/test_dict_observations.py, 112 s at half the CPU)
@pytest.mark.e2e
def test_sac_learns_to_walk_toward_a_goal_on_either_side(prefect_api, workspace):
    summary = improve("pendulum-sac", {
        "env.id": TWO_WAY, "agent.normalize_observations": True, "agent.entropy_coef": 0.01,
        "agent.hidden_sizes": [64, 64], "agent.batch_size": 64, "agent.train_steps_per_iteration": 32,
        "agent.replay_capacity": 20000, "schedule.heatup_env_steps": 500, "schedule.rollout_steps_per_env": 32,
        "schedule.total_env_steps": 8000, "schedule.evaluate_every_env_steps": 1024,
        "schedule.evaluation_episodes": 20, "schedule.target_return": 0.9, "distribution.mode": "sync",
        "distribution.envs_per_worker": 2, "distribution.learner_threads": 1, **local_overrides(workspace)})
    assert summary.solved and summary.final_return >= 0.9, summary
    mlflow.set_tracking_uri(local_overrides(workspace)["tracking.tracking_uri"])
    model = mlflow.pyfunc.load_model(summary.model_uri)
    env = SeededVectorEnv(TWO_WAY, {}, 6, seed=0)
    observations = env.reset()
    goals_right = observations[:, 1] == 1.0
    assert 0 < goals_right.sum() < 6  # both sides among them
    np.testing.assert_array_equal(np.asarray(model.predict(observations))[:, 0] > 0, goals_right)  # walk toward it
