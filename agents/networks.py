"""Small network builders shared by the algorithms."""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn
from torch.optim.optimizer import Optimizer

from gymflow.agents.batches import Sample
from gymflow.agents.configs import ObservationNormalization
from gymflow.agents.data_parallel import Share
from gymflow.agents.normalization import observation_normalizer
from gymflow.envs.make import is_image
from gymflow.envs.parts import Part, image_parts, observation_parts, vector_bytes


def on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on the learner's device (a view of it on the CPU)."""
    return torch.from_numpy(array).to(device)


def network_input(obs: np.ndarray, network: nn.Module) -> torch.Tensor:
    """A batch of numpy observations on the device the network lives on (a view on the CPU)."""
    device = next(network.parameters()).device
    tensor = torch.from_numpy(obs)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def action_distribution(out: torch.Tensor, std: torch.Tensor | None) -> torch.distributions.Distribution:
    """A Categorical over logits (`std` None), or a diagonal Gaussian, its arguments unchecked: torch's
    checks compare on the device and wait for it, twice a minibatch on a GPU."""
    if std is None:
        return torch.distributions.Categorical(logits=out, validate_args=False)
    return torch.distributions.Independent(torch.distributions.Normal(out, std, validate_args=False), 1,
                                           validate_args=False)


def mean_metrics(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Each metric's mean over an update's minibatches, read from the device once: a value read
    after every minibatch would make the CPU wait for the GPU there, instead of queueing the next
    minibatch's kernels while the GPU runs this one's."""
    keys = list(rows[0])
    means = torch.stack([torch.stack([row[key].float() for row in rows]).mean() for key in keys])
    return dict(zip(keys, means.tolist(), strict=True))


def network_of_version(weights: dict[str, torch.Tensor], like: nn.Module | None,
                       fresh: Callable[[], nn.Module]) -> nn.Module:
    """A network holding a version's `weights`, for acting: a copy of `like` (a cached network of the
    same run) where there is one, else `fresh()`. A copy costs a few milliseconds where drawing a
    network's initial weights (orthogonal, for the CNN policies) can cost a hundred."""
    network = copy.deepcopy(like) if like is not None else fresh()
    network.load_state_dict(weights)
    return network.eval()


def cpu_weights(network: nn.Module) -> dict[str, torch.Tensor]:
    """A network's weights on the CPU, where rollout workers, checkpoints and MLflow read them
    (the live tensors themselves when the learner is on the CPU)."""
    return {name: tensor.cpu() for name, tensor in network.state_dict().items()}


@dataclass(frozen=True)
class TransitionBatch:
    """A sample of transitions on the learner's device."""

    obs: torch.Tensor
    actions: torch.Tensor  # as stored: an actor-critic learner maps them to its actor's units
    rewards: torch.Tensor  # the (n-step) discounted reward sum
    discounts: torch.Tensor  # gamma^n, 0 where the episode terminated
    next_obs: torch.Tensor
    weights: torch.Tensor | None  # importance weights; None for uniform replay (all ones)

    @classmethod
    def on(cls, sample: Sample, device: torch.device) -> TransitionBatch:
        batch = sample.transitions
        return cls(on_device(batch.obs, device), on_device(batch.actions, device), on_device(batch.rewards, device),
                   on_device(batch.discounts, device), on_device(batch.next_obs, device),
                   None if sample.weights is None else on_device(sample.weights, device))


def weighted_mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The mean of `values` [B] under importance `weights` [B] (None: all ones, the plain mean)."""
    return values.mean() if weights is None else (weights * values).mean()


class Adam(torch.optim.Adam):
    """Torch's Adam, stepped eagerly: the same update, without the torch.compile hooks around its
    methods, whose first call imports `torch._dynamo` (~1.5 s of every run's start, and gymflow
    compiles nothing), and without step hooks. Each method calls torch's own, unwrapped. With
    `fused=True`, once every parameter has its state, a step calls torch's fused kernel on lists
    kept from step to step: the same kernel on the same tensors, without the ~200 us of Python
    around it that torch's step spends a call on the CPU (sorting the tensors by device and dtype,
    checking each state)."""

    _fused_lists: _FusedLists | None = None

    @torch.no_grad()  # as torch's wrapper does for a non-differentiable optimizer
    def step(self, closure: Any = None) -> Any:
        if not self.defaults.get("fused"):
            return _ADAM_STEP(self, closure)
        if self._fused_lists is None:
            self._fused_lists = _FusedLists.of(self)
        lists = self._fused_lists
        if closure is None and lists is not None and lists.ready():
            lists.step(self.param_groups)
            return None
        self._fused_lists = None  # torch's own step: it may make states the lists must then hold
        return _ADAM_STEP(self, closure)

    # torch wraps the step of an optimizer class not marked so in a profiler record that runs the
    # step hooks (~40 us a call on the CPU, a third of a critic's step); gymflow sets no step hooks
    step.hooked = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        lists = self._fused_lists
        if set_to_none and lists is not None:  # torch's loops the groups inside a profiler record
            lists.forget_gradients()
            return
        _ZERO_GRAD(self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._fused_lists = None
        _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._fused_lists = None  # new state tensors
        _LOAD_STATE_DICT(self, state_dict)


@dataclass(frozen=True)
class _FusedLists:
    """A fused Adam's tensors, group by group, as torch's fused step passes them to its kernel."""

    params: list[list[torch.Tensor]]
    exp_avgs: list[list[torch.Tensor]]
    exp_avg_sqs: list[list[torch.Tensor]]
    steps: list[list[torch.Tensor]]  # each group's: views of one tensor, `counts`
    counts: list[torch.Tensor]

    @classmethod
    def of(cls, optimizer: Adam) -> _FusedLists | None:
        """The lists, where every group is fused (without amsgrad, one device and dtype) and every
        parameter has its state (after torch's first step); None otherwise. Each group's step counts
        become views of one tensor in the optimizer's state, as values the same: one addition steps
        them all (torch's `_foreach_add_` adds a CPU tensor at a time, ~5 us each)."""
        groups = optimizer.param_groups
        params = [list(group["params"]) for group in groups]
        flat = [param for group in params for param in group]
        if any(not group["fused"] or group["amsgrad"] or group["differentiable"] for group in groups) or \
                len({(param.device, param.dtype) for param in flat}) > 1 or \
                any("exp_avg" not in optimizer.state.get(param, {}) for param in flat):
            return None
        states = [[optimizer.state[param] for param in group] for group in params]
        counts = [torch.stack([state["step"] for state in group]) for group in states]
        for group, group_counts in zip(states, counts, strict=True):
            for state, count in zip(group, group_counts.unbind(), strict=True):
                state["step"] = count
        return cls(params, *([[state[key] for state in group] for group in states]
                             for key in ("exp_avg", "exp_avg_sq", "step")), counts)

    def forget_gradients(self) -> None:
        """zero_grad(set_to_none=True) of the lists' parameters."""
        for params in self.params:
            for param in params:
                param.grad = None

    def ready(self) -> bool:
        """Every parameter has a gradient (torch's step skips one without, and so does not this)."""
        return all(param.grad is not None for group in self.params for param in group)

    def step(self, groups: list[dict[str, Any]]) -> None:
        """torch.optim.adam._fused_adam's kernel calls, the settings read from the groups each step."""
        for group, params, exp_avgs, exp_avg_sqs, steps, counts in zip(
                groups, self.params, self.exp_avgs, self.exp_avg_sqs, self.steps, self.counts, strict=True):
            counts.add_(1)
            beta1, beta2 = group["betas"]
            torch._fused_adam_(params, [param.grad for param in params], exp_avgs, exp_avg_sqs, [], steps,
                               amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                               weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                               grad_scale=None, found_inf=None)

_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)  # under the step hooks and the dynamo graph breaks
_ZERO_GRAD, _ADD_PARAM_GROUP, _STATE_DICT, _LOAD_STATE_DICT = (
    method.__wrapped__ for method in (Optimizer.zero_grad, Optimizer.add_param_group, Optimizer.state_dict,
                                      Optimizer.load_state_dict))


def step_optimizer(optimizer: torch.optim.Optimizer, loss: torch.Tensor, share: Share | None = None) -> None:
    """One gradient step of `optimizer` on `loss` (with `share`: its rank's rows' loss, the
    gradients averaged over the ranks first)."""
    optimizer.zero_grad()
    loss.backward()
    if share is not None:
        share.average_gradients([parameter for group in optimizer.param_groups for parameter in group["params"]])
    optimizer.step()


class LinearEnsemble(nn.Module):
    """Linear layers of the same shape side by side, applied in one batched matmul: [members, rows,
    inputs] -> [members, rows, outputs]. Each member's weight is stored transposed ([inputs, outputs])."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        self.weight = nn.Parameter(torch.stack([linear.weight.detach().t() for linear in linears]).contiguous())
        self.bias = nn.Parameter(torch.stack([linear.bias.detach() for linear in linears]).unsqueeze(1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, inputs, self.weight)

    def member(self, index: int, inputs: torch.Tensor) -> torch.Tensor:
        """One member's layer alone: [rows, inputs] -> [rows, outputs]."""
        return torch.addmm(self.bias[index], inputs, self.weight[index])


class TwinCritic(nn.Module):
    """Two Q-networks over (observation, action in the actor's [-1, 1] units): SAC's and TD3's critics.
    The two are one ensemble (`LinearEnsemble` layers): each layer of both in one batched matmul, half
    the operations of two networks; their first weights are two `mlp`s' as drawn one after the other."""

    def __init__(self, obs_size: int, action_size: int, hidden: list[int], obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        members = [mlp(obs_size + action_size, hidden, 1, nn.ReLU) for _ in range(2)]
        self.layers = nn.ModuleList(LinearEnsemble([member[index] for member in members])
                                    for index in range(0, len(members[0]), 2))
        self.register_load_state_dict_pre_hook(_stacked_from_two_networks)

    def both(self, obs: torch.Tensor, squashed_actions: torch.Tensor) -> torch.Tensor:
        """[2, B]: each critic's values."""
        features = torch.cat([self.obs_norm(obs), squashed_actions], dim=1).expand(len(self.layers[0].weight), -1, -1)
        for layer in self.layers[:-1]:
            features = torch.relu_(layer(features))  # its output is not what the matmul's gradient needs
        return self.layers[-1](features).squeeze(2)

    def forward(self, obs: torch.Tensor, squashed_actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = self.both(obs, squashed_actions)
        return first, second

    def first(self, obs: torch.Tensor, squashed_actions: torch.Tensor) -> torch.Tensor:
        """Q1 alone (TD3's actor follows it)."""
        features = torch.cat([self.obs_norm(obs), squashed_actions], dim=1)
        for layer in self.layers[:-1]:
            features = torch.relu_(layer.member(0, features))
        return self.layers[-1].member(0, features).squeeze(1)


def twin_td_errors(errors: torch.Tensor) -> torch.Tensor:
    """[B] the mean of the twin critics' |y - Q| (`errors` [2, B]): the new priorities."""
    return 0.5 * errors.abs().sum(0)


def _stacked_from_two_networks(critic: TwinCritic, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """A critic saved while the twins were two networks (`q1.0.weight`, ..., `q2.4.bias`: the checkpoints
    of runs before the ensemble) loads as the ensemble: each layer's two weights transposed and stacked."""
    if f"{prefix}q1.0.weight" not in state:
        return
    for index in range(len(critic.layers)):
        weights, biases = ([state.pop(f"{prefix}{member}.{2 * index}.{kind}") for member in ("q1", "q2")]
                           for kind in ("weight", "bias"))
        state[f"{prefix}layers.{index}.weight"] = torch.stack([weight.t() for weight in weights])
        state[f"{prefix}layers.{index}.bias"] = torch.stack(biases).unsqueeze(1)


class TwinCriticCheckpoints:
    """For a learner whose `critic` (a TwinCritic) `critic_optimizer` steps: a training state saved
    while the twins were two networks loads, the optimiser's moments stacked as the weights are."""

    critic: TwinCritic

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reader = len(list(self.critic.obs_norm.parameters()))
        optimizer = state["critic_optimizer"]
        if len(optimizer["param_groups"][0]["params"]) == reader + 4 * len(self.critic.layers):
            state = {**state, "critic_optimizer": _ensemble_optimizer_state(optimizer, reader, len(self.critic.layers))}
        super().load_state_dict(state)  # the learner's SavedWhole


def _ensemble_optimizer_state(saved: dict[str, Any], reader: int, layers: int) -> dict[str, Any]:
    """An Adam state of (reader..., q1's layers' weight and bias..., q2's...) as one of (reader...,
    each ensemble layer's weight and bias...): positions, not names, key torch's optimiser states."""
    old = saved["state"]

    def stacked(index: int, kind: int) -> dict[str, Any]:
        first, second = (old[reader + member * 2 * layers + 2 * index + kind] for member in (0, 1))
        as_layer = (lambda value: value.t()) if kind == 0 else (lambda value: value)
        moments = {key: torch.stack([as_layer(first[key]), as_layer(second[key])]) for key in ("exp_avg", "exp_avg_sq")}
        if kind == 1:
            moments = {key: value.unsqueeze(1) for key, value in moments.items()}
        return {**first, **moments}

    state = {index: old[index] for index in range(reader) if index in old}
    for index in range(layers):
        for kind in (0, 1):
            if reader + 2 * index + kind in old:  # a state once stepped: both twins' moments
                state[reader + 2 * index + kind] = stacked(index, kind)
    groups = [{**group, "params": list(range(reader + 2 * layers))} for group in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def twin_critic(config: ObservationNormalization, hidden: list[int], observation_space: spaces.Box,
                action_space: spaces.Box) -> TwinCritic:
    """Twin critics over a Box's observations and actions, reading the observations with a reader
    of their own (`observation_reader`: a CNN of their own for images; where the options ask, a
    normaliser, whose statistics the learner then shares: `share_normalizer`)."""
    reader, width = observation_reader(config, observation_space)
    return TwinCritic(width, int(np.prod(action_space.shape)), hidden, reader)


class PixelEncoder(nn.Module):
    """uint8 frames [N, channels, height, width] -> a flat feature vector. The Nature DQN
    convolutions (Mnih et al. 2015: 32 8x8 /4, 64 4x4 /2, 64 3x3 /1) for frames of 36 pixels or
    more a side, two 3x3 convolutions (16, 32) for smaller ones. Observations stay uint8 (a
    quarter of float32's bytes) until they are scaled to [0, 1] here. The Nature CNN's frames are laid
    out channels-last (still uint8) first: oneDNN's convolutions then run in that layout, a minibatch
    of 256 Atari frames forward and back 1.4-1.7x as fast on the CPU as in channels-first (the weights
    keep theirs; the flattened features are in the same order). Small frames stay channels-first: a
    Catch minibatch is 5-19% slower channels-last."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        channels, height, width = shape
        self.channels_last = min(height, width) >= 36
        if self.channels_last:
            convolutions = [nn.Conv2d(channels, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU()]
        else:
            convolutions = [nn.Conv2d(channels, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU()]
        self.convolutions = nn.Sequential(*convolutions, nn.Flatten())
        with torch.no_grad():
            self.features = int(self.convolutions(torch.zeros(1, *shape)).shape[1])

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        frames = obs.contiguous(memory_format=torch.channels_last) if self.channels_last else obs
        return self.convolutions(frames.float() / 255.0)


class PartsEncoder(nn.Module):
    """A flattened Dict observation with image parts (envs/parts.py: packed bytes) -> features:
    each image part through a CNN of its own, beside the vector parts' float32 entries (normalised
    where the options ask)."""

    def __init__(self, options: ObservationNormalization, observation_space: spaces.Box):
        super().__init__()
        parts = observation_parts(observation_space)
        self.parts = parts
        self.images = [part for part in parts if part.image]
        self.pixels = nn.ModuleList(PixelEncoder(part.frames_shape) for part in self.images)
        positions = vector_bytes(parts)
        self.register_buffer("vector_bytes", torch.as_tensor(positions, dtype=torch.long), persistent=False)
        entries = len(positions) // 4
        self.obs_norm = observation_normalizer(options, (entries,), positions)
        self.features = sum(encoder.features for encoder in self.pixels) + entries

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        features = [encoder(self._frames(obs, part)) for part, encoder in zip(self.images, self.pixels, strict=True)]
        if len(self.vector_bytes):  # the vector parts' bytes, gathered (contiguous), read as float32
            features.append(self.obs_norm(obs.index_select(1, self.vector_bytes).view(torch.float32)))
        return torch.cat(features, dim=1)

    def read_parts(self, given: Sequence[torch.Tensor]) -> torch.Tensor:
        """`forward`'s features from the observation given part by part, in key order (images uint8,
        vectors float32, [batch, *shape] as the env gives them), not packed: an ONNX graph has no
        bitcast to read a packed array's float32 bytes with."""
        by_key = dict(zip((part.key for part in self.parts), given, strict=True))
        features = [encoder(self._as_frames(by_key[part.key], part))
                    for part, encoder in zip(self.images, self.pixels, strict=True)]
        vectors = [by_key[part.key].flatten(1) for part in self.parts if not part.image]  # no batch size: traced
        if vectors:
            features.append(self.obs_norm(torch.cat(vectors, dim=1)))
        return torch.cat(features, dim=1)

    @staticmethod
    def _frames(obs: torch.Tensor, part: Part) -> torch.Tensor:
        return PartsEncoder._as_frames(obs[:, part.start : part.stop].reshape(len(obs), *part.shape), part)

    @staticmethod
    def _as_frames(frames: torch.Tensor, part: Part) -> torch.Tensor:
        """An image part's [batch, *shape] as the CNN reads it."""
        if part.channels_last:
            return frames.permute(0, 3, 1, 2)
        return frames.unsqueeze(1) if len(part.shape) == 2 else frames


def observation_reader(options: ObservationNormalization, observation_space: spaces.Box) -> tuple[nn.Module, int]:
    """What turns an observation batch into a network's input, and that input's width: the CNN
    for images, an encoder per part for a Dict with image parts, else the observations' normaliser
    (the identity unless the options ask for one)."""
    if is_image(observation_space):
        encoder = PixelEncoder(observation_space.shape)
        return encoder, encoder.features
    if image_parts(observation_space):
        parts = PartsEncoder(options, observation_space)
        return parts, parts.features
    return observation_normalizer(options, observation_space.shape), int(observation_space.shape[0])


class InplaceReLU(nn.ReLU):
    """ReLU overwriting its input: after a Linear (whose gradient does not need its output) it spares a
    fresh buffer a layer, whose first writes miss the cache (a SAC actor's hidden layers: 4 a CPU update)."""

    def __init__(self) -> None:
        super().__init__(inplace=True)


def hidden_layers(inputs: int, hidden: Sequence[int], activation: type[nn.Module]) -> tuple[nn.Sequential, int]:
    """Linear layers of `hidden` widths, each followed by `activation`; and the last width."""
    layers: list[nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [nn.Linear(width, size), activation()]
        width = size
    return nn.Sequential(*layers), width


def mlp(inputs: int, hidden: Sequence[int], outputs: int, activation: type[nn.Module]) -> nn.Sequential:
    layers, width = hidden_layers(inputs, hidden, activation)
    return layers.append(nn.Linear(width, outputs))


class BoundedActions:
    """For an actor (an nn.Module) whose output lies in [-1, 1]: buffers that scale it to a Box's
    bounds and back, so a rollout worker needs the actor's weights alone."""

    action_scale: torch.Tensor
    action_bias: torch.Tensor

    def register_bounds(self, action_space: spaces.Box) -> None:
        low, high = (torch.as_tensor(bound, dtype=torch.float32) for bound in (action_space.low, action_space.high))
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)

    def to_env(self, squashed: torch.Tensor) -> torch.Tensor:
        return squashed * self.action_scale + self.action_bias

    def from_env(self, actions: torch.Tensor) -> torch.Tensor:
        return (actions - self.action_bias) / self.action_scale


def orthogonal_init(module: nn.Module, gain: float) -> None:
    """Orthogonal weights scaled by `gain` and zero biases for every linear and convolutional layer in `module`."""
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)


# torch draws initial weights from one RNG per process. Learners of concurrent trials (a sweep's
# threads) and jobs sharing a worker build networks at once: a draw from another thread inside a
# seeded section shifts the seeded weights. Every network build in gymflow holds this lock.
_GLOBAL_RNG = threading.RLock()


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Networks built inside start from weights that depend on `seed` alone, whatever other
    threads build meanwhile; torch's global RNG is restored afterwards."""
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextmanager
def unseeded_init() -> Iterator[None]:
    """Networks built inside get weights loaded afterwards: their draws only wait for (and never
    shift) a seeded build in another thread."""
    with _GLOBAL_RNG:
        yield
