"""A preset's policy at its network's initial weights, as gymflow logs a trained one: for serving
benchmarks and tests that need a real model without training one."""

from __future__ import annotations

import torch
from safetensors.torch import save

from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.tracking.models import PolicyModel


def untrained_policy_model(preset: str, version: int = 1, seed: int = 0) -> PolicyModel:
    """`preset`'s policy model (labelled `<preset>-v<version>`), its weights drawn from `seed`."""
    experiment = resolve_experiment(preset)
    torch.manual_seed(seed)
    network = experiment.algorithm.network(experiment.preset.agent, experiment.observation_space,
                                           experiment.action_space)
    return PolicyModel(save(network.state_dict()), experiment.preset.model_dump_json().encode(),  # JSON is YAML
                       experiment.observation_space, experiment.action_space, {},
                       label=f"{experiment.preset.name}-v{version}")
