"""Making Gymnasium environments from an id or a 'module:Class' entry point, and checking them."""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class EnvSpecError(ValueError):
    """An environment that cannot be made, or whose spaces an agent cannot handle."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


def make_env(env_id: str, kwargs: dict[str, Any] | None = None, render_mode: str | None = None) -> gym.Env:
    """A single environment from a registered id or a 'module:Class' entry point."""
    kwargs = dict(kwargs or {}) | ({"render_mode": render_mode} if render_mode else {})
    if ":" in env_id:
        return _entry_point_class(env_id)(**kwargs)
    return gym.make(env_id, **kwargs)


def render_modes(env_id: str) -> tuple[str, ...]:
    """The render modes an env's class says it offers, without making it."""
    if ":" in env_id:
        env_class = _entry_point_class(env_id)
    else:
        entry_point = gym.spec(env_id).entry_point
        env_class = gym.envs.registration.load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    return tuple(getattr(env_class, "metadata", {}).get("render_modes", ()))


def _extra_for(env_id: str) -> str:
    """The gymflow extra that installs a registered env's simulator."""
    entry_point = str(getattr(gym.spec(env_id), "entry_point", ""))
    return "mujoco" if "mujoco" in entry_point else "box2d" if "box2d" in entry_point else "mujoco,box2d"


def check_env(
    env_id: str, kwargs: dict[str, Any], action_spaces: tuple[type[spaces.Space], ...], algo: str
) -> tuple[spaces.Box, spaces.Space]:
    """Make the env once and check its spaces; returns (observation_space, action_space)."""
    try:
        env = make_env(env_id, kwargs)
    except EnvSpecError:
        raise
    except (gym.error.DependencyNotInstalled, ImportError) as error:  # gymnasium's MuJoCo envs: ImportError
        raise EnvSpecError("env.id", f"{env_id!r} needs a package that is not installed ({error}); "
                           f"gymflow's extras have them: pip install 'gymflow[{_extra_for(env_id)}]'") from None
    except gym.error.Error as error:
        raise EnvSpecError(
            "env.id", f"{env_id!r} is not a registered Gymnasium id ({error}); "
            "use an id such as 'CartPole-v1' or a 'module:Class' entry point"
        ) from None
    except TypeError as error:
        raise EnvSpecError("env.kwargs", f"{env_id!r} refused its kwargs: {error}") from None
    try:
        observation_space, action_space = env.observation_space, env.action_space
    finally:
        env.close()
    if not (isinstance(observation_space, spaces.Box) and len(observation_space.shape) == 1):
        raise EnvSpecError(
            "env.id", f"{env_id!r} observes {observation_space}; allowed: a 1-D Box observation"
        )
    if not isinstance(action_space, action_spaces):
        allowed = " or ".join(space.__name__ for space in action_spaces)
        raise EnvSpecError(
            "agent.algo", f"{algo} supports {allowed} action spaces; {env_id!r} acts in {action_space}"
        )
    if isinstance(action_space, spaces.Box) and not np.all(np.isfinite(action_space.low)):
        raise EnvSpecError("env.id", f"{env_id!r} has an unbounded Box action space")
    return observation_space, action_space


def _entry_point_class(entry_point: str) -> type[gym.Env]:
    module_name, _, class_name = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EnvSpecError("env.id", f"cannot import {module_name!r}: {error}") from None
    env_class = getattr(module, class_name, None)
    if not (isinstance(env_class, type) and issubclass(env_class, gym.Env)):
        raise EnvSpecError(
            "env.id", f"{entry_point!r} is not a gymnasium.Env subclass in {module_name!r}"
        )
    return env_class
