"""Fitted Q evaluation (Le et al. 2019; d3rlpy's and RLlib's FQE): the target policy's Q learned from
logged transitions alone, by regression on its own bootstrapped targets, iteration after iteration:

    Q_k(s, a) <- r + gamma (1 - terminal) sum_a' pi(a'|s') Q_{k-1}(s', a')

Its value at the logged episodes' first states is the FQE estimate; its Q at the logged decisions is
what the doubly robust estimators of agents/ope.py correct with the logged rewards. Discrete actions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from gymflow.agents.ope import Estimate, bootstrapped


class LoggedTransitions(NamedTuple):
    obs: np.ndarray  # [N, *obs]
    actions: np.ndarray  # [N] int
    rewards: np.ndarray  # [N]
    next_obs: np.ndarray  # [N, *obs]
    terminal: np.ndarray  # [N] bool: no value after it (a truncated episode's last step is not terminal)
    next_target_probs: np.ndarray  # [N, A] pi(.|s'): the target's action probabilities where it lands


class FQEOptions(NamedTuple):
    gamma: float = 0.99
    iterations: int = 40  # bootstrapped regressions
    steps_per_iteration: int = 100  # gradient steps of each, on minibatches
    batch_size: int = 256
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 1e-3
    seed: int = 0


def fitted_q(transitions: LoggedTransitions, options: FQEOptions = FQEOptions()) -> nn.Module:
    """The target policy's Q [batch, *obs] -> [batch, A], fitted to the logged transitions."""
    generator = torch.Generator().manual_seed(options.seed)
    torch.manual_seed(options.seed)
    data = [torch.as_tensor(np.asarray(part), dtype=torch.float32) for part in transitions]
    obs, actions, rewards, next_obs, terminal, next_probs = data
    actions = actions.long()
    network = _mlp(obs.shape[1:], next_probs.shape[1], options.hidden)
    optimizer = torch.optim.Adam(network.parameters(), lr=options.lr)
    for _ in range(options.iterations):
        with torch.no_grad():  # the previous iteration's Q, fixed while this one is fitted to it
            following = (network(next_obs) * next_probs).sum(dim=1)
            targets = rewards + options.gamma * (1 - terminal) * following
        for _ in range(options.steps_per_iteration):
            rows = torch.randint(0, len(rewards), (min(options.batch_size, len(rewards)),), generator=generator)
            predicted = network(obs[rows]).gather(1, actions[rows, None]).squeeze(1)
            loss = nn.functional.mse_loss(predicted, targets[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return network.eval()


def q_values(network: nn.Module, obs: np.ndarray) -> np.ndarray:
    """[N, A] the fitted Q of each action at each observation."""
    with torch.no_grad():
        return network(torch.as_tensor(np.asarray(obs), dtype=torch.float32)).numpy().astype(np.float64)


def state_values(network: nn.Module, obs: np.ndarray, target_probs: np.ndarray) -> np.ndarray:
    """[N] sum_a pi(a|s) Q(s, a): the target's value of each observation under the fitted Q."""
    return np.sum(q_values(network, obs) * target_probs, axis=1)


def fqe_estimate(network: nn.Module, first_obs: np.ndarray, first_target_probs: np.ndarray, seed: int = 0
                 ) -> Estimate:
    """The target's value at the logged episodes' first states under the fitted Q, with a bootstrap
    interval over those states (the fit's own error is not in it: a refit per resample would be)."""
    values = state_values(network, first_obs, first_target_probs)
    return bootstrapped(lambda rows: float(np.mean(values[rows])), len(values), float(len(values)), seed)


def _mlp(obs_shape: tuple[int, ...], actions: int, hidden: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = int(np.prod(obs_shape))
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, actions))
