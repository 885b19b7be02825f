"""Deep Q-Networks: a target network, an epsilon-greedy schedule, a replay memory.

Mnih et al. 2015, with the usual options: double Q-learning (van Hasselt et al. 2016), dueling
heads (Wang et al. 2016), n-step returns, prioritized replay (Schaul et al. 2016), and for
learning from a dataset the conservative penalty of CQL (Kumar et al. 2020). SYNC: each
iteration inserts the new transitions, then takes `train_steps_per_iteration` gradient steps.
ASYNC: the caller inserts (`insert`) and trains (`train`) at its own ratio.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from gymnasium import spaces
from torch import nn
from torch.nn import functional as F

from gymflow.agents.batches import Sample
from gymflow.agents.configs import DQNConfig
from gymflow.agents.core import AlgorithmParts, ReplayLearner
from gymflow.agents.data_parallel import Share
from gymflow.agents.export import GreedyActions
from gymflow.agents.networks import (
    Adam,
    TransitionBatch,
    cpu_weights,
    mlp,
    network_input,
    observation_reader,
    seeded_init,
    weighted_mean,
)
from gymflow.agents.normalization import share_normalizer
from gymflow.agents.replay import make_replay, memory_spec
from gymflow.agents.training_state import SavedWhole


class DuelingQNetwork(nn.Module):
    """A shared trunk, then a state value and action advantages: Q = V + A - mean(A)."""

    def __init__(self, inputs: int, hidden: list[int], actions: int, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.trunk = mlp(inputs, hidden[:-1], hidden[-1], nn.ReLU) if len(hidden) > 1 else nn.Linear(inputs, hidden[0])
        self.value = nn.Linear(hidden[-1], 1)
        self.advantage = nn.Linear(hidden[-1], actions)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.trunk(self.obs_norm(obs)))
        advantage = self.advantage(features)
        return self.value(features) + advantage - advantage.mean(dim=1, keepdim=True)


def make_network(config: DQNConfig, observation_space: spaces.Box, action_space: spaces.Discrete) -> nn.Module:
    """An MLP of Q-values over the observations (images: over the CNN's features)."""
    reader, inputs = observation_reader(config, observation_space)
    actions = int(action_space.n)
    if config.dueling:
        return DuelingQNetwork(inputs, config.hidden_sizes, actions, reader)
    q_values = mlp(inputs, config.hidden_sizes, actions, nn.ReLU)
    return q_values if isinstance(reader, nn.Identity) else nn.Sequential(reader, *q_values)


class QPolicy:
    """Greedy in the Q-values, with probability epsilon a uniform random action instead."""

    def __init__(self, network: nn.Module, epsilon: float, seed: int):
        self.network = network
        self.epsilon = epsilon
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return self.act_on(obs, self.outputs(obs), explore)

    @torch.inference_mode()
    def outputs(self, obs: np.ndarray) -> np.ndarray:
        return self.network(network_input(obs, self.network)).cpu().numpy()

    def act_on(self, obs: np.ndarray, q_values: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        actions = q_values.argmax(axis=1)
        if explore and self.epsilon > 0:
            random = self.rng.random(len(obs)) < self.epsilon
            actions = np.where(random, self.rng.integers(0, q_values.shape[1], len(obs)), actions)
        return actions, np.zeros(len(obs), dtype=np.float32)


@dataclass(frozen=True)
class DQNLossTerms:
    loss: torch.Tensor  # what is minimised
    td_errors: torch.Tensor  # [B] y - Q(s, a), detached: the new priorities
    q_taken: torch.Tensor  # [B] Q(s, a), detached
    conservative_penalty: torch.Tensor | None = None  # CQL's, detached, where it is on


def dqn_loss(q_network: nn.Module, target_network: nn.Module, batch: TransitionBatch, double_q: bool,
             cql_alpha: float = 0.0) -> DQNLossTerms:
    """The importance-weighted Huber loss of Q(s, a) against y = r + gamma^n max_a' Q'(s', a') (Mnih
    et al. 2015); with double Q-learning the online network picks a' and the target values it;
    with `cql_alpha` > 0, plus CQL's conservative penalty. Pure: nothing is stepped."""
    with torch.no_grad():
        next_target_q = target_network(batch.next_obs)
        if double_q:
            next_actions = q_network(batch.next_obs).argmax(dim=1, keepdim=True)
            next_q = next_target_q.gather(1, next_actions).squeeze(1)
        else:
            next_q = next_target_q.max(dim=1).values
        targets = batch.rewards + batch.discounts * next_q
    q_values = q_network(batch.obs)
    q_taken = q_values.gather(1, batch.actions[:, None]).squeeze(1)
    loss = weighted_mean(F.smooth_l1_loss(q_taken, targets, reduction="none"), batch.weights)
    if cql_alpha == 0:
        return DQNLossTerms(loss, (targets - q_taken).detach(), q_taken.detach())
    penalty = conservative_penalty(q_values, q_taken)
    return DQNLossTerms(loss + cql_alpha * penalty, (targets - q_taken).detach(), q_taken.detach(), penalty.detach())


def conservative_penalty(q_values: torch.Tensor, q_taken: torch.Tensor) -> torch.Tensor:
    """CQL(H): E[logsumexp_a Q(s, a) - Q(s, a_data)], a soft maximum over actions pushed down and the
    dataset's action pushed up. Pure."""
    return (torch.logsumexp(q_values, dim=1) - q_taken).mean()


class DQNLearner(SavedWhole, ReplayLearner):
    TRAINING_STATE = ("q_network", "target_network", "optimizer", "rng", "train_steps")

    def __init__(self, config: DQNConfig, observation_space: spaces.Box, action_space: spaces.Discrete, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.q_network = make_network(config, observation_space, action_space).to(self.device)
        self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)
        self.normalizer = share_normalizer(self.q_network, self.target_network)
        self.optimizer = Adam(self.q_network.parameters(), lr=config.lr, fused=True)
        self.replay = make_replay(memory_spec(config, observation_space, action_space, config.n_step), config)
        self.rng = np.random.default_rng(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.q_network)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.q_network.load_state_dict(weights)
        self.target_network.load_state_dict(weights)

    def update(self, sample: Sample, share: Share | None = None) -> dict[str, float]:
        """One gradient step; the target network copies the online one every
        `target_update_every_train_steps` of them."""
        batch = TransitionBatch.on(sample if share is None else share.of_sample(sample), self.device)
        terms = dqn_loss(self.q_network, self.target_network, batch, self.config.double_q, self.config.cql_alpha)
        self.optimizer.zero_grad()
        terms.loss.backward()
        if share is not None:
            share.average_gradients(list(self.q_network.parameters()))
        nn.utils.clip_grad_norm_(self.q_network.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.reprioritize(sample, lambda: terms.td_errors, share)
        self.train_steps += 1
        if self.train_steps % self.config.target_update_every_train_steps == 0:
            self.target_network.load_state_dict(self.q_network.state_dict())
        metrics = {"td_loss": terms.loss.item(), "q_mean": terms.q_taken.mean().item()}
        if terms.conservative_penalty is not None:
            metrics["cql_penalty"] = terms.conservative_penalty.item()
        return metrics

PARTS = AlgorithmParts(
    learner=DQNLearner,
    network=make_network,
    policy=lambda network, config, exploration, seed: QPolicy(network, exploration, seed),
    greedy=lambda network, config: GreedyActions(network, network, discrete=True),  # the most valued action
)
