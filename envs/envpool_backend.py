"""EnvPool's C++ vector envs (a batch stepped by threads in one call) behind gymflow's vector env,
for the tasks EnvPool has as Gymnasium and gymflow define them: MuJoCo's v5 tasks, and the ALE's
games under gymflow's Atari preprocessing (up to 30 no-op starts, 4 frames a step max-pooled, 84x84
grey, the preset's sticky actions, FIRE at a game's start; for training, a lost life terminal for
learning and rewards clipped to their sign; whole games).

What differs from envs/vector.py's Gymnasium path: EnvPool seeds an env once, when its pool is made
(a reset's seed is ignored), so an episode cannot be started again from its seed and an env cursor
cannot be replayed. A rollout that continues where its envs are not live (a retried or moved job, a
resumed run) starts new episodes, from a pool seed drawn from the run's and the cursor's: the step
budget and every shard landing once hold, an uninterrupted run's exact trajectory does not; and
Atari's FIRE is pressed at a game's start only (the Gymnasium path presses it after each lost life
too), as EnvPool's and CleanRL's EnvPool runs do."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import spaces

from gymflow.envs.make import EnvSpecError, Preprocessing, is_mujoco
from gymflow.envs.seeding import derive_seed
from gymflow.envs.steps import EnvCursor, VectorStep, observation_dtype

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
                "img_width": 84, "gray_scale": True, "use_inter_area_resize": True, "use_fire_reset": True,
                "episodic_life": False, "reward_clip": preprocessing.training,
                "max_episode_steps": ATARI_FRAMES_PER_EPISODE // 4}
    return PoolTask(task_id, options, lives_matter=preprocessing.training)


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


class EnvPoolVectorEnv:
    """`num_envs` envs of a PoolTask stepped by EnvPool's threads; the seeded vector env's interface
    (envs/vector.py): same-step autoreset, episode returns, the cursor a shard keeps."""

    def __init__(self, task: PoolTask, num_envs: int, seed: int, threads: int = 1):
        import envpool

        self.task, self.num_envs, self.seed, self.threads = task, num_envs, seed, threads
        self._pool: Any = None
        made = envpool.make_spec(task.task_id, **task.options)
        self.observation_space = _observation_space(made.observation_space)
        self.action_space = _action_space(made.action_space)
        self._discrete = not self.action_space.shape
        self.episode_index = np.zeros(num_envs, dtype=np.int64)
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self._log = _ActionLog(num_envs)
        self._lives = np.zeros(num_envs, dtype=np.int64)
        self.memory: np.ndarray | None = None
        self.obs = np.zeros((num_envs, *self.observation_space.shape), dtype=observation_dtype(self.observation_space))
        self.agents: np.ndarray | None = None
        self.alive: np.ndarray | None = None

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
        self.obs = np.zeros_like(self.obs)  # not the last step's, which its caller may keep
        self._begin(*self._pool.reset())
        return self.obs

    def step(self, actions: np.ndarray) -> VectorStep:
        return self.step_rows(slice(0, self.num_envs), actions)

    def step_rows(self, rows: slice, actions: np.ndarray) -> VectorStep:
        """Step the envs of `rows` alone; the others stand (as envs/vector.py's)."""
        first, stop, _ = rows.indices(self.num_envs)
        ids = np.arange(first, stop, dtype=np.int32)
        sent = np.array(actions, dtype=np.int32 if self._discrete else np.float64)
        obs, rewards, terminated, truncated, info = self._pool.step(sent, ids)
        replied = np.asarray(info["env_id"])
        if not np.array_equal(replied, ids):  # the pool's replies by env
            order = np.argsort(replied)
            obs, rewards, terminated, truncated, replied = (obs[order], rewards[order], terminated[order],
                                                            truncated[order], replied[order])
            info = {"lives": np.asarray(info["lives"])[order]} if self.task.lives_matter else info
        self._log.add(first, sent)
        self.episode_return[first:stop] += rewards
        self.episode_length[first:stop] += 1
        ended = terminated | truncated
        learning_end = terminated.copy()
        if self.task.lives_matter:
            lives = np.asarray(info["lives"])
            learning_end |= (lives < self._lives[first:stop]) & ~ended
            self._lives[first:stop] = lives
        # the step's own arrays (EnvPool's replies are fresh each step), as envs/vector.py's: a caller may keep them
        stepped = obs if obs.dtype == self.obs.dtype else obs.astype(self.obs.dtype)
        if stop - first == self.num_envs:
            self.obs = stepped
        else:
            self.obs = self.obs.copy()
            self.obs[first:stop] = stepped
        if not ended.any():
            return VectorStep(stepped, rewards.astype(np.float32), learning_end, truncated.astype(bool), [], [], [], [])
        done = ids[ended]
        step = VectorStep(stepped, rewards.astype(np.float32), learning_end, truncated.astype(bool), done.tolist(),
                          list(stepped[ended]), self.episode_return[done].tolist(), self.episode_length[done].tolist())
        self.episode_index[done] += 1
        self._begin(*self._pool.reset(done))
        step.obs[ended] = self.obs[done]
        return step

    def cursor(self) -> EnvCursor:
        dtype = np.int64 if self._discrete else np.float32
        taken = [np.asarray(self._log.of(i), dtype=dtype).reshape(-1, *self.action_space.shape)
                 for i in range(self.num_envs)]
        counts = np.array([len(actions) for actions in taken], dtype=np.int64)
        return EnvCursor(self.episode_index.copy(), counts, np.concatenate(taken), self.memory)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _begin(self, obs: np.ndarray, info: dict[str, Any]) -> None:
        """Episodes begun: the pool's replies to a reset, `obs` and `info`, each naming its env."""
        ids = np.asarray(info["env_id"])
        self.obs[ids] = obs
        if self.task.lives_matter:
            self._lives[ids] = info["lives"]
        self.episode_return[ids], self.episode_length[ids] = 0.0, 0
        self._log.began(ids)


class _ActionLog:
    """The actions each env took since its episode began, logged one array a step (not one append an
    env a step); the cursor gathers each env's once a rollout."""

    def __init__(self, num_envs: int):
        self._steps: list[tuple[int, np.ndarray]] = []  # (first row, the actions of the rows from it)
        self._base = 0  # the step number of _steps[0]
        self._began = np.zeros(num_envs, dtype=np.int64)  # the step number each env's episode began at

    def add(self, first_row: int, actions: np.ndarray) -> None:
        self._steps.append((first_row, actions))

    def began(self, ids: np.ndarray) -> None:
        """Episodes begun at `ids`: the steps no env's episode holds any more are let go."""
        self._began[ids] = self._base + len(self._steps)
        unheld = int(self._began.min()) - self._base
        if unheld >= 256:
            del self._steps[:unheld]
            self._base += unheld

    def of(self, env: int) -> list[np.ndarray]:
        start = int(self._began[env]) - self._base
        return [actions[env - first] for first, actions in self._steps[start:] if first <= env < first + len(actions)]


def _observation_space(space: spaces.Box) -> spaces.Box:
    """EnvPool's observation space as Gymnasium's env has it (MuJoCo's float64 vectors, uint8 frames)."""
    return spaces.Box(space.low, space.high, space.shape, space.dtype)


def _action_space(space: spaces.Space) -> spaces.Space:
    """EnvPool's action space as Gymnasium's env has it: a MuJoCo Box of float32."""
    if isinstance(space, spaces.Box):
        return spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), space.shape, np.float32)
    return spaces.Discrete(int(space.n))
