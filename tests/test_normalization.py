"""Observation and reward normalisation: the statistics are right, one set per learner, frozen
into each policy version's weights, and whatever reads those weights acts as the learner's own
network does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from gymflow.agents.algorithms import algorithm_of
from gymflow.agents.configs import DQNConfig, PPOConfig, SACConfig
from gymflow.agents.dqn import DQNLearner
from gymflow.agents.normalization import ObservationNormalizer, RewardScaler
from gymflow.agents.ppo import PPOLearner
from gymflow.agents.sac import SACLearner
from tests.test_agents import _rollout

OBS = spaces.Box(-100.0, 100.0, shape=(2,), dtype=np.float32)
ACTIONS = spaces.Discrete(2)
BOX_ACTIONS = spaces.Box(-2.0, 2.0, shape=(1,), dtype=np.float32)


def test_running_statistics_are_those_of_every_batch_seen():
    rng = np.random.default_rng(0)
    batches = [rng.normal([5.0, -3.0], [2.0, 0.5], size=(n, 2)) for n in (1, 7, 100, 33)]
    normalizer = ObservationNormalizer((2,), clip=10.0)
    for batch in batches:
        normalizer.update(batch)
    seen = np.concatenate(batches)
    np.testing.assert_allclose(normalizer.mean.numpy(), seen.mean(0), rtol=1e-5)
    np.testing.assert_allclose(normalizer.var.numpy(), seen.var(0), rtol=1e-4)
    scaled = normalizer(torch.tensor([[5.0, -3.0], [1e6, -1e6]], dtype=torch.float32))
    assert scaled.dtype == torch.float32
    assert scaled[0].abs().max() < 0.2 and scaled[1].tolist() == [10.0, -10.0]  # centred; clipped


def test_rewards_scale_by_the_std_of_the_discounted_return_carried_across_iterations():
    scaler = RewardScaler(gamma=0.5)
    ended = np.array([[False], [True], [False]])
    scaler.update([np.array([[1.0], [1.0], [1.0]])], [ended])
    scaler.update([np.array([[2.0], [0.0], [0.0]])], [np.zeros((3, 1), bool)])
    # returns 1, 1.5 (episode ends), 1 | 2.5, 1.25, 0.625: the second iteration continues the first's return
    np.testing.assert_allclose(scaler.returns.var.item(), np.var([1, 1.5, 1, 2.5, 1.25, 0.625]), rtol=1e-3)
    np.testing.assert_allclose(scaler.scale(np.array([3.0])), 3.0 / np.std([1, 1.5, 1, 2.5, 1.25, 0.625]), rtol=1e-3)


@pytest.mark.parametrize(("config", "actions"), [
    (PPOConfig(normalize_observations=True), ACTIONS),
    (PPOConfig(normalize_observations=True), BOX_ACTIONS),
    (DQNConfig(hidden_sizes=[8], normalize_observations=True), ACTIONS),
    (DQNConfig(hidden_sizes=[8, 8], dueling=True, normalize_observations=True), ACTIONS),
    (SACConfig(hidden_sizes=[8], batch_size=4, normalize_observations=True), BOX_ACTIONS),
])
def test_a_policy_version_carries_its_statistics_and_acts_as_the_learners_network(config, actions):
    algorithm = algorithm_of(config)
    learner = algorithm.learner(config, OBS, actions, 0)
    obs = (np.random.default_rng(1).normal(40.0, 5.0, size=(8, 1, 2))).astype(np.float32)
    rollout = _rollout(np.ones(8), [False] * 7 + [True], [False] * 8, obs=obs)
    if isinstance(actions, spaces.Box):
        rollout = rollout._replace(actions=np.zeros((8, 1, 1), np.float32))
    learner.learn([rollout], 0.1)

    assert learner.normalizer is not None and learner.normalizer.mean[0] > 30  # learned from the rollout
    for network in (getattr(learner, name) for name in ("target_network", "critic", "target_critic")
                    if hasattr(learner, name)):
        assert any(module is learner.normalizer for module in network.modules())  # one set of statistics
    weights = {name: tensor.clone() for name, tensor in learner.policy_weights().items()}
    assert any(name.endswith("mean") and tensor.dtype == torch.float64 for name, tensor in weights.items())

    published = algorithm.network(config, OBS, actions)
    published.load_state_dict(weights)
    test_obs = obs.reshape(8, 2)
    own, _ = algorithm.policy(_policy_network(learner), config, 0.0, 0).act(test_obs, explore=False)
    acted, _ = algorithm.policy(published, config, 0.0, 0).act(test_obs, explore=False)
    np.testing.assert_array_equal(acted, own)

    learner.learn([rollout._replace(obs=obs * 3)], 0.2)  # later statistics do not reach the published version
    assert torch.equal(published.state_dict()[_mean_key(weights)], weights[_mean_key(weights)])
    assert not torch.equal(learner.policy_weights()[_mean_key(weights)], weights[_mean_key(weights)])


def test_a_replay_learner_resuming_does_not_count_its_remembered_experience_twice():
    config = DQNConfig(hidden_sizes=[8], normalize_observations=True)
    learner = DQNLearner(config, OBS, ACTIONS, 0)
    rollout = _rollout(np.ones(8), [False] * 8, [False] * 8, obs=np.full((8, 1, 2), 7.0, np.float32))
    learner.insert([rollout])
    count = learner.normalizer.count.item()
    learner.replay.add(rollout)  # what rebuilding the memory on resume does
    assert learner.normalizer.count.item() == count


def _policy_network(learner) -> torch.nn.Module:
    return getattr(learner, "network", None) or getattr(learner, "q_network", None) or learner.actor


def _mean_key(weights: dict) -> str:
    return next(name for name in weights if name.endswith("mean") and weights[name].dtype == torch.float64)


@pytest.mark.parametrize("algo", [PPOLearner, DQNLearner, SACLearner])
def test_without_normalisation_the_networks_and_their_weights_are_unchanged(algo):
    config = {PPOLearner: PPOConfig(), DQNLearner: DQNConfig(), SACLearner: SACConfig()}[algo]
    actions = BOX_ACTIONS if algo is SACLearner else ACTIONS
    learner = algo(config, OBS, actions, 0)
    assert learner.normalizer is None
    assert not any(tensor.dtype == torch.float64 for tensor in learner.policy_weights().values())


@pytest.mark.e2e
def test_the_mlflow_model_applies_the_delivered_versions_statistics_and_scores_as_the_flows_evaluation(
        prefect_api, workspace, tiny_budget):
    """The flow's deciding evaluation and the logged model, on the same seeds, score the same."""
    from types import SimpleNamespace

    from safetensors.torch import load

    from gymflow.envs.seeding import derive_seed
    from gymflow.flows.improve import improve
    from gymflow.presets.model import EnvConfig
    from gymflow.tasks.storage.checkpoints import read_policy
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.tracking.models import score_policy
    from tests.conftest import local_overrides

    run = {**tiny_budget, "env.id": "CartPole-v1", "agent.normalize_observations": True,
           "agent.normalize_rewards": True, **local_overrides(workspace)}
    summary = improve("cartpole-ppo", run)
    policy = read_policy(Storage(StorageLocation(run["storage.root"])), RunLayout(summary.run_id),
                         summary.delivered_version, ["policy.safetensors"])["policy.safetensors"]
    statistics = load(policy)["obs_norm.mean"]
    assert statistics.abs().sum() > 0  # the delivered version's own, frozen into its weights

    shares = np.array_split(np.arange(4), 2)  # evaluation_episodes split across the 2 workers, as the flow does
    returns = [score for part, share in enumerate(shares)
               for score in score_policy.fn(run["tracking.tracking_uri"], SimpleNamespace(uri=summary.model_uri),
                                            EnvConfig(id="CartPole-v1"), len(share), derive_seed(0, "evaluation", part))]
    assert np.mean(returns) == pytest.approx(summary.final_return, abs=1e-9)
