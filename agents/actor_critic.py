"""The actor-critic that PPO, APPO and IMPALA share: its network (an MLP, or the Nature CNN for
images), the policy that acts with it on a rollout worker, and the critic's values a rollout's
targets start from (GAE for PPO, V-trace for APPO and IMPALA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.batches import Rollout
from gymflow.agents.networks import (
    action_distribution,
    hidden_layers,
    mlp,
    network_input,
    observation_reader,
    on_device,
    orthogonal_init,
)
from gymflow.envs.agents import actor_entries
from gymflow.envs.make import reads_pixels

ActorCriticSettings = Any  # PPOConfig, APPOConfig or IMPALAConfig: hidden_sizes, activation, log_std_init, normalising

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


class ActorCritic(nn.Module):
    """An actor and a critic head; categorical actions for Discrete, Gaussian for Box. Both read
    the observations through `obs_norm`: for vectors the identity unless normalising, and each
    head is an MLP of `hidden_sizes`; for images the CNN and the hidden layers, which the heads
    share, each head then one linear layer."""

    def __init__(self, obs_dim: int, action_space: spaces.Space, config: ActorCriticSettings, obs_norm: nn.Module,
                 head_hidden_sizes: Sequence[int], actor_inputs: int | None = None):
        super().__init__()
        self.obs_norm = obs_norm
        self.discrete = isinstance(action_space, spaces.Discrete)
        action_dim = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        activation = ACTIVATIONS[config.activation]
        # a centralised critic (MAPPO) reads the whole row; the actor its first `actor_inputs` entries alone
        self.actor_inputs = obs_dim if actor_inputs is None else actor_inputs
        self.actor = mlp(self.actor_inputs, head_hidden_sizes, action_dim, activation)
        self.critic = mlp(obs_dim, head_hidden_sizes, 1, activation)
        self.log_std = nn.Parameter(torch.full((0 if self.discrete else action_dim,), config.log_std_init))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.obs_norm(obs)).squeeze(-1)

    def action_output(self, obs: torch.Tensor) -> torch.Tensor:
        """Logits (Discrete) or the Gaussian's mean (Box)."""
        return self.actor(self._actors_part(self.obs_norm(obs)))

    def distribution_and_value(self, obs: torch.Tensor) -> tuple[torch.distributions.Distribution, torch.Tensor]:
        """Both heads over one read of the observations (for images, one pass of the CNN)."""
        features = self.obs_norm(obs)
        return self._distribution(self.actor(self._actors_part(features))), self.critic(features).squeeze(-1)

    def log_std_for(self, obs: torch.Tensor) -> torch.Tensor:
        """The Gaussian's log standard deviation (Box actions), the same for every observation."""
        return self.log_std

    def _actors_part(self, features: torch.Tensor) -> torch.Tensor:
        return features if self.actor_inputs == features.shape[-1] else features[..., : self.actor_inputs]

    def _distribution(self, out: torch.Tensor) -> torch.distributions.Distribution:
        if self.discrete:
            return action_distribution(out, None)
        return action_distribution(out, self.log_std.exp())


def greedy_actions(network: nn.Module, config: Any = None) -> nn.Module:
    """The actor's most likely action: its logits' argmax (Discrete), its Gaussian's mean (Box)."""
    from gymflow.agents.export import CannotExport, GreedyActions

    if not isinstance(network, ActorCritic):
        raise CannotExport("agent groups acting with separate policies (agent.policies) are exported one graph a "
                           "policy (its name given), not as one")
    return GreedyActions(network, network.action_output, network.discrete)


class PPOPolicy:
    """Acts with an ActorCritic's actor; samples with its own numpy RNG so rollouts replay."""

    def __init__(self, network: ActorCritic, seed: int):
        self.network = network
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return self.act_on(obs, self.outputs(obs), explore)

    @torch.inference_mode()
    def outputs(self, obs: np.ndarray) -> np.ndarray:
        """The actor's logits (Discrete) or Gaussian mean (Box), float64."""
        return self.network.action_output(network_input(obs, self.network)).cpu().numpy().astype(np.float64)

    def act_on(self, obs: np.ndarray, out: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        log_std = None if self.network.discrete else self._log_std(obs)
        return sample_actions(out, log_std, self.network.discrete, self.rng, explore)

    @torch.inference_mode()
    def _log_std(self, obs: np.ndarray) -> np.ndarray:
        return self.network.log_std_for(torch.from_numpy(obs)).detach().numpy()


def sample_actions(out: np.ndarray, log_std: np.ndarray | None, discrete: bool, rng: np.random.Generator, explore: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Actions and their log-probabilities from the actor's output (float64 logits, or the
    Gaussian's mean with `log_std`, [action_dim] or one per row): sampled when exploring, else the
    most likely."""
    if discrete:
        log_p = out - out.max(axis=1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
        if explore:  # Gumbel-max: a categorical sample without torch's per-call overhead
            actions = np.argmax(log_p - np.log(-np.log(rng.random(log_p.shape))), axis=1)
        else:
            actions = np.argmax(log_p, axis=1)
        return actions, log_p[np.arange(len(out)), actions].astype(np.float32)
    std = np.exp(log_std.astype(np.float64))
    noise = rng.standard_normal(out.shape) if explore else np.zeros_like(out)
    actions = out + std * noise
    log_prob = -0.5 * (noise**2).sum(1) - np.log(std).sum(-1) - 0.5 * out.shape[1] * math.log(2 * math.pi)
    return actions.astype(np.float32), log_prob.astype(np.float32)


def make_actor_critic(config: ActorCriticSettings, observation_space: spaces.Box, action_space: spaces.Space
                      ) -> ActorCritic:
    """Vectors: an actor and a critic MLP. Images: the Nature network shared up to its last hidden
    layer, then one linear layer per head (SB3's CnnPolicy, CleanRL's ppo_atari). Either way
    orthogonal weights, gain sqrt 2 for hidden layers, 0.01 for the action output (the first
    policy is near uniform, or near a zero mean), 1 for the value (Huang et al. 2022, detail 2)."""
    reader, width = observation_reader(config, observation_space)
    if reads_pixels(observation_space):
        trunk, width = hidden_layers(width, config.hidden_sizes, ACTIVATIONS[config.activation])
        network = ActorCritic(width, action_space, config, nn.Sequential(reader, trunk), ())
    else:
        actor_inputs = actor_entries(observation_space)  # MAPPO: the rows' global state is the critic's alone
        network = ActorCritic(width, action_space, config, reader, config.hidden_sizes, actor_inputs)
    orthogonal_init(network.obs_norm, math.sqrt(2))
    for head, output_gain in ((network.actor, 0.01), (network.critic, 1.0)):
        orthogonal_init(head[:-1], math.sqrt(2))
        orthogonal_init(head[-1], output_gain)
    return network


def live_observations(rollout: Rollout) -> np.ndarray:
    """What the rollout's envs observed, but for the rows of agents that had left their game."""
    return rollout.obs if rollout.alive is None else rollout.obs[rollout.alive]


def bootstrapped_values(network: ActorCritic, rollout: Rollout, device: torch.device,
                        values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, N] V(s_t) (`values` where the caller has them), and the value each step bootstraps
    from: V(s_t+1), the final observation's value where an episode was truncated, 0 after a
    terminal step (an episode's end, or a lost life that is terminal for learning only)."""
    steps, n = rollout.rewards.shape
    if values is None:
        values = network.value(on_device(rollout.obs, device).flatten(0, 1)).view(steps, n)
    next_values = torch.cat([values[1:], network.value(on_device(rollout.last_obs, device))[None]]).flatten()
    if len(rollout.done_index):
        next_values[on_device(rollout.done_index, device)] = network.value(on_device(rollout.done_obs, device))
    return values, torch.where(on_device(rollout.terminated, device), 0.0, next_values.view(steps, n))


def continuing(rollout: Rollout, device: torch.device) -> torch.Tensor:
    """[T, N] 1.0 where an episode went on after step t, 0.0 where it ended there."""
    return on_device(~(rollout.terminated | rollout.truncated), device).float()


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    variance = returns.var().item()
    return float("nan") if variance == 0 else 1.0 - (returns - values).var().item() / variance
