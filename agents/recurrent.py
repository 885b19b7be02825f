"""Recurrent PPO: an LSTM between the observation encoder and PPO's two heads, for envs that do not
show everything at once (CleanRL's ppo_atari_lstm, SB3-contrib's RecurrentPPO).

The policy carries each env's memory (the LSTM's h and c) from step to step and zeroes it where an
episode ends; a rollout keeps the memory it started from, so the learner replays each env's
sequence exactly: the same steps, the same resets, the same log-probabilities. Minibatches are
whole env sequences (truncated backpropagation through the rollout).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.actor_critic import ACTIVATIONS, sample_actions
from gymflow.agents.batches import Rollout
from gymflow.agents.configs import PPOConfig
from gymflow.agents.networks import action_distribution, hidden_layers, on_device, orthogonal_init
from gymflow.agents.normalization import observation_normalizer
from gymflow.agents.ppo_learner import PPOLearner, PPOLossTerms, clipped_objective, generalized_advantages

Batch = dict[str, torch.Tensor]


class RecurrentActorCritic(nn.Module):
    """obs -> normaliser -> MLP encoder -> LSTM -> actor and critic heads (one linear layer each)."""

    def __init__(self, observation_space: spaces.Box, action_space: spaces.Space, config: PPOConfig):
        super().__init__()
        assert config.recurrent is not None
        self.obs_norm = observation_normalizer(config, observation_space.shape)
        self.encoder, width = hidden_layers(int(observation_space.shape[0]), config.hidden_sizes,
                                            ACTIVATIONS[config.activation])
        self.lstm = nn.LSTMCell(width, config.recurrent)
        self.discrete = isinstance(action_space, spaces.Discrete)
        action_dim = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        self.actor = nn.Linear(config.recurrent, action_dim)
        self.critic = nn.Linear(config.recurrent, 1)
        self.log_std = nn.Parameter(torch.full((0 if self.discrete else action_dim,), config.log_std_init))

    @property
    def memory_size(self) -> int:
        return self.lstm.hidden_size

    def initial_memory(self, envs: int) -> torch.Tensor:
        """[2, N, H]: h and c of N envs that have seen nothing."""
        return torch.zeros(2, envs, self.memory_size)

    def sequence(self, obs: torch.Tensor, starts: torch.Tensor, memory: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [T, N, H] of T steps of N envs from `memory` [2, N, H], which is zeroed for an
        env where `starts` [T, N] says a new episode begins; and the memories after each step
        [T, 2, N, H]."""
        steps, envs = obs.shape[:2]
        encoded = self.encoder(self.obs_norm(obs.flatten(0, 1))).view(steps, envs, -1)
        h, c = memory[0], memory[1]
        keep = (~starts).to(h.dtype)[..., None]
        any_start = starts.any(dim=1).tolist()
        features, memories = [], []
        for t in range(steps):
            if any_start[t]:
                h, c = h * keep[t], c * keep[t]
            h, c = self.lstm(encoded[t], (h, c))
            features.append(h)
            memories.append(c)
        cells = torch.stack(memories)
        features = torch.stack(features)
        return features, torch.stack([features, cells], dim=1)

    def distribution(self, features: torch.Tensor) -> torch.distributions.Distribution:
        out = self.actor(features)
        if self.discrete:
            return action_distribution(out, None)
        return action_distribution(out, self.log_std.exp())

    def value(self, features: torch.Tensor) -> torch.Tensor:
        return self.critic(features).squeeze(-1)


def make_recurrent_network(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space
                           ) -> RecurrentActorCritic:
    """Orthogonal weights as PPO's (gain sqrt 2 inside, 0.01 for the action output, 1 for the
    value); the LSTM's own default initialisation, its biases zero."""
    network = RecurrentActorCritic(observation_space, action_space, config)
    orthogonal_init(network.encoder, math.sqrt(2))
    orthogonal_init(network.actor, 0.01)
    orthogonal_init(network.critic, 1.0)
    for name, parameter in network.lstm.named_parameters():
        if name.startswith("bias"):
            nn.init.zeros_(parameter)
    return network


class RecurrentPolicy:
    """Acts with a RecurrentActorCritic, carrying each env's memory; `memory` ([2, N, H], float32)
    is where a rollout starts (None: every env at an episode's start) and where it stands after."""

    def __init__(self, network: RecurrentActorCritic, seed: int):
        self.network = network
        self.rng = np.random.default_rng(seed)
        self.memory: np.ndarray | None = None

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.memory is None:
            self.memory = self.network.initial_memory(len(obs)).numpy()
        starts = torch.zeros(1, len(obs), dtype=torch.bool)
        features, memories = self.network.sequence(torch.from_numpy(obs)[None], starts, torch.from_numpy(self.memory))
        self.memory = memories[-1].numpy().copy()
        out = self.network.actor(features[0]).numpy().astype(np.float64)
        log_std = self.network.log_std.detach().numpy()
        return sample_actions(out, log_std, self.network.discrete, self.rng, explore)

    def episodes_ended(self, envs: Sequence[int]) -> None:
        """Envs whose episode ended this step: their next step starts from an empty memory."""
        if self.memory is not None and len(envs):
            self.memory[:, list(envs)] = 0.0


def episode_starts(rollout: Rollout) -> np.ndarray:
    """[T, N] bool: the steps at which an env began a new episode within the rollout (the step
    after each that ended one; a lost life that is terminal for learning alone is not an end)."""
    steps, envs = rollout.rewards.shape
    starts = np.zeros(steps * envs, dtype=bool)
    following = rollout.done_index + envs
    starts[following[following < steps * envs]] = True
    return starts.reshape(steps, envs)


@torch.no_grad()
def critic_values(network: RecurrentActorCritic, rollout: Rollout, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, N] V(s_t) along each env's sequence, and the value each step bootstraps from: the next
    step's, the final observation's where an episode was truncated (read with the memory of the
    step that ended it), 0 after a terminal step."""
    steps, envs = rollout.rewards.shape
    starts = on_device(episode_starts(rollout), device)
    features, memories = network.sequence(on_device(rollout.obs, device), starts, on_device(rollout.memory, device))
    values = network.value(features)
    one_step = torch.zeros(1, envs, dtype=torch.bool, device=device)
    last, _ = network.sequence(on_device(rollout.last_obs, device)[None], one_step, memories[-1])
    next_values = torch.cat([values[1:], network.value(last)]).flatten()  # an env whose episode ended at the last
    if len(rollout.done_index):  # step is overwritten here
        t, i = (on_device(index, device) for index in np.divmod(rollout.done_index, envs))
        ended_memory = memories[t, :, i].transpose(0, 1)  # [2, K, H]: each ended episode's memory after its step
        final, _ = network.sequence(on_device(rollout.done_obs, device)[None], one_step[:, : len(t)], ended_memory)
        next_values[on_device(rollout.done_index, device)] = network.value(final)[0]
    return values, torch.where(on_device(rollout.terminated, device), 0.0, next_values.view(steps, envs))


class RecurrentPPOLearner(PPOLearner):
    """PPO over whole env sequences: each minibatch is a group of envs of one rollout, replayed from
    the memory the rollout began with (the same resets as when acting)."""

    def _make_network(self, config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space
                      ) -> nn.Module:
        return make_recurrent_network(config, observation_space, action_space)

    def _minibatches(self, rollouts: Sequence[Rollout]) -> tuple[list[Batch], Batch]:
        """Every rollout as [T, N] sequences with their advantages and returns; and the iteration's
        values and returns, flat (for the explained variance)."""
        sequences = [self._sequences(rollout) for rollout in rollouts]
        flat = {key: torch.cat([s[key].flatten() for s in sequences]) for key in ("values", "returns")}
        return sequences, flat

    def _passes(self, sequences: list[Batch]) -> Iterator[Batch]:
        """One epoch's minibatches: each rollout's envs shuffled into groups of about
        minibatch_size steps, the groups in a shuffled order."""
        groups = []
        for index, sequence in enumerate(sequences):
            steps, envs = sequence["log_probs"].shape
            per_group = max(1, self.config.minibatch_size // steps)
            order = torch.randperm(envs, generator=self.generator)
            groups += [(index, order[start : start + per_group]) for start in range(0, envs, per_group)]
        for pick in torch.randperm(len(groups), generator=self.generator).tolist():
            index, envs = groups[pick]
            yield {key: value[:, envs] for key, value in sequences[index].items()}  # memory: [2, N, H]

    def _graphable(self, config: PPOConfig) -> bool:
        return False  # sequences of each rollout's length, in groups of envs: shapes a graph would not hold

    def _loss(self, minibatch: Batch, clip_range: float | torch.Tensor) -> PPOLossTerms:
        features, _ = self.network.sequence(minibatch["obs"], minibatch["starts"], minibatch["memory"])
        flat = {key: value.flatten(0, 1) for key, value in minibatch.items() if key not in ("memory", "starts", "obs")}
        features = features.flatten(0, 1)
        if "alive" in flat:  # the steps the policy did not act in (a backend's FIRE) are no samples
            live = flat.pop("alive")
            features, flat = features[live], {key: value[live] for key, value in flat.items()}
        actions = flat["actions"] if self.network.discrete else flat["actions"].float()
        dist, value = self.network.distribution(features), self.network.value(features).flatten()
        return clipped_objective(dist, value, {**flat, "actions": actions}, self.config, clip_range)

    @torch.no_grad()
    def _sequences(self, rollout: Rollout) -> Batch:
        device = self.device
        values, next_values = critic_values(self.network, rollout, device)
        scaled = rollout.rewards if self.reward_scaler is None else self.reward_scaler.scale(rollout.rewards)
        continues = on_device(~(rollout.terminated | rollout.truncated), device).float()
        advantages = generalized_advantages(on_device(scaled, device), values, next_values, continues,
                                            self.config.gamma, self.config.gae_lambda)
        return {"obs": on_device(rollout.obs, device), "actions": on_device(rollout.actions, device),
                "log_probs": on_device(rollout.log_probs, device), "advantages": advantages,
                "returns": advantages + values, "values": values,
                "starts": on_device(episode_starts(rollout), device), "memory": on_device(rollout.memory, device),
                **({} if rollout.alive is None else {"alive": on_device(rollout.alive, device)})}
