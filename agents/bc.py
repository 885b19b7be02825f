"""Behaviour cloning: a policy fitted to a dataset's actions by supervised learning.

Discrete actions: the cross-entropy of the policy's logits against the action taken; it acts
greedily (sampling from its softmax when exploring). Continuous actions: a tanh actor regressed on
the actions taken, in its [-1, 1] units (mean squared error); it acts with its output. BC learns
offline only: its memory holds the dataset (presets' `dataset`), and it never collects.
"""

from __future__ import annotations

import numpy as np
import torch
from gymnasium import spaces
from torch import nn
from torch.nn import functional as F

from gymflow.agents.batches import Sample
from gymflow.agents.configs import BCConfig
from gymflow.agents.core import AlgorithmParts, ReplayLearner
from gymflow.agents.export import GreedyActions
from gymflow.agents.networks import Adam, cpu_weights, mlp, on_device, seeded_init, step_optimizer
from gymflow.agents.normalization import observation_normalizer, share_normalizer
from gymflow.agents.replay import MemorySpec, ReplayMemory
from gymflow.agents.td3 import DeterministicActor
from gymflow.agents.training_state import SavedWhole
from gymflow.envs.vector import observation_dtype


class LogitsPolicyNetwork(nn.Module):
    """obs -> one logit per discrete action."""

    def __init__(self, inputs: int, hidden: list[int], actions: int, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.net = mlp(inputs, hidden, actions, nn.ReLU)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.obs_norm(obs))


def make_network(config: BCConfig, observation_space: spaces.Box, action_space: spaces.Space) -> nn.Module:
    obs_norm = observation_normalizer(config, observation_space.shape)
    inputs = int(np.prod(observation_space.shape))
    if isinstance(action_space, spaces.Discrete):
        return LogitsPolicyNetwork(inputs, config.hidden_sizes, int(action_space.n), obs_norm)
    return DeterministicActor(inputs, config.hidden_sizes, action_space, obs_norm)


class ClonedPolicy:
    """The cloned policy's action: the most likely discrete one (sampled from its softmax when
    exploring), or the actor's continuous one."""

    def __init__(self, network: nn.Module, seed: int):
        self.network = network
        self.rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        output = self.network(torch.from_numpy(obs))
        if isinstance(self.network, DeterministicActor):
            return self.network.to_env(output).numpy().astype(np.float32), np.zeros(len(obs), np.float32)
        probabilities = torch.softmax(output, dim=1).numpy().astype(np.float64)
        if explore:
            cumulative = probabilities.cumsum(axis=1)
            draws = self.rng.random((len(obs), 1)) * cumulative[:, -1:]
            actions = np.minimum((cumulative < draws).sum(axis=1), probabilities.shape[1] - 1)
        else:
            actions = probabilities.argmax(axis=1)
        return actions, np.log(probabilities[np.arange(len(obs)), actions]).astype(np.float32)


def cloning_loss(network: nn.Module, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against discrete actions; squared error against continuous ones, in the
    actor's [-1, 1] units (actions outside the env's bounds clipped to them). Pure."""
    if isinstance(network, DeterministicActor):
        return F.mse_loss(network(obs), network.from_env(actions).clamp(-1.0, 1.0))
    return F.cross_entropy(network(obs), actions.long())


class BCLearner(SavedWhole, ReplayLearner):
    TRAINING_STATE = ("network", "optimizer", "rng", "train_steps")

    def __init__(self, config: BCConfig, observation_space: spaces.Box, action_space: spaces.Space, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.network = make_network(config, observation_space, action_space)
        self.network.to(self.device)
        self.normalizer = share_normalizer(self.network)
        self.optimizer = Adam(self.network.parameters(), lr=config.lr)
        discrete = isinstance(action_space, spaces.Discrete)
        self.replay = ReplayMemory(MemorySpec(
            config.replay_capacity, tuple(observation_space.shape), observation_dtype(observation_space),
            tuple(action_space.shape), np.int64 if discrete else np.float32, gamma=1.0))
        self.rng = np.random.default_rng(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.network)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.network.load_state_dict(weights)

    def update(self, sample: Sample) -> dict[str, float]:
        batch = sample.transitions
        loss = cloning_loss(self.network, on_device(batch.obs, self.device), on_device(batch.actions, self.device))
        step_optimizer(self.optimizer, loss)
        self.train_steps += 1
        return {"cloning_loss": loss.item()}


PARTS = AlgorithmParts(
    learner=BCLearner,
    network=make_network,
    policy=lambda network, config, exploration, seed: ClonedPolicy(network, seed),
    greedy=lambda network, config: GreedyActions(network, lambda obs: network.to_env(network(obs)), discrete=False)
    if isinstance(network, DeterministicActor) else GreedyActions(network, network, discrete=True),
)
