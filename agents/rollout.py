"""Collection and evaluation: plain functions of a policy and a vector env; and the random
policy heatup collects with.

The same code collects in SYNC rollouts, heatup, evaluation and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gymflow.agents.batches import Episodes, Rollout
from gymflow.agents.core import ActsFromOutputs, OutputsSource, Policy, VectorEnv


def collect(policy: Policy, env: VectorEnv, steps: int, explore: bool = True,
            learning: np.ndarray | None = None) -> tuple[Rollout, Episodes]:
    """Step every env `steps` times from where it stands; returns the batch and the episodes
    that ended during it. A multi-agent env's rows outside `learning` (a [N] mask: an opponent's)
    act but are no samples: not alive in the batch, their episodes not counted; so are the steps a
    C++ backend sent FIRE's presses instead of the policy's action (the presses recorded as sent)."""
    recording = _Recording(env, steps, learning)
    recurrent = hasattr(policy, "episodes_ended")  # a policy with a memory of each env's episode: the envs keep
    if recurrent:  # it between rollouts, as they keep their cursor
        policy.memory = env.memory
        recording.memory = policy.memory.copy() if policy.memory is not None else None
    for t in range(steps):
        obs = recording.observe(t)
        actions, log_probs = policy.act(obs, explore)
        if recurrent and recording.memory is None:
            recording.memory = np.zeros_like(policy.memory)  # it began with nothing remembered
        step = recording.step(t, actions, log_probs)
        if recurrent:
            policy.episodes_ended(step.done_envs)
    if recurrent:
        env.memory = policy.memory
    return recording.finish()


def collect_together(policies: Sequence[Policy], envs: Sequence[VectorEnv], steps: int, explore: bool = True
                     ) -> list[tuple[Rollout, Episodes]]:
    """`collect` of each policy on its envs, stepped in lockstep: where the policies act from one
    network's outputs (`ActsFromOutputs`, one policy version), those are computed once a step for
    every env's rows. Returns what `collect` of each in turn returns: a batched forward whose rows
    differ in their bits from the separate ones (another machine's kernels) is found on the first
    step and not used. Recurrent policies and multi-agent envs are collected one after another."""
    network = _one_network(policies)
    if network is None or any(getattr(env, "agents", None) is not None for env in envs):
        return [collect(policy, env, steps, explore) for policy, env in zip(policies, envs, strict=True)]
    recordings = [_Recording(env, steps) for env in envs]
    shared, splits = policies[0], np.cumsum([env.num_envs for env in envs])[:-1]
    alike_key = (tuple(tuple(p.shape) for p in network.parameters()), tuple(env.num_envs for env in envs))
    for t in range(steps):
        obs = [recording.observe(t) for recording in recordings]
        if _ROWS_ALIKE.get(alike_key) is False:
            outputs = [policy.outputs(rows) for policy, rows in zip(policies, obs)]
        else:
            outputs = np.split(shared.outputs(np.concatenate(obs)), splits)
            if alike_key not in _ROWS_ALIKE:
                outputs = _checked(outputs, [shared.outputs(rows) for rows in obs], alike_key)
        for policy, recording, rows, out in zip(policies, recordings, obs, outputs):
            recording.step(t, *policy.act_on(rows, out, explore))
    return [recording.finish() for recording in recordings]


def collect_in_halves(policy: ActsFromOutputs, env: VectorEnv, steps: int, source: OutputsSource,
                      explore: bool = True) -> tuple[Rollout, Episodes]:
    """`collect`, the network's outputs computed elsewhere (`source`: batched inference on a GPU)
    while the envs step: the rows in two halves, one half steps while the other's outputs are on
    their way. The rollout is `collect`'s wherever the outputs' bits are the policy's own forward's:
    each step's actions are drawn for the first half, then the second, which draws the numbers
    one draw for every row draws."""
    recording, n = _Recording(env, steps), env.num_envs
    halves = [slice(0, n // 2), slice(n // 2, n)] if n > 1 else [slice(0, n)]
    recording.observe(0)
    for half in halves:
        source.request(recording.obs[0, half])
    for t in range(steps):
        for half in halves:
            rows = recording.obs[t, half]
            recording.step_rows(t, half, *policy.act_on(rows, source.receive(), explore))
            if t + 1 < steps:
                source.request(recording.observe_rows(t + 1, half))
    return recording.finish()


# (network's parameter shapes, rows of each batch) -> whether one forward of all the rows gives
# each batch's rows the bits its own forward gives: a CPU's matrix kernels may be chosen by the
# number of rows. Which kernel runs depends on the shapes, not on the values: one check a shape.
_ROWS_ALIKE: dict[tuple, bool] = {}


def acts_from_outputs(policy: Policy) -> bool:
    """Whether the policy's actions are a choice from its network's outputs alone (`ActsFromOutputs`,
    not a recurrent policy with a memory of its own)."""
    return hasattr(policy, "act_on") and not hasattr(policy, "episodes_ended")


def _one_network(policies: Sequence[Policy]) -> Any:
    """The network every policy acts from, if they all act from its outputs."""
    if len(policies) < 2 or not all(acts_from_outputs(policy) for policy in policies):
        return None
    network = policies[0].network
    return network if all(policy.network is network for policy in policies) else None


def _checked(together: list[np.ndarray], apart: list[np.ndarray], key: tuple) -> list[np.ndarray]:
    """The outputs computed apart where those computed together differ from them in a bit."""
    _ROWS_ALIKE[key] = all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(together, apart))
    return together if _ROWS_ALIKE[key] else apart


class _Recording:
    """One env batch's rollout as it is collected: observed, acted on, stepped, step by step."""

    def __init__(self, env: VectorEnv, steps: int, learning: np.ndarray | None = None):
        n = env.num_envs
        self.env, self.learning, self.n = env, learning, n
        self.obs = np.empty((steps, n, *env.obs.shape[1:]), dtype=env.obs.dtype)
        self.actions = np.empty((steps, n, *env.action_space.shape), dtype=_action_dtype(env.action_space))
        self.log_probs = np.empty((steps, n), dtype=np.float32)
        self.rewards = np.empty((steps, n), dtype=np.float32)
        self.terminated = np.empty((steps, n), dtype=bool)
        self.truncated = np.empty((steps, n), dtype=bool)
        self.done_index: list[int] = []  # of the steps that ended an env's episode
        self.done_obs: list[np.ndarray] = []
        self.returns: list[float] = []
        self.lengths: list[int] = []
        self.agents = getattr(env, "agents", None)  # a multi-agent env's rows (envs/agents.py): which were in
        # their game; or the rows whose action a C++ backend replaced (envs/batched.py: FIRE's presses)
        self._replaced = np.full(n, -1, np.int64) if getattr(env, "serves", False) and self.agents is None else None
        self.alive = None if self.agents is None and self._replaced is None else np.empty((steps, n), dtype=bool)
        self.low, self.high = _action_bounds(env.action_space)
        self.memory: np.ndarray | None = None  # a recurrent policy's, as the rollout began

    def observe(self, t: int) -> np.ndarray:
        """Step t's observations (a view of the rollout's)."""
        self.obs[t] = self.env.obs
        if self._replaced is not None:
            self._replaced[:] = self.env.replaced_actions()
            np.less(self._replaced, 0, out=self.alive[t])
        elif self.alive is not None:
            self.alive[t] = self.env.alive if self.learning is None else self.env.alive & self.learning
        return self.obs[t]

    def observe_rows(self, t: int, rows: slice) -> np.ndarray:
        """Step t's observations of `rows` (single-agent envs)."""
        self.obs[t, rows] = self.env.obs[rows]
        if self._replaced is not None:
            self._replaced[rows] = self.env.replaced_actions()[rows]
            np.less(self._replaced[rows], 0, out=self.alive[t, rows])
        return self.obs[t, rows]

    def step(self, t: int, actions: np.ndarray, log_probs: np.ndarray) -> Any:
        """Step the envs with step t's actions (clipped to a Box's bounds); returns the step."""
        self.actions[t], self.log_probs[t] = actions, log_probs
        env_actions = self.actions[t] if self.low is None else _clip(self.actions[t], self.low, self.high)
        return self._record(t, t, self.env.step(env_actions))

    def step_rows(self, t: int, rows: slice, actions: np.ndarray, log_probs: np.ndarray) -> Any:
        """`step` of the envs of `rows` alone (single-agent envs)."""
        self.actions[t, rows], self.log_probs[t, rows] = actions, log_probs
        env_actions = self.actions[t, rows] if self.low is None else _clip(self.actions[t, rows], self.low, self.high)
        return self._record(t, (t, rows), self.env.step_rows(rows, env_actions))

    def _record(self, t: int, at: int | tuple[int, slice], step: Any) -> Any:
        """Keep step t's outcome at `at` (t, or t and the rows stepped); where the env sent some rows
        an action of its own, that action, the rows no samples of the policy (not alive)."""
        self.rewards[at], self.terminated[at], self.truncated[at] = step.rewards, step.terminated, step.truncated
        if self._replaced is not None and not self.alive[at].all():
            first = (at[1].start or 0) if isinstance(at, tuple) else 0
            replaced = first + np.flatnonzero(~self.alive[at])
            self.actions[t, replaced] = self._replaced[replaced]
        if step.done_envs:
            self.done_index += [t * self.n + i for i in step.done_envs]
            self.done_obs += step.done_obs
            self.returns += step.episode_returns
            self.lengths += step.episode_lengths
        return step

    def finish(self) -> tuple[Rollout, Episodes]:
        env, n = self.env, self.n
        rollout = Rollout(
            obs=self.obs, actions=self.actions, rewards=self.rewards, terminated=self.terminated,
            truncated=self.truncated, done_index=np.asarray(self.done_index, dtype=np.int64),
            done_obs=np.asarray(self.done_obs, dtype=env.obs.dtype).reshape(-1, *self.obs.shape[2:]),
            last_obs=env.obs.copy(), log_probs=self.log_probs, memory=self.memory,
            agents=None if self.agents is None else self.agents.copy(), alive=self.alive,
        )
        counted = slice(None) if self.learning is None else self.learning[rollout.done_index % n]  # not an
        returns = np.asarray(self.returns, np.float64)[counted]  # opponent's episodes
        return rollout, Episodes(returns, np.asarray(self.lengths, np.int64)[counted])


def evaluate(policy: Policy, env: VectorEnv) -> Episodes:
    """Run the first episode of every env to its end, acting greedily; one return per env."""
    n = env.num_envs
    returns = np.full(n, np.nan)
    lengths = np.zeros(n, dtype=np.int64)
    low, high = _action_bounds(env.action_space)
    while np.isnan(returns).any():
        actions, _ = policy.act(env.obs, explore=False)
        step = env.step(actions if low is None else np.clip(actions, low, high))
        if hasattr(policy, "episodes_ended"):
            policy.episodes_ended(step.done_envs)
        for i, episode_return, length in zip(step.done_envs, step.episode_returns, step.episode_lengths):
            if np.isnan(returns[i]):
                returns[i], lengths[i] = episode_return, length
    return Episodes(returns, lengths)


def _clip(actions: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """`np.clip`'s values (NaN kept) by its two ufuncs, without its wrapper's cost, once an env step."""
    return np.minimum(np.maximum(actions, low), high)


def _action_dtype(space) -> type:
    return np.int64 if not space.shape else np.float32


def _action_bounds(space) -> tuple[np.ndarray | None, np.ndarray | None]:
    if not space.shape:
        return None, None
    return space.low, space.high


class RandomPolicy:
    """Uniform random actions, for heatup."""

    def __init__(self, action_space: Any, seed: int):
        self.action_space = action_space
        self.rng = np.random.default_rng(seed)
        self._box = _finite_box(action_space)
        self._no_log_probs: np.ndarray | None = None

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        n = len(obs)
        space = self.action_space
        if self._box is not None:  # Generator.uniform's numbers (low + range * a double), without its broadcasting
            low, width = self._box
            actions = self.rng.random((n, *space.shape))
            actions *= width
            actions += low
            actions = actions.astype(np.float32)
        elif hasattr(space, "n"):
            actions = self.rng.integers(0, space.n, size=n)
        else:  # an unbounded Box: Generator.uniform's own error
            actions = self.rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(np.float32)
        if self._no_log_probs is None or len(self._no_log_probs) != n:  # one read-only array of zeros a batch size
            self._no_log_probs = np.zeros(n, dtype=np.float32)
            self._no_log_probs.flags.writeable = False
        return actions, self._no_log_probs


def _finite_box(space: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A bounded Box's low and width in float64, as Generator.uniform takes them; None for other spaces."""
    if hasattr(space, "n") or not hasattr(space, "low"):
        return None
    low = np.asarray(space.low, dtype=np.float64)
    width = np.asarray(space.high, dtype=np.float64) - low
    return (low, width) if np.isfinite(width).all() else None
