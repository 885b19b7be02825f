"""Making Gymnasium environments from an id or a 'module:Class' entry point, wrapped as the
preset says (Atari's standard preprocessing, frame stacks), and checking them."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

from gymflow.envs.headless import choose_mujoco_backend
from gymflow.envs.parts import FlatParts, image_parts, part_problem
from gymflow.errors import did_you_mean


@dataclass(frozen=True)
class Preprocessing:
    """What gymflow wraps an env in, in this order:

    - `atari`: the preprocessing the Atari literature's numbers assume (Machado et al. 2018,
      rl-zoo, CleanRL): up to 30 no-op starts, 4 frames a step with the last two max-pooled, 84x84
      greyscale, FIRE pressed where a game waits for it (its start and each lost life); and, for
      training only, a lost life is terminal for learning (no bootstrap
      across it; the game goes on) and rewards are clipped to their sign. Evaluation plays whole
      games for their unclipped score.
    - `frame_stack`: the last k frames as one observation [k, height, width]; a grey image env
      (2-D observations) is always stacked, k = 1 giving [1, height, width].
    - `hide`: entries of a vector observation left out (a partially observed env: CartPole
      without its velocities observes [x, theta]).
    - `global_state`: a PettingZoo env's rows (envs/agents.py) also carry the game's `state()`,
      which only a centralised critic reads.
    """

    frame_stack: int = 1
    atari: bool = False
    training: bool = True
    hide: tuple[int, ...] = ()
    global_state: bool = False

    def evaluation(self) -> Preprocessing:
        return Preprocessing(self.frame_stack, self.atari, training=False, hide=self.hide,
                             global_state=self.global_state)


PETTINGZOO = "pettingzoo:"  # an env id's prefix: a PettingZoo parallel env, whose agents are rows (envs/agents.py)


def is_multi_agent(env_id: str) -> bool:
    return env_id.startswith(PETTINGZOO)


LIFE_LOST = "gymflow.life_lost"  # an info key: this step lost a life, and the game goes on


class LifeWatcher(gym.Wrapper):
    """An Atari wrapper that knows when a step lost a life and the game goes on."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._lives = 0

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._lives = self.env.unwrapped.ale.lives()
        return obs, info

    def _life_lost(self, terminated: bool, truncated: bool) -> bool:
        lives, before = self.env.unwrapped.ale.lives(), self._lives
        self._lives = lives
        return lives < before and not (terminated or truncated)


class EpisodicLife(LifeWatcher):
    """Marks the steps that lose a life (`info[LIFE_LOST]`): the seeded vector env reports them
    as terminated, for learning, without resetting; the episode, its env cursor and its seed stay
    the game's, so a rebuilt env replays exactly."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._life_lost(terminated, truncated):
            info = {**info, LIFE_LOST: True}
        return obs, reward, terminated, truncated, info


class ResetWithoutReload(gym.Wrapper):
    """ALE's seeded reset reloads the ROM to reseed the emulator (~90 ms: a third of Breakout's
    collection time, where every episode starts from a seed). The emulator's RNG is what draws
    sticky actions; without them, a seeded reset here restores the state (RNG included) the env
    had after its first reset and starts the game from there, so every game starts from the same
    emulator state and the seed draws its no-op starts (up to 30). A seeded reset stays a
    function of its seed alone; with sticky actions, the ROM is reloaded as ALE does."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.env.reset(seed=0)
        self._loaded = env.unwrapped.ale.cloneState(include_rng=True)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is None:
            return self.env.reset(options=options)
        atari = self.env.unwrapped
        atari.seed_game(seed)  # the env's own RNG, which draws the no-op starts
        atari.ale.restoreState(self._loaded)
        atari.ale.reset_game()
        return atari._get_obs(), atari._get_info()

    @staticmethod
    def applies(env: gym.Env) -> bool:
        return float(env.unwrapped.ale.getFloat("repeat_action_probability")) == 0.0


class FireToServe(LifeWatcher):
    """Presses FIRE, then action 2, when a game starts and after each lost life, for games that
    wait for FIRE to go on (Breakout); what SB3's and CleanRL's FireResetEnv does at each reset,
    where a lost life is a reset. Without it a greedy policy that has not learnt to fire stands
    still until the frame cap. The presses are the env's own steps: an action cursor replays
    them, and their rewards count."""

    FIRE, AFTER_FIRE = 1, 2

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self._serve(0.0, info)
        if terminated or truncated:  # the presses ended the game: start it over as it was
            obs, info = self.env.reset(**kwargs)
        self._lives = self.env.unwrapped.ale.lives()
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._life_lost(terminated, truncated):
            obs, reward, terminated, truncated, info = self._serve(float(reward), info)
            self._lives = self.env.unwrapped.ale.lives()
        return obs, reward, terminated, truncated, info

    def _serve(self, reward: float, info: dict):
        for action in (self.FIRE, self.AFTER_FIRE):
            obs, more, terminated, truncated, info = self.env.step(action)
            reward += float(more)
            if terminated or truncated:
                break
        return obs, reward, terminated, truncated, info

    @staticmethod
    def needed(env: gym.Env) -> bool:
        return "FIRE" in env.unwrapped.get_action_meanings()

    @staticmethod
    def needed_by(game: str) -> bool:
        """`needed`, for an ALE game by its ROM's name (as a C++ backend names it): FIRE in its minimal action set."""
        import ale_py

        ale = ale_py.ALEInterface()
        ale.setLoggerMode(ale_py.LoggerMode.Error)
        ale.loadROM(ale_py.roms.get_rom_path(game))  # ~0.1 s, once a vector env
        return ale_py.Action.FIRE in ale.getMinimalActionSet()


class SignReward(gym.RewardWrapper):
    """Rewards clipped to -1, 0 or +1."""

    def reward(self, reward: float) -> float:
        return float(np.sign(reward))


class EnvSpecError(ValueError):
    """An environment that cannot be made, or whose spaces an agent cannot handle."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")

    def __reduce__(self):  # pickle's default would call the class with the one-line message alone
        return type(self), (self.field, self.problem), self.__dict__


def make_env(env_id: str, kwargs: dict[str, Any] | None = None, render_mode: str | None = None,
             preprocessing: Preprocessing | None = None) -> gym.Env:
    """A single environment from a registered id or a 'module:Class' entry point, wrapped as
    `preprocessing` says."""
    preprocessing = preprocessing or Preprocessing()
    kwargs = dict(kwargs or {}) | ({"render_mode": render_mode} if render_mode else {})
    if preprocessing.atari:
        kwargs.setdefault("frameskip", 1)  # AtariPreprocessing skips (and max-pools) frames itself
    if ":" in env_id:
        env = _entry_point_class(env_id)(**kwargs)
    else:
        if env_id.startswith("ALE/"):
            import ale_py  # registers the ALE/... ids

            gym.register_envs(ale_py)
        elif is_mujoco(env_id):
            prepare_mujoco()
        env = gym.make(env_id, **kwargs)
    if is_users_env(env_id):
        env = ObservationsChecked(env, env_id)
    if preprocessing.atari:
        if ResetWithoutReload.applies(env):
            env = ResetWithoutReload(env)
        env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False,
                                 grayscale_obs=True, scale_obs=False)
        if FireToServe.needed(env):
            env = FireToServe(env)
        if preprocessing.training:
            env = SignReward(EpisodicLife(env))
    shape = env.observation_space.shape or ()
    if len(shape) == 2 or (preprocessing.frame_stack > 1 and is_image(env.observation_space)):
        env = FrameStackObservation(env, preprocessing.frame_stack)
    if preprocessing.hide:
        env = HiddenEntries(env, preprocessing.hide)
    if isinstance(env.observation_space, spaces.Dict):
        env = _flattened_dict(env, env_id, preprocessing)
    return env


class ObservationsChecked(gym.Wrapper):
    """A user's env whose every observation is checked against the space it declares, as the check
    before the run does once: a mid-run `step` that returns another shape fails its job with the env,
    the method, what it returned and what its space holds (not numpy's broadcast error in a buffer)."""

    def __init__(self, env: gym.Env, env_id: str):
        super().__init__(env)
        self.env_id = env_id

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        observation, info = self.env.reset(**kwargs)
        _fits(self.env_id, "reset", observation, self.env.observation_space)
        return observation, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        observation, *rest = self.env.step(action)
        _fits(self.env_id, "step", observation, self.env.observation_space)
        return observation, *rest


def _flattened_dict(env: gym.Env, env_id: str, preprocessing: Preprocessing) -> FlatParts:
    """A Dict observation as one flat vector (envs/parts.py), once each part is known readable."""
    for key, part in env.observation_space.spaces.items():
        if (problem := part_problem(key, part)) is not None:
            raise EnvSpecError("env.id", f"{env_id!r}: {problem}")
    if preprocessing.frame_stack > 1:
        raise EnvSpecError("env.frame_stack", f"{env_id!r} observes a Dict; allowed: 1 (frames of its image parts "
                                              "are not stacked)")
    return FlatParts(env)


class HiddenEntries(gym.ObservationWrapper):
    """A vector observation without some of its entries: what a partially observed env shows."""

    def __init__(self, env: gym.Env, hide: tuple[int, ...]):
        super().__init__(env)
        space = env.observation_space
        if not (isinstance(space, spaces.Box) and len(space.shape) == 1):
            raise EnvSpecError("env.hide", f"hides entries of a vector observation; the env observes {space}")
        size = space.shape[0]
        if max(hide) >= size or len(set(hide)) >= size:
            raise EnvSpecError("env.hide", f"{list(hide)} for an observation of {size} entries; allowed: distinct "
                                           f"indices 0..{size - 1}, leaving at least one")
        self.shown = np.array([i for i in range(size) if i not in set(hide)])
        self.observation_space = spaces.Box(space.low[self.shown], space.high[self.shown], dtype=space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.shown]


def render_modes(env_id: str) -> tuple[str, ...]:
    """The render modes an env's class says it offers, without making it."""
    if ":" in env_id:
        env_class = _entry_point_class(env_id)
    else:
        entry_point = gym.spec(env_id).entry_point
        env_class = gym.envs.registration.load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    return tuple(getattr(env_class, "metadata", {}).get("render_modes", ()))


# Gymnasium's own MuJoCo models (Hopper, HalfCheetah, ...) use an attribute MuJoCo 3.3+ deprecates:
# without this, every env made prints the warning, in the flow and on every worker
_MUJOCO_NOISE = ("compiler attribute 'settotalmass' is deprecated",)


@functools.cache
def prepare_mujoco() -> None:
    """Once a process, before its first MuJoCo env: an off-screen renderer where there is no
    display (read when the first film's context is made), and MuJoCo's warnings to Python's
    logging (logger "mujoco"), but for a deprecation in Gymnasium's models that users can do
    nothing about."""
    import logging

    import mujoco

    choose_mujoco_backend()

    def warn(message: str) -> None:
        if not message.startswith(_MUJOCO_NOISE):
            logging.getLogger("mujoco").warning(message)

    mujoco.set_mju_user_warning(warn)


def is_mujoco(env_id: str) -> bool:
    """A registered MuJoCo env (Hopper-v5, ...)."""
    return ":" not in env_id and env_id in gym.registry and "mujoco" in str(gym.spec(env_id).entry_point)


def _extra_for(env_id: str) -> str:
    """The gymflow extra that installs a registered env's simulator."""
    if env_id.startswith("ALE/"):
        return "atari"
    entry_point = str(getattr(gym.spec(env_id), "entry_point", ""))
    return "mujoco" if "mujoco" in entry_point else "box2d" if "box2d" in entry_point else "mujoco,box2d"


def check_env(
    env_id: str, kwargs: dict[str, Any], action_spaces: tuple[type[spaces.Space], ...], algo: str,
    preprocessing: Preprocessing | None = None, images: bool = True,
) -> tuple[spaces.Box, spaces.Space]:
    """Make the env once (wrapped) and check its spaces; returns (observation_space, action_space).
    `images`: whether the agent reads image observations."""
    if is_multi_agent(env_id):
        return _check_agents(env_id, kwargs, action_spaces, algo, preprocessing)
    try:
        env = make_env(env_id, kwargs, preprocessing=preprocessing)
    except EnvSpecError:
        raise
    except (gym.error.DependencyNotInstalled, ImportError) as error:  # gymnasium's MuJoCo envs: ImportError
        raise EnvSpecError("env.id", f"{env_id!r} needs a package that is not installed ({error}); "
                           f"gymflow's extras have them: pip install 'gymflow[{_extra_for(env_id)}]'") from None
    except gym.error.NameNotFound as error:
        extra = " (the ALE/... ids come with gymflow's atari extra: pip install 'gymflow[atari]')" \
            if env_id.startswith("ALE/") else ""
        raise EnvSpecError("env.id", f"{env_id!r} is not a registered Gymnasium id ({error}){extra}") from None
    except gym.error.Error as error:
        raise EnvSpecError(
            "env.id", f"{env_id!r} is not a registered Gymnasium id ({error}); "
            "use an id such as 'CartPole-v1' or a 'module:Class' entry point"
        ) from None
    except TypeError as error:
        raise EnvSpecError("env.kwargs", f"{env_id!r} refused its kwargs: {error}") from None
    try:
        observation_space, action_space = env.observation_space, env.action_space
        if is_users_env(env_id):
            check_what_it_observes(env, env_id)
    finally:
        env.close()
    _check_observations(env_id, observation_space, algo, images)
    if not isinstance(action_space, action_spaces):
        allowed = " or ".join(space.__name__ for space in action_spaces)
        raise EnvSpecError(
            "agent.algo", f"{algo} supports {allowed} action spaces; {env_id!r} acts in {action_space}"
        )
    if isinstance(action_space, spaces.Box) and not np.all(np.isfinite(action_space.low)):
        raise EnvSpecError("env.id", f"{env_id!r} has an unbounded Box action space")
    return observation_space, action_space


def env_spaces(env_id: str, kwargs: dict[str, Any], preprocessing: Preprocessing | None = None
               ) -> tuple[spaces.Space, spaces.Space]:
    """An env's (observation, action) spaces as gymflow's vector envs present them: a PettingZoo
    env's as its rows (envs/agents.py)."""
    if is_multi_agent(env_id):
        from gymflow.envs.agents import agent_table

        table = agent_table(env_id, kwargs, (preprocessing or Preprocessing()).global_state)
        return table.observation_space, table.action_space
    env = make_env(env_id, kwargs, preprocessing=preprocessing)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def _check_agents(env_id: str, kwargs: dict[str, Any], action_spaces: tuple[type[spaces.Space], ...], algo: str,
                  preprocessing: Preprocessing | None) -> tuple[spaces.Box, spaces.Space]:
    """A PettingZoo env's spaces as rows (envs/agents.py): made once, its agents able to share a policy."""
    from gymflow.envs.agents import agent_table

    preprocessing = preprocessing or Preprocessing()
    if preprocessing != Preprocessing(training=preprocessing.training, global_state=preprocessing.global_state):
        raise EnvSpecError("env.id", f"{env_id!r} is a PettingZoo env: frame stacks, Atari's preprocessing and hidden "
                                     "entries are for Gymnasium envs; allowed: none of them")
    table = agent_table(env_id, kwargs, preprocessing.global_state)
    if not isinstance(table.action_space, action_spaces):
        allowed = " or ".join(space.__name__ for space in action_spaces)
        raise EnvSpecError("agent.algo", f"{algo} supports {allowed} action spaces; {env_id!r} acts in "
                                         f"{table.action_space}")
    return table.observation_space, table.action_space


def is_image(space: spaces.Space) -> bool:
    """Observations a CNN reads: uint8 frames, channels (or stacked frames) first."""
    return isinstance(space, spaces.Box) and len(space.shape) == 3 and space.dtype == np.uint8


def reads_pixels(space: spaces.Space) -> bool:
    """Observations a CNN reads, whole (images) or in part (a Dict with image parts)."""
    return is_image(space) or bool(image_parts(space))


# where Gymnasium's, the ALE's and the MuJoCo envs' classes live: their observations fit their spaces
_TRUSTED_ENTRY_POINTS = ("gymnasium.", "ale_py", "shimmy", "gymflow.")


def is_users_env(env_id: str) -> bool:
    """An env gymflow and Gymnasium do not ship: a 'module:Class' entry point outside gymflow, or an id
    registered to one."""
    if ":" in env_id:
        return not env_id.startswith("gymflow.")
    try:
        entry_point = gym.spec(env_id).entry_point
    except gym.error.Error:
        return False
    return not (isinstance(entry_point, str) and entry_point.startswith(_TRUSTED_ENTRY_POINTS))


def check_what_it_observes(env: gym.Env, env_id: str) -> None:
    """A user's env reset (seed 0) and stepped once with a sampled action: what it returns must fit the
    observation space it declares, before any run starts on it (a rollout would fail on the workers)."""
    try:
        first, _ = env.reset(seed=0)
        env.action_space.seed(0)
        then, *_ = env.step(env.action_space.sample())
    except EnvSpecError:  # ObservationsChecked's: what it returned against its space
        raise
    except Exception as error:  # the user's code: said in one line, as a job's error would be
        raise EnvSpecError("env.id", f"{env_id!r} raised {type(error).__name__}: {error} as it was reset (seed 0) "
                                     "and stepped once, before the run") from None
    _fits(env_id, "reset", first, env.observation_space)
    _fits(env_id, "step", then, env.observation_space)


def _fits(env_id: str, where: str, observation: Any, space: spaces.Space) -> None:
    if isinstance(space, spaces.Dict):
        if not isinstance(observation, dict) or set(observation) != set(space.spaces):
            seen = sorted(observation) if isinstance(observation, dict) else type(observation).__name__
            raise EnvSpecError("env.id", f"{env_id!r} returned {seen} from {where}; its observation_space is a "
                                         f"Dict of {sorted(space.spaces)}")
        for key, part in space.spaces.items():
            _fits(env_id, f"{where} (part {key!r})", observation[key], part)
        return
    array = np.asarray(observation)
    if space.shape is not None and array.shape != space.shape:
        raise EnvSpecError("env.id", f"{env_id!r} returned an observation of shape {array.shape} from {where}; its "
                                     f"observation_space {space} holds shape {space.shape}")
    if not np.can_cast(array.dtype, space.dtype, casting="same_kind"):
        raise EnvSpecError("env.id", f"{env_id!r} returned {array.dtype} observations from {where}; its "
                                     f"observation_space holds {space.dtype}")


def _check_observations(env_id: str, space: spaces.Space, algo: str, images: bool) -> None:
    if image_parts(space) and not images:
        keys = ", ".join(part.key for part in image_parts(space))
        raise EnvSpecError("agent.algo", f"{algo} reads vector observations; {env_id!r} observes images among its "
                                         f"parts ({keys}): use ppo, dqn, sac or td3")
    if isinstance(space, spaces.Box) and len(space.shape) == 1:
        return
    if is_image(space):
        if space.shape[0] > 4 and space.shape[2] <= 4:
            raise EnvSpecError("env.id", f"{env_id!r} observes images of shape {space.shape}, channels last; "
                                         "allowed: [channels, height, width] (or grey [height, width])")
        if not images:
            raise EnvSpecError("agent.algo", f"{algo} reads vector observations; {env_id!r} observes images "
                                             f"{space.shape}: use ppo, dqn, sac or td3")
        return
    raise EnvSpecError(
        "env.id", f"{env_id!r} observes {space}; allowed: a 1-D Box, uint8 images [height, width] or "
                  "[channels, height, width], or a Dict of such parts"
    )


def _entry_point_class(entry_point: str) -> type[gym.Env]:
    module_name, _, class_name = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EnvSpecError("env.id", f"cannot import {module_name!r}: {error}") from None
    env_class = getattr(module, class_name, None)
    if env_class is None:
        envs = [name for name, value in vars(module).items() if isinstance(value, type) and issubclass(value, gym.Env)]
        raise EnvSpecError("env.id", f"{module_name!r} has no {class_name!r}{did_you_mean(class_name, envs)}; "
                                     f"its gymnasium.Env classes: {', '.join(sorted(envs)) or 'none'}")
    if not (isinstance(env_class, type) and issubclass(env_class, gym.Env)):
        raise EnvSpecError(
            "env.id", f"{entry_point!r} is not a gymnasium.Env subclass in {module_name!r}"
        )
    return env_class
