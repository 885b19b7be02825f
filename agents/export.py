"""A trained policy as an ONNX graph: observations in (uint8 images, float32 vectors, as gymflow keeps
them), the actions its policy takes when not exploring out — the pyfunc model's — with whatever the
network reads its observations through (normalisation, the CNN's scaling) folded in. Served by any
ONNX runtime, without torch, gymflow or the env.

Each algorithm's module says how its network acts greedily (AlgorithmParts.greedy); what cannot be
a graph yet raises CannotExport, in one line."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from safetensors.torch import load
from torch import nn

from gymflow.agents.algorithms import Algorithm
from gymflow.envs.parts import observation_parts

OPSET = 17  # ONNX Runtime 1.14 and later run it
OBSERVATIONS, ACTIONS = "observations", "actions"
MEMORY, NEXT_MEMORY = "memory", "next_memory"  # a recurrent policy's: [2, batch, H], its LSTM's h and c


class CannotExport(Exception):
    """Why a policy cannot be an ONNX graph (yet), in one line."""


class GreedyActions(nn.Module):
    """Observations in, greedy actions out: the argmax of `outputs` (discrete actions), or `outputs`
    itself (continuous actions, already in the env's units)."""

    def __init__(self, network: nn.Module, outputs: Callable[[torch.Tensor], torch.Tensor], discrete: bool):
        super().__init__()
        self.network, self.outputs, self.discrete = network, outputs, discrete

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.outputs(obs)
        return out.argmax(dim=-1) if self.discrete else out


class GreedyActionsWithMemory(nn.Module):
    """A recurrent policy's step (agents/recurrent.py), as its pyfunc model takes it: observations and the
    memory before the step in, greedy actions and the memory after it out (an episode's first step: zeros)."""

    def __init__(self, network: nn.Module, discrete: bool):
        super().__init__()
        self.network, self.discrete = network, discrete

    def forward(self, obs: torch.Tensor, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        network = self.network
        h, c = network.lstm(network.encoder(network.obs_norm(obs)), (memory[0], memory[1]))
        out = network.actor(h)
        return (out.argmax(dim=-1) if self.discrete else out), torch.stack([h, c])


def greedy_module(algorithm: Algorithm, network: nn.Module, config: Any, observation_space: spaces.Space
                  ) -> GreedyActions | GreedyActionsWithMemory:
    """The module a policy of `algorithm` acts with when not exploring; CannotExport where there is none."""
    greedy = algorithm.parts().greedy
    if greedy is None:
        raise CannotExport(f"{algorithm.name} policies are not exported to ONNX yet")
    if observation_parts(observation_space):
        raise CannotExport("policies of Dict observations are not exported to ONNX yet (one input a part)")
    return greedy(network.eval(), config)


def onnx_policy(algorithm: Algorithm, config: Any, observation_space: spaces.Space, action_space: spaces.Space,
                weights: bytes) -> bytes:
    """The ONNX graph (serialized) of the policy whose safetensors are `weights`: input
    `observations` [batch, *observation shape], output `actions` [batch] (int64) or [batch, *action
    shape] (float32)."""
    network = algorithm.network(config, observation_space, action_space)
    network.load_state_dict(load(weights))
    module = greedy_module(algorithm, network, config, observation_space)
    example = torch.zeros((1, *observation_space.shape), dtype=torch.uint8 if is_uint8(observation_space)
                          else torch.float32)
    inputs, outputs, batch_axes = (example,), [ACTIONS], {OBSERVATIONS: {0: "batch"}, ACTIONS: {0: "batch"}}
    if isinstance(module, GreedyActionsWithMemory):
        inputs, outputs = (example, torch.zeros(2, 1, network.memory_size)), [ACTIONS, NEXT_MEMORY]
        batch_axes |= {MEMORY: {1: "batch"}, NEXT_MEMORY: {1: "batch"}}
    graph = io.BytesIO()
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice; it needs no onnxscript
        torch.onnx.export(module, inputs, graph, input_names=[OBSERVATIONS, MEMORY][: len(inputs)],
                          output_names=outputs, dynamic_axes=batch_axes, opset_version=OPSET, dynamo=False)
    check_graph(graph.getvalue(), module, observation_space)
    return graph.getvalue()


def check_graph(graph: bytes, module: GreedyActions | GreedyActionsWithMemory, observation_space: spaces.Space,
                samples: int = 256) -> None:
    """ONNX Runtime's actions against the module's on observations drawn from the space (and memories, a
    recurrent policy's): the same discrete actions, continuous ones and memories within 1e-5 (their
    units'); CannotExport where they are not."""
    import onnxruntime

    observation_space = spaces.Box(observation_space.low, observation_space.high, observation_space.shape,
                                   observation_space.dtype, seed=0)
    obs = np.stack([observation_space.sample() for _ in range(samples)]).astype(np.uint8 if is_uint8(observation_space)
                                                                               else np.float32)
    feeds = {OBSERVATIONS: obs}
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


def alike(answered: np.ndarray, expected: np.ndarray, exact: bool) -> bool:
    """Equal (discrete actions), or within 1e-5 of the expected's magnitude (continuous actions, memories)."""
    if answered.dtype != expected.dtype or answered.shape != expected.shape:
        return False
    return np.array_equal(answered, expected) if exact else \
        np.allclose(answered, expected, rtol=0.0, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def is_uint8(observation_space: spaces.Space) -> bool:
    return observation_space.dtype == np.uint8
