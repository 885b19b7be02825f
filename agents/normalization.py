"""Running normalisation of observations and rewards (what SB3's VecNormalize and RLlib's
MeanStdFilter do), as state of the learner that travels with its policy.

Observations: a network's first step, `ObservationNormalizer`, scales them by the running mean
and variance and clips. Its statistics are buffers of the network, so each published policy
version carries its own frozen copy in its weights, and every reader of the weights (rollout
workers, evaluations, the MLflow model, a warm start, a resume) applies exactly that version's
statistics. Only the learner updates them, from the experience it learns from, in the order it
reads it; shards keep the raw observations.

Rewards (PPO): `RewardScaler` divides them by the running standard deviation of the discounted
return, which it accumulates per env stream across iterations, and clips them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from gymflow.agents.configs import ObservationNormalization
from gymflow.envs.parts import vector_values

EPSILON = 1e-8


class RunningMeanVar(nn.Module):
    """Mean and variance of everything seen so far, merged batch by batch (Chan et al.), in float64."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))  # as SB3: no division by zero

    @torch.no_grad()
    def update(self, batch: np.ndarray) -> None:
        """Merge a batch of samples, [B, *shape]."""
        if len(batch) == 0:
            return
        values = torch.from_numpy(np.asarray(batch, dtype=np.float64)).to(self.mean.device)
        batch_mean, batch_var, batch_count = values.mean(0), values.var(0, unbiased=False), float(len(values))
        total = self.count + batch_count
        delta = batch_mean - self.mean
        merged = self.var * self.count + batch_var * batch_count + delta.square() * self.count * batch_count / total
        self.mean += delta * batch_count / total
        self.var.copy_(merged / total)
        self.count.copy_(total)


class ObservationNormalizer(RunningMeanVar):
    """(obs - mean) / sqrt(var + eps), clipped to +-clip, in the observations' dtype."""

    def __init__(self, shape: tuple[int, ...], clip: float, vector_bytes: np.ndarray | None = None):
        super().__init__(shape)
        self.clip = clip
        # where it reads its entries in a packed Dict observation (envs/parts.py: its vector parts'
        # float32 bytes); None: it scales the whole observation
        self.vector_bytes = vector_bytes

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        scaled = (obs.double() - self.mean) / torch.sqrt(self.var + EPSILON)
        return scaled.clamp(-self.clip, self.clip).to(obs.dtype)

    def observe(self, observations: Iterable[np.ndarray]) -> None:
        """Update the statistics from batches of observations, [..., *obs_shape] each, in order."""
        shape = tuple(self.mean.shape)
        for batch in map(np.asarray, observations):
            if self.vector_bytes is not None:
                batch = vector_values(batch, self.vector_bytes)
            self.update(batch.reshape(-1, *shape))


def observation_normalizer(options: ObservationNormalization, obs_shape: tuple[int, ...],
                           vector_bytes: np.ndarray | None = None) -> nn.Module:
    """A network's first step: the normaliser where the options ask for one, else the identity.
    `vector_bytes`: where it reads its entries in a packed Dict observation."""
    if options.normalize_observations:
        return ObservationNormalizer(tuple(obs_shape), options.observation_clip, vector_bytes)
    return nn.Identity()


def share_normalizer(*networks: nn.Module) -> ObservationNormalizer | None:
    """Make every network of a learner use the first one's normaliser (a target network copied
    from its online network, a critic beside its actor): one set of statistics, updated once."""
    shared: ObservationNormalizer | None = None
    for network in networks:
        for parent in network.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, ObservationNormalizer):
                    shared = shared or child
                    parent._modules[name] = shared
    return shared


class RewardScaler:
    """Rewards divided by the running std of the discounted return (not centred, as SB3 does).

    The return is accumulated per env of each stream (a SYNC round's rollout slot continues the
    same envs round after round) and restarts where an episode ends. Learner state: saved with
    its checkpoints, not with its policy (acting does not need it)."""

    def __init__(self, gamma: float, clip: float = 10.0):
        self.gamma = gamma
        self.clip = clip
        self.returns = RunningMeanVar(())
        self.discounted = np.zeros((0, 0))  # [streams, envs], sized by the first update

    def update(self, rewards: list[np.ndarray], ended: list[np.ndarray], streams: Sequence[int] | None = None
               ) -> None:
        """Accumulate each stream's [T, N] rewards (episode ends in `ended`), merge the returns.
        `streams`: which stream each continues (an ASYNC worker's chunks land in any order and
        number); None: the i-th continues stream i (a SYNC round's rollout slots)."""
        streams = list(range(len(rewards))) if streams is None else list(streams)
        rows = max(max(streams) + 1, len(self.discounted))
        if self.discounted.shape[1:] != (rewards[0].shape[1],) or len(self.discounted) < rows:
            grown = np.zeros((rows, rewards[0].shape[1]))
            if self.discounted.shape[1:] == grown.shape[1:]:
                grown[: len(self.discounted)] = self.discounted
            self.discounted = grown
        for stream, stream_rewards, stream_ended in zip(streams, rewards, ended, strict=True):
            running = self.discounted[stream]
            seen = np.empty(stream_rewards.shape, dtype=np.float64)
            for t in range(len(stream_rewards)):
                running = running * self.gamma + stream_rewards[t]
                seen[t] = running
                running = np.where(stream_ended[t], 0.0, running)
            self.discounted[stream] = running
            self.returns.update(seen.reshape(-1))

    def scale(self, rewards: np.ndarray) -> np.ndarray:
        scaled = rewards / np.sqrt(self.returns.var.item() + EPSILON)
        return np.clip(scaled, -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.returns.state_dict(), "discounted": torch.from_numpy(self.discounted.copy())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.discounted = state["discounted"].numpy().copy()
        self.returns.load_state_dict({key: state[key] for key in ("mean", "var", "count")})
