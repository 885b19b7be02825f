"""Coach's levels: a trained policy wrapped as the environment of the level above.

`env.id: gymflow.agents.levels:Level` with `env.kwargs` naming the lower level: its preset (whose
agent made the policies), the policy's weights (a committed version's `policy.safetensors`) or a
group of them, the lower env's kwargs for this task, and `every`. Each step of a Level chooses an
option; the lower level then acts greedily for `every` steps of the lower env, and the step's
reward is the sum of theirs. The level above is trained by the same improve loop as any env's
agent (Coach's graph of level managers, two levels deep).

- One lower policy: the options are the lower env's. It offers them as `Hallway` does
  (envs/hallway.py): an `options` count and a `choose(option)` method that returns the
  observation showing the option chosen; the policy acts on that observation.
- A group of lower policies: each policy is an option (one skill each); the level chooses which
  acts, and the lower env needs no options of its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from gymflow.agents.algorithms import algorithm_of
from gymflow.agents.core import Policy
from gymflow.envs.make import EnvSpecError, make_env


class Level(gym.Env):
    """A level above a trained lower policy; see the module's docstring."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 12}

    def __init__(self, lower_preset: str, policy: str | list[str], every: int = 5,
                 env_kwargs: dict[str, Any] | None = None, render_mode: str | None = None):
        from gymflow.presets.load import load_preset  # presets name algorithms: not at this module's import

        if every < 1:
            raise EnvSpecError("env.kwargs", f"every: {every}; allowed: an integer >= 1 (lower steps an option lasts)")
        paths = [policy] if isinstance(policy, str) else list(policy)
        if not paths or not all(isinstance(path, str) for path in paths):
            raise EnvSpecError("env.kwargs", f"policy: {policy!r}; allowed: a policy.safetensors path, or a list "
                                             "of them (a group: the level chooses which acts)")
        preset = load_preset(lower_preset)
        kwargs = {**preset.env.kwargs, **(env_kwargs or {})}
        self.lower = make_env(preset.env.id, kwargs, render_mode=render_mode)
        if len(paths) == 1 and not (hasattr(self.lower.unwrapped, "choose") and hasattr(self.lower.unwrapped,
                                                                                         "options")):
            raise EnvSpecError("env.kwargs", f"{preset.env.id!r} offers no options (an `options` count and a "
                                             "`choose(option)` method) for a level above to choose; or give "
                                             "`policy` a list of policies to choose between")
        self.policies = [_lower_policy(preset, path, self.lower) for path in paths]
        self.every, self.render_mode = every, render_mode
        self.observation_space = self.lower.observation_space
        options = int(self.lower.unwrapped.options) if len(paths) == 1 else len(paths)
        self.action_space = spaces.Discrete(options)
        self._obs: np.ndarray | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._obs, info = self.lower.reset(seed=seed)
        return self._obs, info

    def step(self, action):
        if len(self.policies) == 1:
            policy = self.policies[0]
            self._obs = self.lower.unwrapped.choose(int(action))
        else:
            policy = self.policies[int(action)]
        total, terminated, truncated, info = 0.0, False, False, {}
        for _ in range(self.every):
            lower_action = policy.act(np.asarray(self._obs, np.float32)[None], explore=False)[0][0]
            self._obs, reward, terminated, truncated, info = self.lower.step(lower_action)
            total += float(reward)
            if terminated or truncated:
                break
        return self._obs, total, terminated, truncated, info

    def render(self) -> np.ndarray:
        return self.lower.render()

    def close(self) -> None:
        self.lower.close()


def _lower_policy(preset: Any, path: str, lower: gym.Env) -> Policy:
    """The lower level's greedy policy: its preset's network with the weights at `path`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    algorithm = algorithm_of(preset.agent)
    network = algorithm.network(preset.agent, lower.observation_space, lower.action_space)
    try:
        network.load_state_dict(load_file(path))
    except (OSError, RuntimeError, SafetensorError) as error:  # missing, not safetensors, another network's
        raise EnvSpecError("env.kwargs", f"policy: cannot load the lower level's weights from {path!r} "
                                         f"({str(error).splitlines()[0]})") from None
    network.eval()
    return algorithm.policy(network, preset.agent, 0.0, 0)
