"""Seeded vector envs: episodes continue exactly from a cursor, on any worker."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from gymflow.agents.rollout import RandomPolicy, collect
from gymflow.envs.vector import SeededVectorEnv


def _advance(env: SeededVectorEnv, steps: int, seed: int):
    return collect(RandomPolicy(env.action_space, seed), env, steps)


def test_rebuilding_from_a_cursor_continues_exactly_where_the_live_envs_are():
    live = SeededVectorEnv("CartPole-v1", {}, num_envs=3, seed=7)
    live.reset()
    _advance(live, 40, seed=1)
    rebuilt = SeededVectorEnv("CartPole-v1", {}, num_envs=3, seed=7)
    rebuilt.reset(live.cursor())
    np.testing.assert_array_equal(rebuilt.obs, live.obs)
    np.testing.assert_array_equal(rebuilt.episode_length, live.episode_length)
    next_live, _ = _advance(live, 60, seed=2)
    next_rebuilt, _ = _advance(rebuilt, 60, seed=2)
    for a, b in zip(next_live, next_rebuilt):
        np.testing.assert_array_equal(a, b)


def test_episodes_run_past_round_boundaries_and_autoreset_in_the_same_step():
    env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 6, "max_steps": 30}, num_envs=2, seed=0)
    env.reset()
    rollout, episodes = _advance(env, 50, seed=0)
    assert len(episodes.returns) == len(rollout.done_index) > 0
    for flat in rollout.done_index:
        t, i = divmod(int(flat), 2)
        assert rollout.terminated[t, i] or rollout.truncated[t, i]
        if t + 1 < 50:  # the next observation starts a new episode: step counter back to zero
            assert rollout.obs[t + 1, i, 1] == 0.0
    # a final observation differs from the reset observation that replaced it
    assert rollout.done_obs[:, 1].min() > 0


def test_next_obs_uses_the_final_observation_where_an_episode_ended():
    env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 4, "max_steps": 5}, num_envs=2, seed=3)
    env.reset()
    rollout, _ = _advance(env, 20, seed=3)
    next_obs = rollout.next_obs().reshape(-1, 2)
    np.testing.assert_array_equal(next_obs[rollout.done_index], rollout.done_obs)
    not_done = np.setdiff1d(np.arange(40 - 2), rollout.done_index)
    np.testing.assert_array_equal(next_obs[not_done], rollout.obs.reshape(-1, 2)[not_done + 2])


def test_a_film_holds_the_first_frame_and_one_per_step_and_plays_back_at_its_size(tmp_path):
    import imageio_ffmpeg

    from gymflow.envs.video import film_episode

    filmed = film_episode(lambda obs: 1, "gymflow.testing.envs:Corridor", {"length": 8}, seed=3)
    assert filmed.episode_return > 0 and filmed.frames == filmed.episode_length + 1  # walked right to the end
    path = tmp_path / "episode.mp4"
    path.write_bytes(filmed.mp4)
    assert imageio_ffmpeg.count_frames_and_secs(str(path))[0] == filmed.frames
    assert next(imageio_ffmpeg.read_frames(str(path)))["size"] == (128, 16)


def test_an_env_rendering_faster_than_a_film_plays_is_filmed_every_few_steps_at_its_own_speed(tmp_path):
    """CartPole renders 50 frames a second: filmed every second step, at 25 frames a second, its
    first and last frames included, the film lasts as long as the episode."""
    import imageio_ffmpeg

    from gymflow.envs.video import MAX_FILM_FPS, film_episode, film_rate

    assert film_rate(8) == (1, 8) and film_rate(50) == (2, 25) and film_rate(125) == (5, 25)
    assert all(film_rate(fps)[1] <= MAX_FILM_FPS for fps in range(1, 300))
    filmed = film_episode(lambda obs: int(obs[2] + 0.5 * obs[3] > 0), "CartPole-v1", {}, seed=0, max_frames=100)
    assert filmed.frames == 100 and filmed.episode_length == 198  # the first frame, then every second step
    balanced = film_episode(lambda obs: int(obs[2] + 0.5 * obs[3] > 0), "CartPole-v1", {"max_episode_steps": 41}, seed=0)
    assert balanced.episode_length == 41 and balanced.frames == 1 + 20 + 1  # 41 steps: the last is filmed too
    path = tmp_path / "episode.mp4"
    path.write_bytes(balanced.mp4)
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(path))
    assert frames == balanced.frames and seconds == pytest.approx(balanced.frames / 25, abs=0.05)


def test_an_env_that_cannot_render_is_not_filmed_and_says_why():
    from gymflow.envs.video import CannotFilm, film_episode

    with pytest.raises(CannotFilm, match="offers no rgb_array rendering"):
        film_episode(lambda obs: 1, "gymflow.testing.envs:Tripwire", {"at_step": 1, "once_file": "x"}, seed=0)


def test_mujoco_films_on_a_machine_without_a_display_and_says_nothing_of_glfw(tmp_path):
    """A fresh process with no DISPLAY and no MUJOCO_GL, as a headless server or CI runs a
    MuJoCo preset: gymflow picks an off-screen backend and the film plays."""
    pytest.importorskip("mujoco")
    import os
    import subprocess
    import sys

    import imageio_ffmpeg

    script = (
        "import numpy as np, os\n"
        "from gymflow.envs.video import film_episode\n"
        "filmed = film_episode(lambda obs: np.zeros(3, np.float32), 'Hopper-v5', {}, seed=0, max_frames=20)\n"
        f"open({str(tmp_path / 'hopper.mp4')!r}, 'wb').write(filmed.mp4)\n"
        "print(os.environ['MUJOCO_GL'])\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MUJOCO_GL",
                                                                     "PYOPENGL_PLATFORM")}
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["egl"] or done.stdout.split() == ["osmesa"]
    assert "glfw" not in (done.stdout + done.stderr).lower()
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(tmp_path / "hopper.mp4"))
    assert frames == 20


def test_without_an_off_screen_library_a_mujoco_film_names_the_debian_package(monkeypatch):
    """The library missing cannot be made for real on a machine that has it: find_library is told
    it finds nothing, and MuJoCo is asked for GLFW as on a headless machine without EGL or OSMesa."""
    pytest.importorskip("mujoco")
    import ctypes.util

    from gymflow.envs import headless
    from gymflow.envs.video import CannotFilm, film_episode

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MUJOCO_GL", "not-a-backend")
    assert headless.offscreen_backend() is None
    with pytest.raises(CannotFilm, match=r"Hopper-v5 cannot render here: .*install Debian's libegl1 or libosmesa6"):
        film_episode(lambda obs: obs[:3], "Hopper-v5", {}, seed=0)


def test_hidden_entries_leave_the_rest_of_each_observation_as_the_env_made_it():
    from gymflow.envs.make import Preprocessing

    full = SeededVectorEnv("CartPole-v1", {}, num_envs=2, seed=3)
    partial = SeededVectorEnv("CartPole-v1", {}, num_envs=2, seed=3, preprocessing=Preprocessing(hide=(1, 3)))
    full.reset()
    partial.reset()
    assert partial.observation_space.shape == (2,)
    np.testing.assert_array_equal(partial.observation_space.high, full.observation_space.high[[0, 2]])
    full_rollout, _ = _advance(full, 80, seed=4)  # episodes end and reset in it
    partial_rollout, _ = _advance(partial, 80, seed=4)
    np.testing.assert_array_equal(partial_rollout.obs, full_rollout.obs[:, :, [0, 2]])
    np.testing.assert_array_equal(partial_rollout.done_obs, full_rollout.done_obs[:, [0, 2]])
    np.testing.assert_array_equal(partial_rollout.rewards, full_rollout.rewards)


@pytest.mark.parametrize(("env_id", "hide", "says"), [
    ("CartPole-v1", [4], "env.hide: [4] for an observation of 4 entries; allowed: distinct indices 0..3"),
    ("CartPole-v1", [0, 1, 2, 3], "leaving at least one"),
    ("gymflow.envs.catch:Catch", [0], "env.hide: hides entries of a vector observation; the env observes Box"),
])
def test_hiding_what_an_env_does_not_have_is_refused_in_one_line(env_id, hide, says):
    from gymflow.errors import InvalidPreset
    from gymflow.presets.validate import resolve_experiment

    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("cartpole-ppo" if env_id == "CartPole-v1" else "catch-ppo", {"env.id": env_id,
                                                                                         "env.hide": hide})
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("space", [spaces.Box(-1, 1, (6,), np.float32),
                                   spaces.Box(np.array([-2, 0, -0.4], np.float32), np.array([2, 1, 3.5], np.float32)),
                                   spaces.Box(-np.inf, np.inf, (2,), np.float32), spaces.Discrete(4)])
def test_random_actions_are_those_generator_uniform_and_integers_draw(space):
    """Heatup's random policy draws Generator.uniform's numbers for a bounded Box (its own arithmetic,
    without uniform's broadcasting), integers' for Discrete; an unbounded Box is refused as uniform refuses it."""
    policy, rng = RandomPolicy(space, seed=7), np.random.default_rng(7)
    for n in (8, 1, 3):
        if isinstance(space, spaces.Box) and not np.isfinite(space.high).all():
            with pytest.raises(OverflowError):
                policy.act(np.zeros(n), explore=True)
            return
        for _ in range(200):
            actions, log_probs = policy.act(np.zeros(n), explore=True)
            expected = rng.integers(0, space.n, size=n) if isinstance(space, spaces.Discrete) else \
                rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(np.float32)
            assert actions.dtype == expected.dtype and actions.tobytes() == expected.tobytes()
            assert log_probs.shape == (n,) and not log_probs.any()
