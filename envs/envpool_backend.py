"""EnvPool's C++ vector envs (a batch stepped by threads in one call) behind gymflow's vector env,
for the tasks EnvPool has as Gymnasium and gymflow define them: MuJoCo's v5 tasks, and the ALE's
games under gymflow's Atari preprocessing (up to 30 no-op starts, 4 frames a step max-pooled, 84x84
grey, the preset's sticky actions, FIRE at a game's start and after each lost life; for training, a
lost life terminal for learning and rewards clipped to their sign; whole games).

What differs from envs/vector.py's Gymnasium path: EnvPool seeds an env once, when its pool is made
(a reset's seed is ignored), so an episode cannot be started again from its seed and an env cursor
cannot be replayed. A rollout that continues where its envs are not live (a retried or moved job, a
resumed run) starts new episodes, from a pool seed drawn from the run's and the cursor's: the step
budget and every shard landing once hold, an uninterrupted run's exact trajectory does not. Atari's
FIRE at a game's start and after a lost life replaces the env's next two actions (envs/batched.py)
where the Gymnasium path presses it inside the reset or the step that lost the life."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import spaces

from gymflow.envs.batched import ActionLog, BatchedVectorEnv, PoolReply, in_env_order
from gymflow.envs.make import EnvSpecError, FireToServe, Preprocessing, is_mujoco
from gymflow.envs.seeding import derive_seed
from gymflow.envs.steps import EnvCursor, VectorStep

ATARI_FRAMES_PER_EPISODE = 108_000  # the ALE v5 ids' cap, in frames: 27,000 steps of 4
# Gymnasium's ALE kwargs that EnvPool's Atari tasks take under the same name and meaning
ATARI_KWARGS = {"repeat_action_probability": 0.25, "full_action_space": False}
# Gymnasium's MuJoCo kwargs EnvPool's tasks do not take as Gymnasium means them
MUJOCO_KWARGS_REFUSED = {"xml_file", "render_mode", "width", "height", "camera_id", "camera_name",
                         "default_camera_config", "frame_skip", "max_episode_steps"}


@dataclass(frozen=True)
class PoolTask:
    """An EnvPool task and the keyword arguments of `envpool.make` that make it the preset's env."""

    task_id: str
    options: dict[str, Any] = field(default_factory=dict)
    lives_matter: bool = False  # Atari in training: a lost life is terminal for learning, the game goes on
    game: str | None = None  # an Atari task's ROM, by the ALE's name


def envpool_installed() -> bool:
    return importlib.util.find_spec("envpool") is not None


def pool_task(env_id: str, kwargs: dict[str, Any], preprocessing: Preprocessing) -> PoolTask:
    """The EnvPool task that is `env_id` with `kwargs`, wrapped as `preprocessing` says; an
    EnvSpecError naming env.backend where EnvPool has none (or is not installed)."""
    if not envpool_installed():
        raise EnvSpecError("env.backend", "envpool is not installed: pip install 'gymflow[envpool]', or allowed: "
                                          "gymnasium, auto")
    if preprocessing.hide:
        raise EnvSpecError("env.backend", "envpool observes whole vectors; allowed with env.hide: gymnasium, auto")
    if env_id.startswith("ALE/"):
        return _atari_task(env_id, kwargs, preprocessing)
    if is_mujoco(env_id) and env_id.endswith("-v5") and not preprocessing.atari and preprocessing.frame_stack == 1:
        return _mujoco_task(env_id, kwargs)
    raise EnvSpecError("env.backend", f"envpool has no task that is {env_id!r} as gymflow makes it; allowed: "
                                      "MuJoCo's v5 ids, ALE/... ids with env.atari, or env.backend gymnasium")


def _atari_task(env_id: str, kwargs: dict[str, Any], preprocessing: Preprocessing) -> PoolTask:
    task_id = env_id.removeprefix("ALE/")
    unknown = sorted(set(kwargs) - set(ATARI_KWARGS))
    if not preprocessing.atari or unknown or task_id not in _envpool_tasks():
        why = "without env.atari" if not preprocessing.atari else f"with env.kwargs {unknown}" if unknown else ""
        raise EnvSpecError("env.backend", f"envpool has no task that is {env_id!r} {why}".rstrip() +
                           "; allowed: env.backend gymnasium")
    options = {name: kwargs.get(name, default) for name, default in ATARI_KWARGS.items()}
    options |= {"stack_num": preprocessing.frame_stack, "frame_skip": 4, "noop_max": 30, "img_height": 84,
                "img_width": 84, "gray_scale": True, "use_inter_area_resize": True, "use_fire_reset": False,
                "episodic_life": False, "reward_clip": preprocessing.training,
                "max_episode_steps": ATARI_FRAMES_PER_EPISODE // 4}
    import ale_py
    import gymnasium

    gymnasium.register_envs(ale_py)
    return PoolTask(task_id, options, lives_matter=preprocessing.training, game=gymnasium.spec(env_id).kwargs["game"])


def _mujoco_task(env_id: str, kwargs: dict[str, Any]) -> PoolTask:
    if env_id not in _envpool_tasks():
        raise EnvSpecError("env.backend", f"envpool has no task {env_id!r}; allowed: env.backend gymnasium")
    import envpool

    taken = set(envpool.make_spec(env_id).config._fields)
    refused = sorted(name for name in kwargs if name in MUJOCO_KWARGS_REFUSED or name not in taken)
    if refused:
        raise EnvSpecError("env.backend", f"envpool's {env_id} does not take env.kwargs {refused} as Gymnasium does; "
                                          "allowed: env.backend gymnasium")
    return PoolTask(env_id, dict(kwargs))


def _envpool_tasks() -> frozenset[str]:
    import envpool

    return frozenset(envpool.list_all_envs())


class EnvPoolVectorEnv(BatchedVectorEnv):
    """`num_envs` envs of a PoolTask stepped by EnvPool's threads, as envs/batched.py keeps them."""

    def __init__(self, task: PoolTask, num_envs: int, seed: int, threads: int = 1):
        import envpool

        made = envpool.make_spec(task.task_id, **task.options)
        super().__init__(_observation_space(made.observation_space), _action_space(made.action_space), num_envs,
                         seed, task.lives_matter, serves=task.game is not None and FireToServe.needed_by(task.game))
        self.task, self.threads = task, threads
        self._pool: Any = None

    def reset(self, cursor: EnvCursor | None = None) -> np.ndarray:
        """Start every env at episode 0; with a `cursor`, at a new episode after the one it names
        (EnvPool cannot replay an episode: its pool seed is drawn from the cursor)."""
        import envpool

        if cursor is not None and len(cursor.episode_index) != self.num_envs:
            raise ValueError(f"cursor holds {len(cursor.episode_index)} envs, not {self.num_envs}")
        self.close()
        started = np.zeros(self.num_envs, dtype=np.int64) if cursor is None else \
            cursor.episode_index + (cursor.action_counts > 0)
        pool_seed = self.seed if cursor is None else derive_seed(self.seed, "envpool", *started.tolist())
        pool_seed %= 2**31  # EnvPool takes an int32
        self._pool = envpool.make(self.task.task_id, env_type="gymnasium", num_envs=self.num_envs, seed=pool_seed,
                                  num_threads=self.threads, **self.task.options)
        self.memory = None if cursor is None else cursor.memory
        self.episode_index[:] = started
        self._log = ActionLog(self.num_envs)
        self.obs = np.zeros_like(self.obs)  # not the last step's, which its caller may keep
        self._begin(*self._replied(*self._pool.reset()))
        return self.obs

    def step_rows(self, rows: slice, actions: np.ndarray) -> VectorStep:
        """Step the envs of `rows` alone; the others stand (as envs/vector.py's)."""
        first, stop, _ = rows.indices(self.num_envs)
        return self._step_envs(first, stop, actions)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _step_pool(self, ids: np.ndarray, actions: np.ndarray) -> PoolReply:
        every = len(ids) == self.num_envs  # the pool's own ids then: one conversion fewer
        obs, rewards, terminated, truncated, info = self._pool.step(actions, None if every else ids)
        replied = np.asarray(info["env_id"])
        lives = np.asarray(info["lives"]) if self.lives_matter or self.serves else None
        if in_env_order(replied, ids):
            return PoolReply(obs, rewards, terminated, truncated, lives)
        order = np.argsort(replied)  # the pool's replies by env
        return PoolReply(obs[order], rewards[order], terminated[order], truncated[order],
                         None if lives is None else lives[order])

    def _start_episodes(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, None]:
        replied, obs, lives = self._replied(*self._pool.reset(ids))
        order = np.argsort(replied)
        return obs[order], None if lives is None else lives[order], None

    def _replied(self, obs: np.ndarray, info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A reset's reply: the envs it names, their observations and lives."""
        return np.asarray(info["env_id"]), obs, np.asarray(info["lives"]) if self.lives_matter or self.serves else None


def _observation_space(space: spaces.Box) -> spaces.Box:
    """EnvPool's observation space as Gymnasium's env has it (MuJoCo's float64 vectors, uint8 frames)."""
    return spaces.Box(space.low, space.high, space.shape, space.dtype)


def _action_space(space: spaces.Space) -> spaces.Space:
    """EnvPool's action space as Gymnasium's env has it: a MuJoCo Box of float32."""
    if isinstance(space, spaces.Box):
        return spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), space.shape, np.float32)
    return spaces.Discrete(int(space.n))
