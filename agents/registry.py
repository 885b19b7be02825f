"""The algorithms gymflow knows, and what each needs from an environment."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gymnasium import spaces
from torch import nn

from gymflow.agents import dqn, ppo, sac, td3
from gymflow.agents.core import Learner, Policy


@dataclass(frozen=True)
class Algorithm:
    name: str
    on_policy: bool
    action_spaces: tuple[type[spaces.Space], ...]
    reads_images: bool  # uint8 image observations, through a CNN
    learner: Callable[..., Learner]  # (config, observation_space, action_space, seed, device="cpu")
    network: Callable[[Any, spaces.Box, spaces.Space], nn.Module]
    policy: Callable[[nn.Module, Any, float, int], Policy]  # (network, config, exploration, seed)
    exploration: Callable[[Any, int], float]  # (config, env_steps) -> exploration parameter


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(
        name="ppo",
        reads_images=True,
        on_policy=True,
        action_spaces=(spaces.Discrete, spaces.Box),
        learner=ppo.PPOLearner,
        network=ppo.make_network,
        policy=lambda network, config, exploration, seed: ppo.PPOPolicy(network, seed),
        exploration=lambda config, env_steps: 0.0,
    ),
    "dqn": Algorithm(
        name="dqn",
        reads_images=True,
        on_policy=False,
        action_spaces=(spaces.Discrete,),
        learner=dqn.DQNLearner,
        network=dqn.make_network,
        policy=lambda network, config, exploration, seed: dqn.QPolicy(network, exploration, seed),
        exploration=dqn.epsilon_at,
    ),
    "sac": Algorithm(
        name="sac",
        reads_images=False,
        on_policy=False,
        action_spaces=(spaces.Box,),
        learner=sac.SACLearner,
        network=sac.make_actor,
        policy=lambda network, config, exploration, seed: sac.SACPolicy(network, seed),
        exploration=lambda config, env_steps: 0.0,
    ),
    "td3": Algorithm(
        name="td3",
        reads_images=False,
        on_policy=False,
        action_spaces=(spaces.Box,),
        learner=td3.TD3Learner,
        network=td3.make_actor,
        policy=lambda network, config, exploration, seed: td3.TD3Policy(network, config.exploration_noise, seed),
        exploration=lambda config, env_steps: 0.0,
    ),
}


def algorithm_of(agent_config: Any) -> Algorithm:
    return ALGORITHMS[agent_config.algo]
