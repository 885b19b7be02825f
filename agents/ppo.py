"""Proximal Policy Optimization (Schulman et al. 2017), as gymflow trains it: feed-forward
actor-critics learnt by agents/ppo_learner.py, LSTM ones (agent.recurrent) by
agents/recurrent.py, which builds on the same clipped objective. This module picks between them.
"""

from __future__ import annotations

from typing import Any

from gymnasium import spaces
from torch import nn

from gymflow.agents.actor_critic import PPOPolicy, greedy_actions
from gymflow.agents.configs import PPOConfig
from gymflow.agents.core import AlgorithmParts
from gymflow.agents.export import GreedyActionsWithMemory
from gymflow.agents.ppo_learner import PPOLearner, make_network
from gymflow.agents.recurrent import RecurrentPolicy, RecurrentPPOLearner, make_recurrent_network

__all__ = ["PARTS", "PPOLearner", "PPOPolicy", "make_learner", "make_network"]


def make_learner(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space, seed: int,
                 device: str = "cpu") -> PPOLearner:
    """The feed-forward learner, or with agent.recurrent the recurrent one (a PPOLearner too)."""
    kind = PPOLearner if config.recurrent is None else RecurrentPPOLearner
    return kind(config, observation_space, action_space, seed, device)


def _network(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space) -> nn.Module:
    if config.recurrent is None:
        return make_network(config, observation_space, action_space)
    return make_recurrent_network(config, observation_space, action_space)


def _policy(network: nn.Module, config: PPOConfig, exploration: float, seed: int) -> Any:
    return PPOPolicy(network, seed) if config.recurrent is None else RecurrentPolicy(network, seed)


def _greedy(network: nn.Module, config: PPOConfig) -> nn.Module:
    if config.recurrent is not None:  # memory in, memory out
        return GreedyActionsWithMemory(network, network.discrete)
    return greedy_actions(network)


PARTS = AlgorithmParts(learner=make_learner, network=_network, policy=_policy, greedy=_greedy)
