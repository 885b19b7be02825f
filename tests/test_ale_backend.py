"""The ALE's C++ vector env behind gymflow's vector env (envs/ale_backend.py): the same game as the
Gymnasium path over episodes, gymflow's episode semantics (same-step autoreset, a lost life terminal
for learning), each episode from its seed, and a cursor replayed exactly — so a SYNC run on it
resumes to an uninterrupted run's weights."""

from __future__ import annotations

import numpy as np
import pytest

from gymflow.envs import ale_backend
from gymflow.envs.ale_backend import AleVectorEnv, ale_game
from gymflow.envs.make import Preprocessing
from gymflow.presets.load import load_preset
from gymflow.presets.validate import rollout_backend

ATARI = Preprocessing(frame_stack=4, atari=True)
BREAKOUT = "ALE/Breakout-v5"


def _random_steps(env, steps: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [env.step(rng.integers(0, 4, size=env.num_envs)) for _ in range(steps)]


def test_a_game_begins_from_its_seed_once_its_env_has_played_long_enough_since_the_last(monkeypatch):
    """Seeded starts reload the ROM (~0.1 s): an env's next game begins from its own seed only after
    SEEDED_EVERY_STEPS since its last (the games between from the env's RNG); a seeded game begins
    as that env's game of the same index does in a fresh vector env."""
    monkeypatch.setattr(ale_backend, "SEEDED_EVERY_STEPS", 400)
    game = ale_game(BREAKOUT, {"repeat_action_probability": 0.25}, ATARI)
    env = AleVectorEnv(game, 2, seed=7)
    env.reset()
    firsts, unseeded = {}, 0  # (env, game index): the game's first frame; games begun from the env's RNG
    rng = np.random.default_rng(0)
    for _ in range(1500):
        step = env.step(rng.integers(0, 4, size=2))
        firsts |= {(i, int(env.episode_index[i])): step.obs[i].copy() for i in step.done_envs}
        unseeded += sum(int(env.cursor().prelude_episodes[i] > 0) for i in step.done_envs)
    cursor = env.cursor()
    seeded_at = cursor.episode_index - cursor.prelude_episodes
    assert seeded_at.any() and unseeded  # games after the first begun from seeds, and from the RNG
    fresh = AleVectorEnv(game, 2, seed=7)
    fresh.reset()
    for i in np.flatnonzero(seeded_at):
        fresh.episode_index[i] = seeded_at[i]
        assert np.array_equal(fresh._seeded(np.array([i]))[0][0], firsts[(i, int(seeded_at[i]))])
        assert int(cursor.prelude_counts[i]) + int(cursor.action_counts[i]) < 400 + 1500


@pytest.mark.parametrize("seeded_every", [4096, 120])
def test_an_env_cursor_is_replayed_exactly_whatever_each_env_has_played(seeded_every, monkeypatch):
    """From a cursor taken mid-game (envs at different episodes and step counts, sticky actions,
    lost lives, games begun from seeds and from the env's RNG), a rebuilt env continues step for
    step as the uninterrupted one, and the same cursor rebuilds the same envs again."""
    monkeypatch.setattr(ale_backend, "SEEDED_EVERY_STEPS", seeded_every)
    game = ale_game(BREAKOUT, {"repeat_action_probability": 0.25}, ATARI)
    env = AleVectorEnv(game, 3, seed=5)
    env.reset()
    _random_steps(env, 500, seed=0)
    cursor = env.cursor()
    assert cursor.episode_index.any() and len(set(cursor.action_counts.tolist())) == 3
    uninterrupted = _random_steps(env, 300, seed=1)
    for _ in range(2):
        rebuilt = AleVectorEnv(game, 3, seed=5)
        rebuilt.reset(cursor)
        assert np.array_equal(rebuilt.cursor().actions, cursor.actions)
        again = _random_steps(rebuilt, 300, seed=1)
        for t, (one, other) in enumerate(zip(uninterrupted, again, strict=True)):
            assert np.array_equal(one.obs, other.obs) and np.array_equal(one.rewards, other.rewards), t
            assert np.array_equal(one.terminated, other.terminated) and one.done_envs == other.done_envs, t
            assert one.episode_returns == other.episode_returns, t
        rebuilt.close()
    assert sum(len(step.done_envs) for step in uninterrupted) >= 2  # games ended (and began) after the cursor
    env.close()


def test_a_worker_s_envs_on_two_threads_play_the_games_they_play_on_one():
    game = ale_game(BREAKOUT, {"repeat_action_probability": 0.25}, ATARI)
    played = []
    for threads in (1, 2):
        env = AleVectorEnv(game, 4, seed=2, threads=threads)
        env.reset()
        played.append(_random_steps(env, 300, seed=4))
        env.close()
    for t, (one, two) in enumerate(zip(*played, strict=True)):
        assert np.array_equal(one.obs, two.obs) and one.done_envs == two.done_envs, t


def test_sync_and_single_atari_runs_step_on_the_ales_vector_env_by_default():
    assert rollout_backend(load_preset("breakout-ppo")) == "ale"
    assert rollout_backend(load_preset("breakout-dqn", {"distribution.mode": "single"})) == "ale"
    assert rollout_backend(load_preset("breakout-ppo", {"distribution.inference": "learner"})) == "gymnasium"
    assert rollout_backend(load_preset("breakout-ppo", {"env.backend": "gymnasium"})) == "gymnasium"
    assert rollout_backend(load_preset("cartpole-ppo")) == "gymnasium"
