"""A learner's training state, saved and restored whole.

A learner names the attributes that hold what training changes — networks, optimisers, RNGs,
counters, running statistics — once, in TRAINING_STATE; `state_dict` saves each by its type and
`load_state_dict` restores each the same way, so no key is written on one side and forgotten on
the other. tests/test_learners.py fails for any attribute that training changes and this misses.

A state copied from another run (a warm start from a whole learner) brings that run's settings
with it: torch's optimisers restore their param groups, learning rate and betas included.
`load_copied_state` loads it, then puts this learner's own settings back (`apply_settings`), so
what the new preset says is what it trains with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass(frozen=True)
class Settings:
    """A learner's settings as its preset made them: each optimiser's param groups' hyper-parameters
    (lr, betas, eps, ...), by attribute."""

    optimizers: dict[str, tuple[dict[str, Any], ...]]


class SavedWhole:
    """For a learner: `state_dict` and `load_state_dict` over the attributes in TRAINING_STATE
    (one that is None, such as an optional reward scaler, is left out)."""

    TRAINING_STATE: ClassVar[tuple[str, ...]]

    def settings(self) -> Settings:
        return Settings({name: tuple({key: value for key, value in group.items() if key != "params"}
                                     for group in optimizer.param_groups)
                         for name in self.TRAINING_STATE
                         if isinstance(optimizer := getattr(self, name), torch.optim.Optimizer)})

    def apply_settings(self, settings: Settings) -> None:
        """`settings` in place of what a loaded state set (learners with coefficients of their own
        in their state put those back too)."""
        for name, groups in settings.optimizers.items():
            for group, own in zip(getattr(self, name).param_groups, groups, strict=True):
                group.update(own)

    def load_copied_state(self, state: dict[str, Any]) -> None:
        """Another run's state (weights, optimiser moments, statistics), trained on with this
        learner's own settings."""
        own = self.settings()
        self.load_state_dict(state)
        self.apply_settings(own)

    def state_dict(self) -> dict[str, Any]:
        return {name: _saved(value) for name in self.TRAINING_STATE if (value := getattr(self, name)) is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.TRAINING_STATE:
            current = getattr(self, name)
            if current is not None:
                setattr(self, name, _restored(current, state[name]))


def _saved(value: Any) -> Any:
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, np.random.Generator):
        return value.bit_generator.state
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, int | float):
        return value
    return value.state_dict()  # modules, optimisers, running statistics


def _restored(current: Any, saved: Any) -> Any:
    """`current` holding `saved`: changed in place where it is an object, a new value where not."""
    if isinstance(current, torch.Generator):
        current.set_state(saved)
    elif isinstance(current, np.random.Generator):
        current.bit_generator.state = saved
    elif isinstance(current, torch.Tensor):
        current.data.copy_(saved)
    elif isinstance(current, int | float):
        return type(current)(saved)
    else:
        current.load_state_dict(saved)
    return current
