"""PettingZoo parallel envs as rows of a vector env: every agent of every game is one row.

A preset names one with `env.id: "pettingzoo:<module>"` (the module's `parallel_env(**kwargs)`
makes it, as PettingZoo's and mpe2's task modules do) or `"pettingzoo:<module>:<factory>"`.
Collection, shards, the learner and evaluation then see N games of K agents as N x K envs
(row n * K + k is agent k of game n), so one shared policy acts for every agent — parameter
sharing, the agent's index in its observation as a one-hot — and PPO over these rows is IPPO.

Each row observes its agent's observation, padded with zeros to the longest of the agents', then
the one-hot; with `env.global_state`, then the game's `state()`, which only PPO's critic reads
(MAPPO's centralised critic). An agent that leaves mid-episode (`env.agents` shrinks) ends its row's episode there
(terminated or truncated as the env says); its row is not alive until its game ends and a new one
starts, and the learner leaves those steps out (`alive`). Every game's episode k starts from
`reset(seed=derive_seed(seed, n, k))`, and the cursor holds each row's actions since, as the
single-agent vector env's does, so a rollout continues exactly on any worker.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from gymflow.envs.make import PETTINGZOO, EnvSpecError
from gymflow.envs.seeding import derive_seed
from gymflow.envs.steps import EnvCursor, VectorStep


def make_parallel_env(env_id: str, kwargs: dict[str, Any] | None = None, render_mode: str | None = None) -> Any:
    """The PettingZoo ParallelEnv an env id names."""
    module_name, _, factory_name = env_id.removeprefix(PETTINGZOO).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EnvSpecError("env.id", f"cannot import {module_name!r} ({error}); PettingZoo's tasks come with "
                                        "gymflow's multiagent extra: pip install 'gymflow[multiagent]'") from None
    factory = getattr(module, factory_name or "parallel_env", None)
    if not callable(factory):
        raise EnvSpecError("env.id", f"{module_name!r} has no {factory_name or 'parallel_env'!r} that makes a "
                                        "PettingZoo ParallelEnv")
    options = dict(kwargs or {}) | ({"render_mode": render_mode} if render_mode else {})
    try:
        env = factory(**options)
    except TypeError as error:
        raise EnvSpecError("env.kwargs", f"{env_id!r} refused its kwargs: {error}") from None
    if not hasattr(env, "possible_agents") or not hasattr(env, "step"):
        raise EnvSpecError("env.id", f"{env_id!r} made a {type(env).__name__}, not a PettingZoo ParallelEnv")
    return env


def group_of(agent: str) -> str:
    """PettingZoo's naming: 'adversary_0' and 'adversary_1' are in group 'adversary'."""
    return agent.rpartition("_")[0] or agent


class RowsBox(spaces.Box):
    """A row's Box: what its agent observes, its agent's one-hot index from entry `index_at`
    (agent k of `groups`, k's group), then, from `actor_entries` on, the game's global state, which
    a centralised critic alone reads."""

    def __init__(self, size: int, actor_entries: int, index_at: int, groups: tuple[str, ...]):
        super().__init__(-np.inf, np.inf, shape=(size,), dtype=np.float32)
        self.actor_entries, self.index_at, self.groups = actor_entries, index_at, groups


def actor_entries(space: spaces.Space) -> int | None:
    """How many of an observation's entries the actor reads; None: all of them."""
    entries = getattr(space, "actor_entries", None)
    return None if entries == space.shape[-1] else entries


@dataclass(frozen=True)
class AgentTable:
    """The agents of one game as rows: their names and groups, and the spaces of a row."""

    agents: tuple[str, ...]
    groups: tuple[str, ...]
    observation_sizes: tuple[int, ...]
    action_space: spaces.Space
    state_size: int = 0  # the game's global state, carried by every row (0: not carried)

    @classmethod
    def of(cls, env: Any, env_id: str, global_state: bool = False) -> AgentTable:
        agents = tuple(env.possible_agents)
        sizes = []
        for agent in agents:
            space = env.observation_space(agent)
            if not (isinstance(space, spaces.Box) and len(space.shape) == 1):
                raise EnvSpecError("env.id", f"{env_id!r}: agent {agent!r} observes {space}; allowed: a 1-D Box "
                                                "(images and Dicts of agents are not yet read)")
            sizes.append(int(space.shape[0]))
        action_space = env.action_space(agents[0])
        for agent in agents[1:]:
            if env.action_space(agent) != action_space:
                raise EnvSpecError("env.id", f"{env_id!r}: agent {agent!r} acts in {env.action_space(agent)}, "
                                                f"{agents[0]!r} in {action_space}; allowed: one action space for all")
        groups = tuple(group_of(agent) for agent in agents)
        return cls(agents, groups, tuple(sizes), action_space, _state_size(env, env_id) if global_state else 0)

    @property
    def actor_entries(self) -> int:
        return max(self.observation_sizes) + len(self.agents)

    @property
    def observation_space(self) -> RowsBox:
        """A row: the agent's observation, zero-padded to the longest, its one-hot index, then the
        game's state where carried."""
        return RowsBox(self.actor_entries + self.state_size, self.actor_entries, max(self.observation_sizes),
                       self.groups)

    def row(self, index: int, observation: np.ndarray | None, state: np.ndarray | None = None) -> np.ndarray:
        """Agent `index`'s row; zeros but for its index (and the state) where it observes nothing (it has left)."""
        row = np.zeros(self.actor_entries + self.state_size, dtype=np.float32)
        if observation is not None:
            row[: self.observation_sizes[index]] = observation
        row[self.actor_entries - len(self.agents) + index] = 1.0
        if state is not None:
            row[self.actor_entries :] = state
        return row


def _state_size(env: Any, env_id: str) -> int:
    space = getattr(env, "state_space", None)
    if not (isinstance(space, spaces.Box) and len(space.shape) == 1):
        raise EnvSpecError("env.global_state", f"{env_id!r} has no 1-D Box state_space (its state() is what a "
                                               f"centralised critic reads); it has {space}: allowed: false")
    return int(space.shape[0])


def agent_table(env_id: str, kwargs: dict[str, Any], global_state: bool = False) -> AgentTable:
    env = make_parallel_env(env_id, kwargs)
    try:
        return AgentTable.of(env, env_id, global_state)
    finally:
        env.close()


class SeededAgentVectorEnv:
    """`num_games` games of one PettingZoo ParallelEnv as `num_games x K` rows."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], num_games: int, seed: int,
                 global_state: bool = False, render_mode: str | None = None):
        self.games = [make_parallel_env(env_id, env_kwargs, render_mode) for _ in range(num_games)]
        self.table = AgentTable.of(self.games[0], env_id, global_state)
        self.per_game = len(self.table.agents)
        self.num_envs = num_games * self.per_game
        self.seed = seed
        self.observation_space = self.table.observation_space
        self.action_space = self.table.action_space
        self._discrete = not self.action_space.shape
        self.agents = np.tile(np.arange(self.per_game), num_games)  # each row's agent index
        self.alive = np.zeros(self.num_envs, dtype=bool)
        self.episode_index = np.zeros(self.num_envs, dtype=np.int64)
        self.episode_return = np.zeros(self.num_envs, dtype=np.float64)
        self.episode_length = np.zeros(self.num_envs, dtype=np.int64)
        self._actions: list[list[Any]] = [[] for _ in range(self.num_envs)]
        self.memory: np.ndarray | None = None
        self.obs = np.zeros((self.num_envs, *self.observation_space.shape), dtype=np.float32)

    def reset(self, cursor: EnvCursor | None = None) -> np.ndarray:
        """Start every game at episode 0, or where `cursor` says it stands."""
        if cursor is not None and len(cursor.episode_index) != self.num_envs:
            raise ValueError(f"cursor holds {len(cursor.episode_index)} rows, not {self.num_envs}")
        for game in range(len(self.games)):
            rows = self._rows(game)
            self.episode_index[rows] = 0 if cursor is None else cursor.episode_index[rows.start]
            self._begin_episode(game)
            if cursor is not None:
                self._replay(game, [cursor.actions_of(row) for row in range(rows.start, rows.stop)])
        return self.obs

    def step(self, actions: np.ndarray) -> VectorStep:
        obs = self.obs.copy()
        rewards = np.zeros(self.num_envs, dtype=np.float32)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        ended = VectorStep(obs, rewards, terminated, truncated, [], [], [], [])
        for game in range(len(self.games)):
            self._step_game(game, actions, ended)
        self.obs = obs
        return ended

    def cursor(self) -> EnvCursor:
        counts = np.array([len(a) for a in self._actions], dtype=np.int64)
        dtype = np.int64 if self._discrete else np.float32
        flat = [a for row_actions in self._actions for a in row_actions]
        actions = np.asarray(flat, dtype=dtype).reshape(-1, *self.action_space.shape)
        return EnvCursor(self.episode_index.copy(), counts, actions)

    def close(self) -> None:
        for game in self.games:
            game.close()

    def _rows(self, game: int) -> range:
        return range(game * self.per_game, (game + 1) * self.per_game)

    def _step_game(self, game: int, actions: np.ndarray, ended: VectorStep) -> None:
        """One joint step of a game: its live agents act; an agent that leaves ends its row's
        episode; when none is left the game starts its next episode (same-step autoreset)."""
        rows, env = self._rows(game), self.games[game]
        joint = {}
        for k, row in enumerate(rows):
            action = int(actions[row]) if self._discrete else np.array(actions[row], dtype=np.float32)
            self._actions[row].append(action)  # every row, live or not: a game's rows replay in step
            if self.alive[row]:
                joint[self.table.agents[k]] = action
        observations, rewards, terminations, truncations, _ = env.step(joint)
        state = self._state(game)
        for k, row in enumerate(rows):
            agent = self.table.agents[k]
            if not self.alive[row]:
                ended.obs[row] = self.table.row(k, None, state)
                continue
            ended.obs[row] = self.table.row(k, observations.get(agent), state)
            ended.rewards[row] = rewards.get(agent, 0.0)
            ended.terminated[row], ended.truncated[row] = terminations.get(agent, False), truncations.get(agent, False)
            self.episode_return[row] += ended.rewards[row]
            self.episode_length[row] += 1
            if ended.terminated[row] or ended.truncated[row] or agent not in env.agents:
                self.alive[row] = False
                ended.done_envs.append(row)
                ended.done_obs.append(ended.obs[row].copy())
                ended.episode_returns.append(float(self.episode_return[row]))
                ended.episode_lengths.append(int(self.episode_length[row]))
                ended.terminated[row] |= not ended.truncated[row]  # gone without a time limit: nothing follows
        if not self.alive[rows.start : rows.stop].any():
            self.episode_index[rows.start : rows.stop] += 1
            self._begin_episode(game)
            ended.obs[rows.start : rows.stop] = self.obs[rows.start : rows.stop]

    def _begin_episode(self, game: int) -> None:
        rows = self._rows(game)
        observations, _ = self.games[game].reset(seed=derive_seed(self.seed, game, int(self.episode_index[rows.start])))
        live, state = set(self.games[game].agents), self._state(game)
        for k, row in enumerate(rows):
            agent = self.table.agents[k]
            self.alive[row] = agent in live
            self.obs[row] = self.table.row(k, observations.get(agent), state)
            self.episode_return[row] = 0.0
            self.episode_length[row] = 0
            self._actions[row] = []

    def _state(self, game: int) -> np.ndarray | None:
        return self.games[game].state() if self.table.state_size else None

    def _replay(self, game: int, actions: list[np.ndarray]) -> None:
        """The game's steps since its episode began, again; none may end it."""
        rows = self._rows(game)
        scratch = VectorStep(self.obs, np.zeros(self.num_envs, np.float32), np.zeros(self.num_envs, bool),
                             np.zeros(self.num_envs, bool), [], [], [], [])
        joint_actions = np.zeros((self.num_envs, *self.action_space.shape), dtype=actions[0].dtype)
        for step in range(len(actions[0])):
            for k, row in enumerate(rows):
                joint_actions[row] = actions[k][step]
            episode = int(self.episode_index[rows.start])
            self._step_game(game, joint_actions, scratch)
            if int(self.episode_index[rows.start]) != episode:
                raise RuntimeError("replaying an env cursor ended a game early: the environment is not "
                                   "deterministic under reset(seed=...)")
        self.obs = scratch.obs
