"""The ALE's own C++ vector env (`ale_py.vector_env.AtariVectorEnv`: a batch of games stepped by
threads, the preprocessing in C++) behind gymflow's vector env, for the ALE's games under gymflow's
Atari preprocessing (up to 30 no-op starts, 4 frames a step max-pooled, 84x84 grey, the preset's
sticky actions, FIRE at a game's start and after each lost life; for training, a lost life terminal
for learning and rewards clipped to their sign; whole games).

Unlike EnvPool, the ALE's vector env takes a seed for each env it resets, and a game started from a
seed plays the same whatever its env played before, sticky actions included. So episode k of env i
starts from `episode_seed(seed, i, k)`, as on the Gymnasium path (envs/vector.py), and a cursor is
replayed exactly: every env reset from its episode's seed, then the batch stepped as often as the
longest episode's actions, each env joining (reset again) when as many steps are left as it has
actions. SYNC's exact resume holds on it.

What differs from the Gymnasium path: the no-op starts are drawn by the ALE's C++ (the same seed
gives another game than Gymnasium's, and the same game every time); FIRE at a game's start and
after a lost life replaces the env's next two actions (envs/batched.py) where the Gymnasium path
presses it inside the reset or the step that lost the life. The ALE's stacks hold blank frames
before a game's first; they are filled with that frame, as Gymnasium's are."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from gymnasium import spaces

from gymflow.envs.batched import ActionLog, BatchedVectorEnv, PoolReply, in_env_order
from gymflow.envs.make import EnvSpecError, FireToServe, Preprocessing
from gymflow.envs.seeding import derive_seed
from gymflow.envs.steps import EnvCursor

ATARI_FRAMES_PER_EPISODE = 108_000  # the ALE v5 ids' cap, in frames: 27,000 steps of 4
ATARI_KWARGS = {"repeat_action_probability": 0.25, "full_action_space": False}  # Gymnasium's, as it means them
NOOP = 0
SEEDED_EVERY_STEPS = 4096  # an env's next game begins from its seed once it has played this many steps since its last


@dataclass(frozen=True)
class AleGame:
    """A game of the ALE's vector env and the keyword arguments that make it the preset's env."""

    game: str  # the ROM's snake_case name
    options: dict[str, Any]
    lives_matter: bool  # training: a lost life is terminal for learning, the game goes on


def ale_vector_installed() -> bool:
    return importlib.util.find_spec("ale_py.vector_env") is not None


def ale_game(env_id: str, kwargs: dict[str, Any], preprocessing: Preprocessing) -> AleGame:
    """The ALE vector env's game that is `env_id` with `kwargs` under `preprocessing`; an EnvSpecError
    naming env.backend where it has none."""
    if not env_id.startswith("ALE/") or not preprocessing.atari:
        raise EnvSpecError("env.backend", f"ale steps ALE/... ids with env.atari, not {env_id!r}"
                           f"{'' if preprocessing.atari else ' without env.atari'}; allowed: gymnasium, auto")
    unknown = sorted(set(kwargs) - set(ATARI_KWARGS))
    if unknown or preprocessing.hide or not ale_vector_installed():
        why = f"env.kwargs {unknown}" if unknown else "env.hide" if preprocessing.hide else "this ale-py (< 0.10)"
        raise EnvSpecError("env.backend", f"ale's vector env does not take {why}; allowed: gymnasium, auto")
    import ale_py
    import gymnasium

    gymnasium.register_envs(ale_py)
    try:
        game = gymnasium.spec(env_id).kwargs["game"]
    except gymnasium.error.Error:
        raise EnvSpecError("env.id", f"{env_id!r} is not one of the ALE's games") from None
    options = {name: kwargs.get(name, default) for name, default in ATARI_KWARGS.items()}
    options |= {"stack_num": preprocessing.frame_stack, "frameskip": 4, "noop_max": 30, "img_height": 84,
                "img_width": 84, "grayscale": True, "maxpool": True, "use_fire_reset": False, "episodic_life": False,
                "reward_clipping": preprocessing.training, "max_num_frames_per_episode": ATARI_FRAMES_PER_EPISODE,
                "autoreset_mode": "NextStep"}  # an ended game is started again here, from its next seed
    return AleGame(game, options, lives_matter=preprocessing.training)


class AleVectorEnv(BatchedVectorEnv):
    """`num_envs` games stepped by the ALE's vector env, replayable from seeded starts."""

    def __init__(self, game: AleGame, num_envs: int, seed: int, threads: int = 1):
        from ale_py.vector_env import AtariVectorEnv

        self._games = AtariVectorEnv(game.game, num_envs, num_threads=threads, **game.options)
        single = self._games.single_observation_space
        super().__init__(spaces.Box(0, 255, single.shape, np.uint8), spaces.Discrete(self._games.single_action_space.n),
                         num_envs, seed, game.lives_matter, serves=FireToServe.needed_by(game.game))
        self._seeded_episode = np.zeros(num_envs, dtype=np.int64)  # each env's last episode begun from its seed
        self._ages = np.zeros(num_envs, dtype=np.int64)  # the steps each env's game has played in the ALE

    def reset(self, cursor: EnvCursor | None = None) -> np.ndarray:
        """Start every env at episode 0, or where `cursor` says it stands (its actions replayed)."""
        if cursor is not None and len(cursor.episode_index) != self.num_envs:
            raise ValueError(f"cursor holds {len(cursor.episode_index)} envs, not {self.num_envs}")
        self.memory = None if cursor is None else cursor.memory
        self._log = ActionLog(self.num_envs)
        self.obs = np.zeros_like(self.obs)  # not the last step's, which its caller may keep
        everyone = np.arange(self.num_envs)
        self.episode_index[:] = 0 if cursor is None else _seeded_starts(cursor)
        self._begin(everyone, *self._seeded(everyone))
        if cursor is not None:
            self._replay(cursor)
        return self.obs

    def cursor(self) -> EnvCursor:
        earlier = [np.asarray(actions, dtype=np.int64) for actions in self._log.earlier()]
        return replace(super().cursor(), prelude_episodes=self.episode_index - self._seeded_episode,
                       prelude_counts=np.array([len(actions) for actions in earlier], dtype=np.int64),
                       prelude_actions=np.concatenate(earlier))

    def close(self) -> None:
        self._games.close()

    def _step_pool(self, ids: np.ndarray, actions: np.ndarray) -> PoolReply:
        obs, rewards, terminated, truncated, info = self._games.step(actions)
        replied = np.asarray(info["env_id"])
        if not in_env_order(replied, self._every_id):  # as the ALE replies with one thread, and with several here
            order = np.argsort(replied)
            obs, rewards, terminated, truncated = obs[order], rewards[order], terminated[order], truncated[order]
            info = {"lives": np.asarray(info["lives"])[order]}
        self._ages[ids] += 1
        obs = first_frame_repeated(obs, self._ages[ids])
        return PoolReply(obs, rewards, terminated, truncated, self._lives_of(info, ids))

    def _start_episodes(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The next games of envs `ids`: from their seeds where an env has played SEEDED_EVERY_STEPS
        since its last seeded start, else from its RNG (a seeded start reloads the ROM: ~0.1 s)."""
        keep = self._log.steps_kept(ids) < SEEDED_EVERY_STEPS
        if not keep.all():
            self._seeded(ids[~keep])
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[ids[keep]] = True
        obs, info = self._reset_games(mask)  # masked-out envs report where they stand
        return obs[ids], self._lives_of(info, ids), keep

    def _seeded(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The episodes `episode_index` names at envs `ids`, begun from their seeds (the ALE's are int32)."""
        seeds = np.array([derive_seed(self.seed, int(i), int(self.episode_index[i])) % 2**31 for i in ids])
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[ids] = True
        obs, info = self._reset_games(mask, seeds)
        self._seeded_episode[ids] = self.episode_index[ids]
        return obs[ids], self._lives_of(info, ids)

    def _reset_games(self, mask: np.ndarray, seeds: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset the envs `mask` marks (from `seeds`, or their RNG): every env's observation and info, in env order."""
        obs, info = self._games.reset(seed=seeds, options=None if mask.all() else {"reset_mask": mask})
        replied = np.asarray(info["env_id"])
        if not in_env_order(replied, self._every_id):
            order = np.argsort(replied)
            obs, info = obs[order], {"lives": np.asarray(info["lives"])[order]}
        self._ages[mask] = 0
        return first_frame_repeated(obs, self._ages), info

    def _lives_of(self, info: dict[str, Any], ids: np.ndarray) -> np.ndarray | None:
        return np.asarray(info["lives"])[ids] if self.lives_matter or self.serves else None

    def _replay(self, cursor: EnvCursor) -> None:
        """Step the batch as often as the env with the most actions since its seeded start has; each
        env is begun again from its seed when as many steps are left as it took, then fed its actions
        (its earlier games' first); the others stand in with NOOPs."""
        taken = [np.concatenate([cursor.prelude_of(i), cursor.actions_of(i)]) for i in range(self.num_envs)]
        counts = np.array([len(actions) for actions in taken])
        longest = int(counts.max())
        joins, starts = longest - counts, _seeded_starts(cursor)  # the step at which each env begins
        for t in range(longest + 1):
            joining = np.flatnonzero(joins == t) if t else np.empty(0, dtype=np.int64)
            if len(joining):  # a stand-in's NOOPs may have ended games: its episode is its seeded start again
                self.episode_index[joining] = starts[joining]
                self._begin(joining, *self._seeded(joining))
            if t < longest:
                self._step_envs(0, self.num_envs, np.array(
                    [taken[i][t - joins[i]] if joins[i] <= t else NOOP for i in range(self.num_envs)]))
        if not np.array_equal(self.episode_index, cursor.episode_index):
            raise RuntimeError(f"replaying an env cursor ended games elsewhere (at episodes {self.episode_index}, "
                               f"not {cursor.episode_index}): the ALE's vector env did not play them again")


def first_frame_repeated(obs: np.ndarray, ages: np.ndarray) -> np.ndarray:
    """The ALE's frame stacks `obs` as Gymnasium's are: the ALE leaves the slots before a game's first
    frame blank, Gymnasium's FrameStackObservation repeats that frame there (`ages`: each row's steps
    since its game began)."""
    stacked = obs.shape[1]
    for row in np.flatnonzero(ages < stacked - 1):
        blank = stacked - 1 - int(ages[row])
        obs[row, :blank] = obs[row, blank]
    return obs


def _seeded_starts(cursor: EnvCursor) -> np.ndarray:
    """The episode each env of `cursor` last began from its seed."""
    return cursor.episode_index - (0 if cursor.prelude_episodes is None else cursor.prelude_episodes)
