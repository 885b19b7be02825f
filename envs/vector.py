"""An in-process vector of environments whose every episode is reproducible.

Gymnasium's own vector envs reset finished sub-envs from a running RNG, so where an env stands
cannot be written down without pickling it. Here episode k of env i always starts from
`reset(seed=episode_seed(seed, i, k))`, and the cursor — the episode index of each env and the
actions taken since its reset — is enough to rebuild the exact state by replaying those actions.
A cursor is a few numeric arrays, so it travels in a shard and a rollout can continue on any
worker, after any retry, exactly where the previous one stopped.

Dask worker processes are daemonic and cannot start subprocesses, so the envs step in-process.
Autoreset is "same step": the observation returned for a finished env is the first of its next
episode, and the last observation of the finished one is handed back separately.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from gymflow.envs.make import LIFE_LOST, Preprocessing, is_multi_agent, make_env
from gymflow.envs.seeding import derive_seed
from gymflow.envs.steps import Backend, EnvCursor, VectorStep, observation_dtype

__all__ = ["AnyVectorEnv", "EnvCursor", "SeededVectorEnv", "VectorStep", "make_vector_env", "observation_dtype"]

if TYPE_CHECKING:
    from gymflow.envs.agents import SeededAgentVectorEnv
    from gymflow.envs.ale_backend import AleVectorEnv
    from gymflow.envs.envpool_backend import EnvPoolVectorEnv


def make_vector_env(env_id: str, env_kwargs: dict[str, Any], num_envs: int, seed: int,
                    preprocessing: Preprocessing | None = None, backend: str | Backend = "gymnasium") -> AnyVectorEnv:
    """`num_envs` envs of an id, seeded; a PettingZoo env's games give a row to each of their agents;
    `backend` envpool: stepped by EnvPool's threads (envs/envpool_backend.py); ale: by the ALE's vector
    env's (envs/ale_backend.py)."""
    backend = backend if isinstance(backend, Backend) else Backend(backend)
    if backend.name == "ale":
        from gymflow.envs.ale_backend import AleVectorEnv, ale_game

        game = ale_game(env_id, env_kwargs, preprocessing or Preprocessing())
        return AleVectorEnv(game, num_envs, seed, backend.threads)
    if backend.name == "envpool":
        from gymflow.envs.envpool_backend import EnvPoolVectorEnv, pool_task

        task = pool_task(env_id, env_kwargs, preprocessing or Preprocessing())
        return EnvPoolVectorEnv(task, num_envs, seed, backend.threads)
    if is_multi_agent(env_id):
        from gymflow.envs.agents import SeededAgentVectorEnv  # it imports this module

        return SeededAgentVectorEnv(env_id, env_kwargs, num_envs, seed, (preprocessing or Preprocessing()).global_state)
    return SeededVectorEnv(env_id, env_kwargs, num_envs, seed, preprocessing)


class SeededVectorEnv:
    def __init__(self, env_id: str, env_kwargs: dict[str, Any], num_envs: int, seed: int,
                 preprocessing: Preprocessing | None = None):
        self.envs = [make_env(env_id, env_kwargs, preprocessing=preprocessing) for _ in range(num_envs)]
        self.num_envs = num_envs
        self.seed = seed
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self._discrete = not self.action_space.shape
        self.episode_index = np.zeros(num_envs, dtype=np.int64)
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self._actions: list[list[Any]] = [[] for _ in range(num_envs)]
        self.memory: np.ndarray | None = None  # a recurrent policy's memory of these envs, carried between rounds
        self.obs = np.zeros((num_envs, *self.observation_space.shape), dtype=observation_dtype(self.observation_space))
        self.agents: np.ndarray | None = None  # one env, one agent (envs/agents.py has envs whose agents are rows)
        self.alive: np.ndarray | None = None

    def reset(self, cursor: EnvCursor | None = None) -> np.ndarray:
        """Start every env at episode 0, or where `cursor` says it stands."""
        if cursor is not None and len(cursor.episode_index) != self.num_envs:
            raise ValueError(f"cursor holds {len(cursor.episode_index)} envs, not {self.num_envs}")
        self.memory = None if cursor is None else cursor.memory
        for i in range(self.num_envs):
            self.episode_index[i] = 0 if cursor is None else cursor.episode_index[i]
            self._begin_episode(i)
            if cursor is not None:
                self._replay(i, cursor.actions_of(i))
        return self.obs

    def step(self, actions: np.ndarray) -> VectorStep:
        return self.step_rows(slice(0, self.num_envs), actions)

    def step_rows(self, rows: slice, actions: np.ndarray) -> VectorStep:
        """Step the envs of `rows` alone (one action each); the others stand. The step's arrays are
        the rows', its `done_envs` indices of the whole vector, as `step`'s are."""
        indices = range(*rows.indices(self.num_envs))
        n = len(indices)
        obs = np.empty_like(self.obs) if n == self.num_envs else self.obs.copy()
        rewards = np.empty(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        done_envs, done_obs, returns, lengths = [], [], [], []
        for j, i in enumerate(indices):
            env = self.envs[i]
            action = int(actions[j]) if self._discrete else np.array(actions[j], dtype=np.float32)
            next_obs, reward, term, trunc, info = env.step(action)
            self._actions[i].append(action)
            self.episode_return[i] += reward
            self.episode_length[i] += 1
            # a lost life (Atari, training) is terminal for learning; the episode goes on
            rewards[j], terminated[j], truncated[j] = reward, term or bool(info.get(LIFE_LOST)), trunc
            if term or trunc:
                done_envs.append(i)
                done_obs.append(np.asarray(next_obs, dtype=self.obs.dtype))
                returns.append(float(self.episode_return[i]))
                lengths.append(int(self.episode_length[i]))
                self.episode_index[i] += 1
                self._begin_episode(i)
                next_obs = self.obs[i]
            obs[i] = next_obs
        self.obs = obs
        return VectorStep(obs[rows], rewards, terminated, truncated, done_envs, done_obs, returns, lengths)

    def cursor(self) -> EnvCursor:
        counts = np.array([len(a) for a in self._actions], dtype=np.int64)
        action_shape = self.action_space.shape
        dtype = np.int64 if self._discrete else np.float32
        flat = [a for env_actions in self._actions for a in env_actions]
        actions = np.asarray(flat, dtype=dtype).reshape(-1, *action_shape)
        return EnvCursor(self.episode_index.copy(), counts, actions, self.memory)

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def _begin_episode(self, i: int) -> None:
        seed = derive_seed(self.seed, i, int(self.episode_index[i]))
        first_obs, _ = self.envs[i].reset(seed=seed)
        self.obs[i] = first_obs
        self.episode_return[i] = 0.0
        self.episode_length[i] = 0
        self._actions[i] = []

    def _replay(self, i: int, actions: np.ndarray) -> None:
        env = self.envs[i]
        for action in actions:
            action = int(action) if self._discrete else action
            next_obs, reward, term, trunc, _ = env.step(action)
            if term or trunc:
                raise RuntimeError(
                    "replaying an env cursor ended an episode early: the environment is not "
                    "deterministic under reset(seed=...)"
                )
            self._actions[i].append(action)
            self.episode_return[i] += reward
            self.episode_length[i] += 1
            self.obs[i] = next_obs


AnyVectorEnv: TypeAlias = "SeededVectorEnv | SeededAgentVectorEnv | EnvPoolVectorEnv | AleVectorEnv"
