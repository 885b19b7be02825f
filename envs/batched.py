"""What gymflow's C++ backends (envs/envpool_backend.py, envs/ale_backend.py) share below their
pools: the seeded vector env's interface (envs/vector.py) over a pool that steps a batch of envs
in one call — same-step autoreset, episode returns and lengths, a lost life terminal for learning
while the game goes on, FIRE served at a game's start and after a lost life in the games that wait
for it (as the Gymnasium path's FireToServe, envs/make.py), and the actions each env took since its episode began
(the cursor a shard keeps). A backend says how its pool steps envs and how it starts their episodes.

A C++ pool cannot step one env alone between two batch steps, so where FireToServe presses FIRE
and action 2 inside the reset and the step that lost a life, here they replace that env's next two
actions, at a game's start and after each lost life (the pools' own FIRE at reset is one frame,
which sticky actions lose about half the time on EnvPool): the policy's actions are logged (a cursor
replays them, and the replacement with them), the presses are what the game is sent. Either way a
policy is never the one to serve the ball, and the presses are no steps of the policy's: a rollout
records them as the actions sent and not as samples (`replaced_actions`, agents/rollout.py), and an
episode's length leaves them out, as the Gymnasium path's does."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gymnasium import spaces

from gymflow.envs.make import FireToServe
from gymflow.envs.steps import EnvCursor, VectorStep, observation_dtype


class PoolReply(NamedTuple):
    """A pool's reply to a step of some envs, in their order."""

    obs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    lives: np.ndarray | None  # Atari in training, or serving FIRE: each env's lives left (None: lives do not matter)


def in_env_order(replied: np.ndarray, ids: np.ndarray) -> bool:
    """Whether a pool's replies (their env ids) came in the order of `ids` (int32), compared as
    bytes: once a step, cheaper than an elementwise comparison and its reduction."""
    return replied.astype(np.int32, copy=False).tobytes() == ids.tobytes()


class BatchedVectorEnv:
    """The bookkeeping of `num_envs` envs a pool steps; a backend supplies `_step_pool` and
    `_start_episodes` (and makes its pool in `reset`)."""

    def __init__(self, observation_space: spaces.Box, action_space: spaces.Space, num_envs: int, seed: int,
                 lives_matter: bool, serves: bool = False):
        self.observation_space, self.action_space = observation_space, action_space
        self.num_envs, self.seed, self.lives_matter, self.serves = num_envs, seed, lives_matter, serves
        self._presses_left = np.zeros(num_envs, dtype=np.int8)  # FIRE's presses still due at each env (2, 1, 0)
        self._discrete = not action_space.shape
        self._every_id = np.arange(num_envs, dtype=np.int32)
        self.episode_index = np.zeros(num_envs, dtype=np.int64)
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        # the steps since each env's episode began that were not its policy's: it stood out, or was sent FIRE's presses
        self._skipped = np.zeros(num_envs, dtype=np.int64)
        self._log = ActionLog(num_envs)
        self._lives = np.zeros(num_envs, dtype=np.int64)
        self.memory: np.ndarray | None = None  # a recurrent policy's memory of these envs, carried between rounds
        self.obs = np.zeros((num_envs, *observation_space.shape), dtype=observation_dtype(observation_space))
        self.agents: np.ndarray | None = None  # one env, one agent
        self.alive: np.ndarray | None = None

    def _step_pool(self, ids: np.ndarray, actions: np.ndarray) -> PoolReply:
        raise NotImplementedError

    def _start_episodes(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Begin the episodes `episode_index` names at envs `ids`: their first observations, lives, and
        which of them keep their earlier episodes' actions for a replay (None: none)."""
        raise NotImplementedError

    def step(self, actions: np.ndarray) -> VectorStep:
        return self._step_envs(0, self.num_envs, actions)

    def replaced_actions(self) -> np.ndarray:
        """[N] the action each env is sent at its next step in place of its policy's (FIRE's
        presses), -1 where it is sent the policy's."""
        due = self._presses_left
        return np.where(due == 2, FireToServe.FIRE, np.where(due == 1, FireToServe.AFTER_FIRE, -1))

    def cursor(self) -> EnvCursor:
        dtype = np.int64 if self._discrete else np.float32
        shape = self.action_space.shape
        taken = [np.asarray(actions, dtype=dtype).reshape(-1, *shape) for actions in self._log.current()]
        counts = np.array([len(actions) for actions in taken], dtype=np.int64)
        return EnvCursor(self.episode_index.copy(), counts, np.concatenate(taken), self.memory)

    def _sent(self, actions: np.ndarray) -> np.ndarray:
        return np.array(actions, dtype=np.int32 if self._discrete else np.float64)

    def _step_envs(self, first: int, stop: int, actions: np.ndarray) -> VectorStep:
        """Step envs `first` to `stop` (the others stand); a finished episode's env begins its next.
        Once a step for every env: each numpy call here costs a few per cent of a MuJoCo batch's step."""
        whole = stop - first == self.num_envs
        ids = self._every_id if whole else np.arange(first, stop, dtype=np.int32)
        sent = self._sent(actions)
        reply = self._step_pool(ids, self._serving(first, stop, sent))
        self._log.add(first, sent)
        if whole:
            np.add(self.episode_return, reply.rewards, out=self.episode_return)
        else:
            self.episode_return[first:stop] += reply.rewards
            self._skipped[:first] += 1
            self._skipped[stop:] += 1
        ended = reply.terminated | reply.truncated
        learning_end = reply.terminated.astype(bool, copy=False)
        if reply.lives is not None:
            learning_end = self._lives_lost(first, stop, reply.lives, ended, learning_end)
        # the step's own arrays (a pool's replies are fresh each step), as envs/vector.py's: a caller may keep them
        obs = reply.obs if reply.obs.dtype == self.obs.dtype else reply.obs.astype(self.obs.dtype)
        if whole:
            self.obs = obs
        else:
            self.obs = self.obs.copy()
            self.obs[first:stop] = obs
        rewards = reply.rewards.astype(np.float32, copy=False)
        truncated = reply.truncated.astype(bool, copy=False)
        if not ended.any():
            return VectorStep(obs, rewards, learning_end, truncated, [], [], [], [])
        done = ids[ended]
        step = VectorStep(obs, rewards, learning_end, truncated, done.tolist(), list(obs[ended]),
                          self.episode_return[done].tolist(), self._episode_lengths(done).tolist())
        self.episode_index[done] += 1
        self._begin(done, *self._start_episodes(done))
        step.obs[ended] = self.obs[done]
        return step

    def _episode_lengths(self, ids: np.ndarray) -> np.ndarray:
        """The steps envs `ids` have taken in their episodes: the steps logged since each began, less
        those it stood out or was sent FIRE's presses (a count kept where some envs step alone or are
        served, not a sum added to every step)."""
        return self._log.steps_since_began(ids) - self._skipped[ids]

    def _lives_lost(self, first: int, stop: int, lives: np.ndarray, ended: np.ndarray, learning_end: np.ndarray
                    ) -> np.ndarray:
        """Note envs `first` to `stop`'s `lives` left: where a game goes on with a life fewer, FIRE is
        due, and (lives mattering) the step ends learning; returns the steps' ends for learning."""
        lost = (lives < self._lives[first:stop]) & ~ended
        if self.lives_matter:
            learning_end = learning_end | lost
        if self.serves:
            self._presses_left[first:stop][lost] = 2
        self._lives[first:stop] = lives
        return learning_end

    def _serving(self, first: int, stop: int, sent: np.ndarray) -> np.ndarray:
        """What envs `first` to `stop` are sent: `sent`, but FIRE, then action 2, at an env whose
        game has just begun or lost a life (FireToServe's presses, one a step)."""
        if not self.serves:
            return sent
        due = self._presses_left[first:stop]
        if not due.any():
            return sent
        pressed, pressing = sent.copy(), due > 0
        pressed[due == 2], pressed[due == 1] = FireToServe.FIRE, FireToServe.AFTER_FIRE
        self._skipped[first:stop][pressing] += 1
        due[pressing] -= 1
        return pressed

    def _begin(self, ids: np.ndarray, obs: np.ndarray, lives: np.ndarray | None,
               keep_earlier: np.ndarray | None = None) -> None:
        """Episodes begun at envs `ids`, with first observations `obs` and `lives` left; the envs
        `keep_earlier` marks keep their earlier episodes' actions."""
        self.obs[ids] = obs
        self._presses_left[ids] = 2 if self.serves else 0  # the game's start served as a lost life's
        if lives is not None:
            self._lives[ids] = lives
        self.episode_return[ids], self._skipped[ids] = 0.0, 0
        self._log.began(ids, keep_earlier)


class ActionLog:
    """The actions each env took since its episode began (and, where a backend keeps them, since an
    earlier episode's start), logged one array a step (not one append an env a step); the cursor
    gathers each env's once a rollout."""

    def __init__(self, num_envs: int):
        self._steps: list[tuple[int, np.ndarray]] = []  # (first row, the actions of the rows from it)
        self._base = 0  # the step number of _steps[0]
        self._began = np.zeros(num_envs, dtype=np.int64)  # the step number each env's episode began at
        self._kept = np.zeros(num_envs, dtype=np.int64)  # the step number each env's actions are kept from
        self._num_envs = num_envs
        self._last_partial = -1  # the step number of the newest step that stepped some envs only
        self._stacked: np.ndarray | None = None  # the first len(_stacked) steps' actions stacked, where none is partial

    def add(self, first_row: int, actions: np.ndarray) -> None:
        if first_row != 0 or len(actions) != self._num_envs:
            self._last_partial = self._base + len(self._steps)
        self._steps.append((first_row, actions))

    def began(self, ids: np.ndarray, keep_earlier: np.ndarray | None = None) -> None:
        """Episodes begun at `ids`, their earlier actions kept where `keep_earlier` says; the steps no
        env keeps any more are let go."""
        now = self._base + len(self._steps)
        self._began[ids] = now
        self._kept[ids if keep_earlier is None else ids[~keep_earlier]] = now
        unheld = int(self._kept.min()) - self._base
        if unheld >= 256:
            del self._steps[:unheld]
            self._base += unheld
            if self._stacked is not None:
                self._stacked = self._stacked[unheld:] if len(self._stacked) > unheld else None

    def current(self) -> list[np.ndarray | list[np.ndarray]]:
        """Each env's actions since its episode began."""
        return self._each(self._began, np.full_like(self._began, self._base + len(self._steps)))

    def earlier(self) -> list[np.ndarray | list[np.ndarray]]:
        """Each env's actions kept of the episodes before its current one."""
        return self._each(self._kept, self._began)

    def steps_since_began(self, ids: np.ndarray) -> np.ndarray:
        """The steps logged since each env's episode began."""
        return self._base + len(self._steps) - self._began[ids]

    def steps_kept(self, ids: np.ndarray) -> np.ndarray:
        """The steps logged since each env's actions are kept from: its own, where every step steps every env."""
        return self._base + len(self._steps) - self._kept[ids]

    def _each(self, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray | list[np.ndarray]]:
        """Each env's actions logged from step `starts[env]` to `stops[env]`."""
        steps = self._steps
        spans = [(env, start - self._base, stop - self._base) for env, (start, stop) in enumerate(zip(starts, stops))]
        if steps and self._last_partial < self._base:  # each step held stepped every env
            stacked = self._every_step_stacked()
            return [stacked[start:stop, env] for env, start, stop in spans]
        return [[actions[env - first] for first, actions in steps[start:stop] if first <= env < first + len(actions)]
                for env, start, stop in spans]

    def _every_step_stacked(self) -> np.ndarray:
        """The logged steps' actions [steps, envs, ...] (none partial); the steps logged since the last
        call stacked and joined on (a cursor a rollout: not the episode's thousand steps stacked anew)."""
        done = 0 if self._stacked is None else len(self._stacked)
        if done < len(self._steps):
            new = np.stack([actions for _, actions in self._steps[done:]])
            self._stacked = new if self._stacked is None else np.concatenate([self._stacked, new])
        return self._stacked
