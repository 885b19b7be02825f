"""The ALE's C++ vector env behind gymflow's vector env (envs/ale_backend.py): the same game as the
Gymnasium path over episodes, gymflow's episode semantics (same-step autoreset, a lost life terminal
for learning), each episode from its seed, and a cursor replayed exactly — so a SYNC run on it
resumes to an uninterrupted run's weights."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from gymflow.envs import ale_backend
from gymflow.envs.ale_backend import AleVectorEnv, ale_game
from gymflow.envs.make import Preprocessing
from gymflow.envs.vector import SeededVectorEnv, make_vector_env
from gymflow.errors import InvalidPreset
from gymflow.flows.improve import improve
from gymflow.presets.load import load_preset
from gymflow.presets.validate import experiment_from, rollout_backend
from tests.conftest import local_overrides

ATARI = Preprocessing(frame_stack=4, atari=True)
BREAKOUT = "ALE/Breakout-v5"


def _random_steps(env, steps: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [env.step(rng.integers(0, 4, size=env.num_envs)) for _ in range(steps)]


def test_an_ale_game_plays_as_on_gymnasium_over_episodes():
    """Breakout under gymflow's Atari preprocessing: the same spaces and score scale, a random
    policy's whole games alike on both (the ALE's C++ draws its no-op starts apart)."""
    ale = make_vector_env(BREAKOUT, {"repeat_action_probability": 0.25}, 4, 0, ATARI.evaluation(), "ale")
    python = SeededVectorEnv(BREAKOUT, {"repeat_action_probability": 0.25}, 4, 0, ATARI.evaluation())
    assert ale.observation_space == python.observation_space and ale.action_space == python.action_space
    returns = {}
    for name, env in (("ale", ale), ("gymnasium", python)):
        env.reset()
        rng, played = np.random.default_rng(1), []
        while len(played) < 12:
            played += env.step(rng.integers(0, 4, size=4)).episode_returns
        returns[name] = np.mean(played)
        env.close()
    assert 0.5 < returns["ale"] < 3.5 and 0.5 < returns["gymnasium"] < 3.5, returns  # random play: ~1.5
    assert abs(returns["ale"] - returns["gymnasium"]) < 1.0, returns


def test_a_game_ends_on_its_step_starting_the_next_from_its_seed_and_a_lost_life_ends_it_for_learning():
    env = AleVectorEnv(ale_game(BREAKOUT, {"repeat_action_probability": 0.0}, ATARI), 2, seed=3)
    env.reset()
    lives_lost, ended = 0, None
    for _ in range(2000):
        step = env.step(np.ones(2, dtype=np.int64))  # FIRE and nothing else: the ball served and lost, life by life
        lives_lost += int(step.terminated.sum()) - len(step.done_envs)
        if step.done_envs:
            ended = step
            break
    assert ended is not None and lives_lost >= 4  # every life but the last ended learning, not the game
    i = ended.done_envs[0]
    assert not np.array_equal(ended.done_obs[0], ended.obs[i])  # the game's last frame apart; obs: a new game
    cursor = env.cursor()
    assert cursor.episode_index[i] == 1 and cursor.action_counts[i] == 0
    env.close()


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


@pytest.mark.parametrize(("preset", "overrides", "says"), [
    ("cartpole-ppo", {"env.backend": "ale"}, "env.backend: ale steps ALE/... ids with env.atari, not 'CartPole-v1'"),
    ("breakout-ppo", {"env.backend": "ale", "env.kwargs": {"repeat_action_probability": 0.0, "mode": 0}},
     "env.backend: ale's vector env does not take env.kwargs ['mode']"),
    ("breakout-ppo", {"env.backend": "ale", "distribution.inference": "learner"},
     "env.backend: ale steps a worker's whole batch a call"),
    ("cartpole-ppo", {"distribution.env_threads": 2}, "distribution.env_threads: 2 threads step a C++ backend's envs, "
                                                      "and this run's step on gymnasium; allowed: 1"),
    ("breakout-ppo", {"distribution.env_threads": 8}, "distribution.env_threads: 8 threads for 4 envs a worker; "
                                                      "allowed: 1 to distribution.envs_per_worker"),
])
def test_the_ale_backend_and_env_threads_are_refused_in_one_line_where_they_would_not_hold(preset, overrides, says):
    with pytest.raises(InvalidPreset) as refused:
        experiment_from(load_preset(preset, overrides))
    assert str(refused.value).startswith(says), refused.value
    assert "\n" not in str(refused.value)


# a SYNC Breakout PPO run on a tiny budget: 2 workers x 2 envs x 32 steps a round, one evaluation at the end
TINY_BREAKOUT = {"distribution.rollout_workers": 2, "distribution.envs_per_worker": 2, "schedule.rollout_steps_per_env": 32,
                 "schedule.total_env_steps": 1024, "schedule.evaluate_every_env_steps": 100_000,
                 "schedule.evaluation_episodes": 1, "agent.hidden_sizes": [32], "agent.minibatch_size": 64,
                 "agent.epochs": 1, "schedule.target_return": None}


@pytest.mark.e2e
@pytest.mark.slow  # long tier: the C++ backends' end-to-end run in the default tier is tests/test_env_backends.py's
def test_a_sync_breakout_ppo_run_collects_on_the_ales_vector_env_end_to_end(prefect_api, workspace):
    summary = improve("breakout-ppo", {**TINY_BREAKOUT, **local_overrides(workspace)})
    assert summary.env_steps == 1024
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.tags["gymflow.env_backend"] == "ale"
    assert run.info.status == "FINISHED" and "eval/return_mean" in run.data.metrics
    (film,) = client.list_artifacts(summary.mlflow_run_id, "videos")  # evaluation: on Gymnasium
    assert film.path.endswith(".mp4") and film.file_size > 1000
