"""A trained policy as an ONNX graph: observations in (uint8 images, float32 vectors, as gymflow keeps
them), the actions its policy takes when not exploring out — the pyfunc model's — with whatever the
network reads its observations through (normalisation, the CNN's scaling) folded in. Served by any
ONNX runtime, without torch, gymflow or the env.

Each algorithm's module says how its network acts greedily (AlgorithmParts.greedy); what cannot be
a graph yet raises CannotExport, in one line."""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from safetensors.torch import load
from torch import nn

from gymflow.agents.algorithms import Algorithm
from gymflow.agents.networks import PartsEncoder
from gymflow.envs.parts import Part, flatten_parts, is_packed, observation_parts, unflatten_parts

OPSET = 17  # ONNX Runtime 1.14 and later run it
OBSERVATIONS, ACTIONS = "observations", "actions"
MEMORY, NEXT_MEMORY = "memory", "next_memory"  # a recurrent policy's: [2, batch, H], its LSTM's h and c

# torch.onnx's exporter keeps its state in globals (GLOBALS.in_onnx_export): two exports at once, a sweep's runs
# delivering in their threads, failed one of them ("GLOBALS.in_onnx_export must be False")
_ONE_EXPORT_AT_A_TIME = threading.Lock()


class CannotExport(Exception):
    """Why a policy cannot be an ONNX graph (yet), in one line."""


class OnnxNotInstalled(CannotExport):
    """The export's packages are an extra this install lacks."""

    def __init__(self, message: str = "onnx and onnxruntime are not installed (gymflow's onnx extra: "
                                      "pip install 'gymflow[onnx]')"):
        super().__init__(message)


def onnx_installed() -> bool:
    """Whether the packages an export needs (the onnx extra) are installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime"))


class _Acting(nn.Module):
    """What the greedy modules share: continuous actions clipped to the env's Box bounds, as gymflow's
    rollouts and evaluations clip them before the env steps (a Gaussian's mean may lie outside)."""

    discrete: bool
    low: torch.Tensor | None
    high: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("low", None)  # the Box's bounds once `within` them
        self.register_buffer("high", None)

    def within(self, action_space: spaces.Space) -> None:
        """Continuous actions clipped to `action_space`'s bounds from here on (a Box's; nothing else)."""
        if isinstance(action_space, spaces.Box) and not self.discrete:
            self.low = torch.as_tensor(action_space.low, dtype=torch.float32)
            self.high = torch.as_tensor(action_space.high, dtype=torch.float32)

    def acted(self, out: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return out.argmax(dim=-1)
        return out if self.low is None else torch.minimum(torch.maximum(out, self.low), self.high)


class GreedyActions(_Acting):
    """Observations in, greedy actions out: the argmax of `outputs` (discrete actions), or `outputs`
    itself (continuous actions, in the env's units, clipped to its bounds once `within` them)."""

    def __init__(self, network: nn.Module, outputs: Callable[[torch.Tensor], torch.Tensor], discrete: bool):
        super().__init__()
        self.network, self.outputs, self.discrete = network, outputs, discrete

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.acted(self.outputs(obs))


class GreedyActionsWithMemory(_Acting):
    """A recurrent policy's step (agents/recurrent.py), as its pyfunc model takes it: observations and the
    memory before the step in, greedy actions and the memory after it out (an episode's first step: zeros)."""

    def __init__(self, network: nn.Module, discrete: bool):
        super().__init__()
        self.network, self.discrete = network, discrete

    def forward(self, obs: torch.Tensor, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        network = self.network
        h, c = network.lstm(network.encoder(network.obs_norm(obs)), (memory[0], memory[1]))
        return self.acted(network.actor(h)), torch.stack([h, c])


class GreedyActionsOfParts(nn.Module):
    """A Dict observation's policy as its pyfunc model takes it: one input a part, named by its key, in
    key order (images uint8, vectors float32, [batch, *shape]), its greedy actions out. Packed parts
    (an image among them) go through the network's parts encoder part by part (`read_parts`), the
    rest of the network reading its features; vector parts alone are the flat array the network reads."""

    def __init__(self, greedy: GreedyActions, parts: tuple[Part, ...], reader: PartsEncoder | None):
        super().__init__()
        self.greedy, self.parts, self.reader = greedy, parts, reader
        self.network, self.discrete = greedy.network, greedy.discrete

    def forward(self, *given: torch.Tensor) -> torch.Tensor:
        if self.reader is not None:
            return self.greedy(self.reader.read_parts(given))
        return self.greedy(torch.cat([part.flatten(1) for part in given], dim=1))


Greedy = GreedyActions | GreedyActionsWithMemory | GreedyActionsOfParts


def greedy_module(algorithm: Algorithm, network: nn.Module, config: Any, observation_space: spaces.Space,
                  action_space: spaces.Space) -> Greedy:
    """The module a policy of `algorithm` acts with when not exploring, its continuous actions clipped
    to `action_space`'s bounds (what the env is given); CannotExport where there is none. For a Dict
    observation's policy the network's parts encoder (packed parts) is taken out of it and reads the
    parts before it (the network is changed: give it one of its own)."""
    greedy = algorithm.parts().greedy
    if greedy is None:
        raise CannotExport(f"{algorithm.name} policies are not exported to ONNX yet")
    parts = observation_parts(observation_space)
    reader = _taken_parts_encoder(network) if is_packed(parts) else None
    if is_packed(parts) and reader is None:
        raise CannotExport(f"{algorithm.name} networks of Dict observations are not exported to ONNX yet")
    module = greedy(network.eval(), config)
    module.within(action_space)
    if not parts:
        return module
    if not isinstance(module, GreedyActions):
        raise CannotExport("recurrent policies of Dict observations are not exported to ONNX yet")
    return GreedyActionsOfParts(module, parts, reader)


def _taken_parts_encoder(network: nn.Module) -> PartsEncoder | None:
    """The network's parts encoder, an identity put in its place: every network reads its observations
    through it first, as its `obs_norm`, or as the first of a Sequential (an actor-critic's CNN trunk
    as `obs_norm`, a DQN network as the network)."""
    reader = getattr(network, "obs_norm", None)
    if isinstance(reader, PartsEncoder):
        network.obs_norm = nn.Identity()
        return reader
    for sequence in (reader, network):
        if isinstance(sequence, nn.Sequential) and isinstance(sequence[0], PartsEncoder):
            encoder = sequence[0]
            sequence[0] = nn.Identity()
            return encoder
    return None


def graph_inputs(observation_space: spaces.Space) -> list[tuple[str, tuple[int, ...], type]]:
    """The graph's observation inputs: (name, shape without the batch, dtype), one a Dict's part."""
    parts = observation_parts(observation_space)
    if parts:
        return [(part.key, part.shape, np.uint8 if part.image else np.float32) for part in parts]
    return [(OBSERVATIONS, tuple(observation_space.shape), np.uint8 if is_uint8(observation_space) else np.float32)]


def onnx_policy(algorithm: Algorithm, config: Any, observation_space: spaces.Space, action_space: spaces.Space,
                weights: bytes, policy_name: str | None = None) -> bytes:
    """The ONNX graph (serialized) of the policy whose safetensors are `weights`: input
    `observations` [batch, *observation shape] (a Dict's parts, by key), output `actions` [batch]
    (int64) or [batch, *action shape] (float32, within the Box's bounds: what gymflow's evaluation
    steps the env with). `policy_name`: one of an agent group's separate policies (agent.policies), a
    graph of its own, as its pyfunc model is."""
    if not onnx_installed():
        raise OnnxNotInstalled()
    network = algorithm.network(config, observation_space, action_space)
    network.load_state_dict(load(weights))
    if policy_name is not None:
        policies = getattr(network, "policies", {})
        if policy_name not in policies:
            raise CannotExport(f"there is no policy {policy_name!r}; the network's: {', '.join(policies) or 'one'}")
        network = policies[policy_name]
    module = greedy_module(algorithm, network, config, observation_space, action_space)
    named = graph_inputs(observation_space)
    inputs = tuple(torch.zeros((1, *shape), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
                   for _, shape, dtype in named)
    names, outputs = [name for name, _, _ in named], [ACTIONS]
    batch_axes = {name: {0: "batch"} for name in names} | {ACTIONS: {0: "batch"}}
    if isinstance(module, GreedyActionsWithMemory):
        inputs, names, outputs = (*inputs, torch.zeros(2, 1, network.memory_size)), [*names, MEMORY], \
            [ACTIONS, NEXT_MEMORY]
        batch_axes |= {MEMORY: {1: "batch"}, NEXT_MEMORY: {1: "batch"}}
    graph = io.BytesIO()
    with _ONE_EXPORT_AT_A_TIME, warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice; it needs no onnxscript
        torch.onnx.export(module, inputs, graph, input_names=names, output_names=outputs, dynamic_axes=batch_axes,
                          opset_version=OPSET, dynamo=False)
    check_graph(graph.getvalue(), module, observation_space)
    return graph.getvalue()


def check_graph(graph: bytes, module: Greedy, observation_space: spaces.Space, samples: int = 256) -> None:
    """ONNX Runtime's actions against the module's on observations drawn from the space (and memories, a
    recurrent policy's): the same discrete actions, continuous ones and memories within 1e-5 (their
    units'); CannotExport where they are not."""
    import onnxruntime

    feeds = observation_feeds(observation_space, samples)
    if isinstance(module, GreedyActionsWithMemory):
        size = module.network.memory_size
        feeds[MEMORY] = np.random.default_rng(0).normal(0.0, 0.5, (2, samples, size)).astype(np.float32)
    with torch.no_grad():
        expected = module(*(torch.from_numpy(feed) for feed in feeds.values()))
    expected = [out.numpy() for out in expected] if isinstance(expected, tuple) else [expected.numpy()]
    session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
    answered = session.run([output.name for output in session.get_outputs()], feeds)
    if not all(alike(got, want, exact=module.discrete and index == 0)
               for index, (got, want) in enumerate(zip(answered, expected, strict=True))):
        raise CannotExport(f"ONNX Runtime's actions differ from the policy's on {samples} observations")


def observation_feeds(observation_space: spaces.Space, samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`samples` observations drawn from the space, as the graph's inputs take them (a Dict's by part)."""
    parts = observation_parts(observation_space)
    space = observation_space.dict_space if parts else observation_space
    space.seed(seed)
    drawn = [space.sample() for _ in range(samples)]
    if parts:  # through the flat array the env gives, as the pyfunc model's parts come back from it
        flat = flatten_parts(parts, {part.key: np.stack([one[part.key] for one in drawn]) for part in parts})
        return unflatten_parts(parts, flat)
    return {OBSERVATIONS: np.stack(drawn).astype(np.uint8 if is_uint8(observation_space) else np.float32)}


def alike(answered: np.ndarray, expected: np.ndarray, exact: bool) -> bool:
    """Equal (discrete actions), or within 1e-5 of the expected's magnitude (continuous actions, memories)."""
    if answered.dtype != expected.dtype or answered.shape != expected.shape:
        return False
    return np.array_equal(answered, expected) if exact else \
        np.allclose(answered, expected, rtol=0.0, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def is_uint8(observation_space: spaces.Space) -> bool:
    return observation_space.dtype == np.uint8
