"""Small network builders shared by the algorithms."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated

import torch
from pydantic import Field
from torch import nn

LayerWidths = list[Annotated[int, Field(ge=1, le=65_536)]]  # the hidden layers of an MLP, input to output


def mlp(inputs: int, hidden: Sequence[int], outputs: int, activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [nn.Linear(width, size), activation()]
        width = size
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Networks built inside start from weights that depend on `seed` alone; torch's global
    RNG is restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
