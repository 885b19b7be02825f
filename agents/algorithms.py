"""The algorithms gymflow knows: what each needs from an environment, and where its parts live.

This table imports no torch: presets, the command line and the flows read it to check a preset
(`gymflow presets`, `gymflow show`, a run's validation) in a fraction of a second. An algorithm's
networks, policy and learner are imported the first time something builds one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymnasium import spaces

from gymflow.agents.configs import (
    APPOConfig,
    BCConfig,
    DQNConfig,
    IMPALAConfig,
    IQLConfig,
    PPOConfig,
    SACConfig,
    TD3Config,
    epsilon_at,
)

if TYPE_CHECKING:
    from torch import nn

    from gymflow.agents.core import AlgorithmParts, Learner, Policy


def no_exploration(config: Any, env_steps: int) -> float:
    """Algorithms whose policies explore by their own noise, not by a schedule."""
    return 0.0


@dataclass(frozen=True)
class Algorithm:
    name: str
    config: type
    on_policy: bool  # learns only from its current policy's rollouts: no replay memory, no heatup
    action_spaces: tuple[type[spaces.Space], ...]
    reads_images: bool  # uint8 image observations, through a CNN
    module: str  # defines PARTS, an AlgorithmParts (imports torch)
    exploration: Callable[[Any, int], float] = no_exploration  # (config, env_steps) -> exploration parameter
    offline_only: bool = False  # learns from a dataset alone (presets' `dataset`), never collecting
    modes: tuple[str, ...] = ("single", "sync", "async")  # the distribution.mode values it learns in
    acts_from_outputs: bool = False  # its (non-recurrent) policy acts on its network's outputs: ActsFromOutputs
    # its learner's process computes denormal floats as zero (agents/denormals.py): the twin-critic learners,
    # measured; the others' recorded reference results (tests/reference_results.json) keep their arithmetic
    flushes_denormals: bool = False

    def parts(self) -> AlgorithmParts:
        return importlib.import_module(self.module).PARTS

    def learner(self, config: Any, observation_space: spaces.Space, action_space: spaces.Space, seed: int,
                device: str = "cpu") -> Learner:
        """The learner; where `flushes_denormals`, in a process whose CPU threads compute denormal floats
        as zero from then on (agents/denormals.py)."""
        parts = self.parts()
        if self.flushes_denormals:
            from gymflow.agents.denormals import flush_denormals  # imports torch, as parts() just did

            flush_denormals()
        return parts.learner(config, observation_space, action_space, seed, device)

    def network(self, config: Any, observation_space: spaces.Space, action_space: spaces.Space) -> nn.Module:
        """The network a rollout worker acts with (the learner's is one of these), its weights
        to be loaded."""
        parts = self.parts()
        from gymflow.agents.networks import unseeded_init  # imports torch, as parts() just did

        with unseeded_init():
            return parts.network(config, observation_space, action_space)

    def policy(self, network: nn.Module, config: Any, exploration: float, seed: int) -> Policy:
        return self.parts().policy(network, config, exploration, seed)


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm("ppo", PPOConfig, on_policy=True, action_spaces=(spaces.Discrete, spaces.Box),
                     reads_images=True, module="gymflow.agents.ppo", acts_from_outputs=True, modes=("single", "sync")),
    "appo": Algorithm("appo", APPOConfig, on_policy=True, action_spaces=(spaces.Discrete, spaces.Box),
                      reads_images=True, module="gymflow.agents.appo", acts_from_outputs=True, modes=("async",)),
    "impala": Algorithm("impala", IMPALAConfig, on_policy=True, action_spaces=(spaces.Discrete, spaces.Box),
                        reads_images=True, module="gymflow.agents.impala", acts_from_outputs=True, modes=("async",)),
    "dqn": Algorithm("dqn", DQNConfig, on_policy=False, action_spaces=(spaces.Discrete,), reads_images=True,
                     module="gymflow.agents.dqn", exploration=epsilon_at,
                     acts_from_outputs=True),
    "sac": Algorithm("sac", SACConfig, on_policy=False, action_spaces=(spaces.Box,), reads_images=True,
                     module="gymflow.agents.sac", flushes_denormals=True),
    "td3": Algorithm("td3", TD3Config, on_policy=False, action_spaces=(spaces.Box,), reads_images=True,
                     module="gymflow.agents.td3", flushes_denormals=True),
    "bc": Algorithm("bc", BCConfig, on_policy=False, action_spaces=(spaces.Discrete, spaces.Box), reads_images=False,
                    module="gymflow.agents.bc", offline_only=True),
    "iql": Algorithm("iql", IQLConfig, on_policy=False, action_spaces=(spaces.Box,), reads_images=False,
                     module="gymflow.agents.iql", flushes_denormals=True),
}


def algorithm_of(agent_config: Any) -> Algorithm:
    return ALGORITHMS[agent_config.algo]
