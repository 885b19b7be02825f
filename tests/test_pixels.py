"""Pixels: gymflow's own image env, frame stacks, CNN policies, frame-once shards, and the pixel
path end to end under a real Prefect API and Dask worker processes."""

from __future__ import annotations

import numpy as np
import pytest

from gymflow.agents.rollout import RandomPolicy, collect, evaluate
from gymflow.envs.catch import Catch
from gymflow.envs.make import Preprocessing, make_env
from gymflow.envs.vector import SeededVectorEnv, make_vector_env
from gymflow.flows.improve import improve
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.storage.shards import Collected, read_shard, write_shard
from tests.conftest import local_overrides

CATCH = "gymflow.envs.catch:Catch"


class Tracker:
    """A policy that reads the ball's drift from two stacked Catch frames and goes where it lands."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        actions = []
        for stack in obs:
            (ball_rows, ball_columns), paddle = _ball_and_paddle(stack[-1])
            (before_rows, before_columns), _ = _ball_and_paddle(stack[-2])
            drift = ball_columns - before_columns if before_rows < ball_rows else 0
            column, step = ball_columns, drift or 1
            for _ in range(9 - ball_rows):  # where the ball lands, bouncing off the walls
                if not 0 <= column + step < 5:
                    step = -step
                column += step
            actions.append(1 + int(np.sign(column - paddle)))
        return np.array(actions), np.zeros(len(obs), np.float32)


def _ball_and_paddle(frame: np.ndarray) -> tuple[tuple[int, int], int]:
    cells = frame[::2, ::2] > 0
    paddle = int(np.flatnonzero(cells[-1])[0])
    above = np.argwhere(cells[:-1])
    if len(above):
        return (int(above[0][0]), int(above[0][1])), paddle
    return (9, paddle), paddle


def test_catch_is_lost_by_chance_and_won_by_reading_the_drift_from_two_frames():
    random = evaluate(RandomPolicy(Catch().action_space, seed=0),
                      SeededVectorEnv(CATCH, {}, 200, seed=1, preprocessing=Preprocessing(frame_stack=2)))
    assert -0.8 < random.returns.mean() < -0.4 and set(random.lengths) == {9}
    env = SeededVectorEnv(CATCH, {}, 50, seed=2, preprocessing=Preprocessing(frame_stack=2))
    env.reset()
    assert env.obs.shape == (50, 2, 20, 10) and env.obs.dtype == np.uint8
    assert evaluate(Tracker(), env).returns.mean() == 1.0


@pytest.mark.parametrize(("env_id", "preprocessing", "steps", "backend"), [
    (CATCH, Preprocessing(frame_stack=4), 40, "gymnasium"),  # four episodes a env, each ending inside the rollout
    ("ALE/Breakout-v5", Preprocessing(frame_stack=4, atari=True), 64, "gymnasium"),
    ("ALE/Breakout-v5", Preprocessing(frame_stack=4, atari=True), 400, "ale"),  # games ending: blank frames first
])
def test_a_pixel_shard_stores_each_frame_once_and_reads_back_byte_identical_stacks(env_id, preprocessing, steps,
                                                                                   backend, tmp_path):
    env = make_vector_env(env_id, {}, 3, seed=5, preprocessing=preprocessing, backend=backend)
    env.reset()
    rollout, episodes = collect(RandomPolicy(env.action_space, seed=0), env, steps)
    assert rollout.obs.dtype == np.uint8 and rollout.obs.shape[2] == 4
    storage = Storage(StorageLocation(str(tmp_path)))
    ref = write_shard(storage, "shard.npz", 0, 0, Collected(rollout, episodes, env.cursor(), 0.0))
    back = read_shard(storage, ref)
    for name, value in rollout._asdict().items():
        if value is None:  # a recurrent policy's memory: none here
            assert getattr(back, name) is None, name
            continue
        assert getattr(back, name).dtype == value.dtype, name
        assert getattr(back, name).tobytes() == value.tobytes(), name
    if env_id == CATCH:
        assert len(rollout.done_index) >= 3 * 4
    stacked_bytes = rollout.obs.nbytes + rollout.done_obs.nbytes + rollout.last_obs.nbytes
    assert ref.size < stacked_bytes / 4  # each frame once (a quarter), and compressed on top


def test_image_observations_are_refused_where_they_do_not_fit():
    from gymflow.errors import InvalidPreset

    for overrides, says in (
        ({"agent.algo": "bc"}, "agent.algo: bc reads vector observations"),
        ({"agent.normalize_observations": True}, "agent.normalize_observations: images are scaled"),
        ({"env.id": "CartPole-v1"}, "env.frame_stack: stacks image frames"),
        ({"env.atari": True}, "env.atari: is Atari's preprocessing, for ALE/... ids"),
    ):
        with pytest.raises(InvalidPreset, match=f"^{says}"):
            resolve_experiment("catch-ppo", overrides)
    with pytest.raises(InvalidPreset, match="^agent.replay: image observations are replayed from a memory of frames"):
        resolve_experiment("catch-dqn", {"agent.replay": "prioritized"})


def test_the_cnn_reads_uint8_stacks_and_the_atari_preset_uses_the_nature_network():
    from gymflow.agents.networks import PixelEncoder
    from gymflow.agents.replay import FrameReplayMemory
    from gymflow.tasks.training.learning import create_learner

    catch = create_learner(resolve_experiment("catch-dqn"))
    assert isinstance(catch.q_network[0], PixelEncoder)
    assert isinstance(catch.replay, FrameReplayMemory) and catch.replay.frames.dtype == np.uint8
    breakout = resolve_experiment("breakout-ppo")
    network = create_learner(breakout).network
    assert breakout.observation_space.shape == (4, 84, 84)
    encoder, hidden = network.obs_norm
    assert encoder.features == 3136  # 64 x 7 x 7: Mnih et al. 2015
    # as SB3's CnnPolicy and CleanRL: the heads share the CNN and its 512 layer, each then one linear layer
    assert [layer.weight.shape for layer in (*hidden[::2], *network.actor, *network.critic)] == [
        (512, 3136), (4, 512), (1, 512)]
    assert network.actor[0].weight.abs().max() < 0.05  # orthogonal, gain 0.01: a near-uniform first policy


@pytest.mark.e2e
@pytest.mark.parametrize(("preset", "mode"), [
    ("catch-ppo", "sync"),
    # long tier (25 s): ASYNC DQN learns Catch from a picture in tests/test_dict_observations.py
    pytest.param("catch-dqn", "async", marks=pytest.mark.slow),
])
def test_the_pixel_path_reaches_catchs_target_under_prefect_and_dask(preset, mode, prefect_api, workspace):
    overrides = {"distribution.mode": mode, **local_overrides(workspace)}
    state = improve(preset, overrides, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.solved and summary.final_return >= 0.9, summary
    assert len(summary.rollout_processes) == 2


def _catch_rollouts(count: int, steps: int, stack: int = 4, envs: int = 3):
    env = SeededVectorEnv(CATCH, {}, envs, seed=9, preprocessing=Preprocessing(frame_stack=stack))
    env.reset()
    policy = RandomPolicy(env.action_space, seed=1)
    return [collect(policy, env, steps)[0] for _ in range(count)]


def _frame_spec(capacity: int, n_step: int = 1, frame: tuple[int, int] = (20, 10)):
    from gymflow.agents.replay import MemorySpec

    return MemorySpec(capacity, (4, *frame), np.uint8, (), np.int64, gamma=0.9, n_step=n_step)


def test_the_frame_memory_samples_the_stacks_a_memory_of_whole_stacks_holds():
    from gymflow.agents.replay import FrameReplayMemory, ReplayMemory

    rollouts = _catch_rollouts(count=4, steps=20)  # 240 transitions, episodes ending inside every rollout
    spec = _frame_spec(1000, n_step=3)
    frames, whole = FrameReplayMemory(spec), ReplayMemory(spec)
    for rollout in rollouts:
        frames.add(rollout)
        whole.add(rollout)
    mine, theirs = frames.sample(64, np.random.default_rng(4)), whole.sample(64, np.random.default_rng(4))
    assert (mine.index == theirs.index).all()
    for name in ("obs", "actions", "rewards", "next_obs", "discounts"):
        assert getattr(mine.transitions, name).tobytes() == getattr(theirs.transitions, name).tobytes(), name
    assert frames.frames_written < 240 * 1.3  # about one frame a transition, not eight


def test_a_full_frame_memory_overwrites_the_oldest_and_never_samples_a_stale_stack():
    from gymflow.agents.replay import FrameReplayMemory, ReplayMemory

    spec = _frame_spec(100, n_step=1)
    frames, whole = FrameReplayMemory(spec), ReplayMemory(spec)
    for rollout in _catch_rollouts(count=5, steps=10):  # 150 transitions into 100 slots; 9-step episodes
        frames.add(rollout)
        whole.add(rollout)
    fresh = frames.oldest_frame >= frames.frames_written - len(frames.frames)
    assert 0 < fresh.sum() < 100  # short episodes: more than one frame a transition, the oldest went stale
    index = np.flatnonzero(fresh)
    assert frames._at(index).obs.tobytes() == whole._at(index).obs.tobytes()
    assert frames._at(index).next_obs.tobytes() == whole._at(index).next_obs.tobytes()
    assert fresh[frames.sample(500, np.random.default_rng(0)).index].all()


def test_replay_of_atari_frames_needs_under_7_5_kb_a_transition():
    from gymflow.agents.replay import FrameReplayMemory, ReplayMemory

    atari = FrameReplayMemory(_frame_spec(10_000, frame=(84, 84)))
    assert atari.bytes_per_transition() < 7.5 * 1024
    assert ReplayMemory(_frame_spec(10, frame=(84, 84))).bytes_per_transition() > 56_000


def test_a_resumed_pixel_dqn_run_rebuilds_its_frame_replay_from_shards_and_ends_byte_identical(prefect_api, tmp_path):
    from gymflow.tasks.training.learning import create_learner
    from gymflow.tasks.training.resume import restore
    from gymflow.tasks.training.run import PreparedRun
    from tests.in_process import prepared, train_in_process

    # a memory smaller than the run, so the rebuild reads only the newest shards, and a ring
    # that goes stale at its oldest end (9-step episodes, 16-step rollouts)
    dqn = {"distribution.rollout_workers": 2, "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 16,
           "schedule.total_env_steps": 2560, "schedule.heatup_env_steps": 128, "schedule.evaluate_every_env_steps": 512,
           "schedule.evaluation_episodes": 4, "schedule.target_return": None, "agent.replay_capacity": 600,
           "agent.train_steps_per_iteration": 8, "tracking.video": "off"}
    clean = prepared(tmp_path / "clean", "catch-dqn", dqn)
    clean_state, _, _ = train_in_process(clean)
    died = prepared(tmp_path / "died", "catch-dqn", dqn)
    train_in_process(died, steps=12)
    learner = create_learner(died.experiment)
    restored = restore(died.storage, died.run_id, learner, died.preset)
    assert restored.state.env_steps > 600  # more than the memory holds
    state, _, _ = train_in_process(PreparedRun(died.experiment, died.run_id, died.storage, learner, restored))
    assert state == clean_state
    mine, theirs = learner.replay, clean.learner.replay
    assert mine.position() == theirs.position()
    fresh = np.flatnonzero(theirs.oldest_frame[: theirs.size] >= theirs.frames_written - len(theirs.frames))
    assert mine._at(fresh).obs.tobytes() == theirs._at(fresh).obs.tobytes()
    for name, tensor in learner.state_dict()["q_network"].items():
        assert tensor.equal(clean.learner.state_dict()["q_network"][name]), name


def test_a_lost_life_is_terminal_for_learning_while_the_game_and_its_cursor_go_on():
    atari = Preprocessing(frame_stack=4, atari=True)
    env = SeededVectorEnv("ALE/Breakout-v5", {"repeat_action_probability": 0.0}, 2, seed=3, preprocessing=atari)
    env.reset()
    rollout, episodes = collect(RandomPolicy(env.action_space, seed=0), env, 300)
    lives_lost = rollout.terminated.sum() - len(rollout.done_index)
    assert lives_lost >= 4 and len(episodes.returns) >= 1  # games of 5 lives ended; lives were lost inside them
    assert set(np.unique(rollout.rewards)) <= {0.0, 1.0}  # clipped for training
    rebuilt = SeededVectorEnv("ALE/Breakout-v5", {"repeat_action_probability": 0.0}, 2, seed=3, preprocessing=atari)
    rebuilt.reset(env.cursor())  # a game replayed from its seed, across its lost lives
    assert rebuilt.obs.tobytes() == env.obs.tobytes()
    assert (rebuilt.episode_return == env.episode_return).all()


@pytest.mark.parametrize("training", [True, False])
def test_breakout_serves_the_ball_at_each_start_and_lost_life_so_standing_still_ends_the_game(training):
    atari = Preprocessing(frame_stack=4, atari=True, training=training)
    env = make_env("ALE/Breakout-v5", {"repeat_action_probability": 0.0}, preprocessing=atari)
    env.reset(seed=1)
    steps, terminated, truncated = 0, False, False
    while not (terminated or truncated) and steps < 2_000:
        *_, terminated, truncated, _ = env.step(0)  # NOOP: without FIRE the ball never comes
        steps += 1
    assert terminated and steps < 1_000 and env.unwrapped.ale.lives() == 0


def test_an_atari_game_started_from_a_seed_plays_the_same_whatever_the_env_played_before():
    def play(env, seed: int) -> list[bytes]:
        obs, _ = env.reset(seed=seed)
        frames, actions = [obs.tobytes()], np.random.default_rng(seed)
        for _ in range(300):
            obs, _, terminated, truncated, _ = env.step(int(actions.integers(4)))
            frames.append(obs.tobytes())
            if terminated or truncated:
                break
        return frames

    atari = Preprocessing(frame_stack=4, atari=True)
    played, fresh = (make_env("ALE/Breakout-v5", {"repeat_action_probability": 0.0}, preprocessing=atari)
                     for _ in range(2))
    play(played, 11), play(played, 12)  # the ROM is not reloaded between games: nothing may carry over
    assert play(played, 7) == play(fresh, 7)
    assert play(played, 8)[:40] != play(fresh, 9)[:40]  # the seed draws the no-op starts
