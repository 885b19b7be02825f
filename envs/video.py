"""One greedy episode on film: an env's `rgb_array` frames encoded as MP4 (H.264 in yuv420p,
which browsers and MLflow's artifact view play), by the ffmpeg the imageio-ffmpeg wheel ships."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from gymflow.envs.agents import SeededAgentVectorEnv
from gymflow.envs.headless import has_display, missing_renderer_hint, offscreen_backend
from gymflow.envs.make import Preprocessing, is_mujoco, make_env, render_modes

# pygame (the classic-control and Box2D renderers) greets on import and SDL looks for a display
# and a sound server; an rgb_array film needs neither
for _name, _value in (("PYGAME_HIDE_SUPPORT_PROMPT", "1"), ("SDL_VIDEODRIVER", "dummy"), ("SDL_AUDIODRIVER", "dummy")):
    os.environ.setdefault(_name, _value)

MAX_FRAMES = 3_000  # a film stops here (two minutes at 25 fps) even if the episode goes on
# A film plays at most this many frames a second: an env that renders faster (CartPole 50,
# MuJoCo's Hopper 125) is filmed every few steps, at the same speed. Each frame is rendered,
# copied and encoded: a 500-step CartPole film took 1.5 s on the 2-core VM, at the end of
# every run (the deciding policy's), with every frame.
MAX_FILM_FPS = 30


class Filmed(NamedTuple):
    mp4: bytes
    frames: int  # the first observation's frame, one every `film_rate` steps and the last
    episode_return: float
    episode_length: int


def film_rate(render_fps: float) -> tuple[int, float]:
    """Every how many steps an env rendering `render_fps` frames a second is filmed, and the
    film's frames a second (the episode plays at its own speed, at most `MAX_FILM_FPS`)."""
    stride = max(1, math.ceil(render_fps / MAX_FILM_FPS))
    return stride, render_fps / stride


class CannotFilm(Exception):
    """The env offers no `rgb_array` rendering, or its renderer is not usable on this machine."""


def film_episode(act: Callable[[np.ndarray], np.ndarray], env_id: str, env_kwargs: dict[str, Any], seed: int,
                 preprocessing: Preprocessing | None = None, max_frames: int = MAX_FRAMES) -> Filmed:
    """Play one episode from `reset(seed=seed)` with `act` (observation -> action) and film it
    (what the env renders, not what the policy observes); ffmpeg encodes each frame while the
    next is played and rendered."""
    if "rgb_array" not in render_modes(env_id):
        raise CannotFilm(f"{env_id} offers no rgb_array rendering")
    try:
        env = make_env(env_id, env_kwargs, render_mode="rgb_array", preprocessing=preprocessing)
        obs, _ = env.reset(seed=seed)
        first = env.render()
    except Exception as error:  # pygame missing, no OpenGL for MuJoCo, ...: the run goes on without a film
        reason = f"{type(error).__name__}: {error}"
        if is_mujoco(env_id) and not has_display() and offscreen_backend() is None:
            reason = missing_renderer_hint()
        raise CannotFilm(f"{env_id} cannot render here: {reason}") from None
    episode_return, length, done = 0.0, 0, False
    try:
        render_fps = int(env.metadata.get("render_fps") or 30) // (4 if preprocessing and preprocessing.atari else 1)
        stride, fps = film_rate(render_fps)
        with Mp4Encoder(first.shape, fps) as film:
            film.add(first)
            while not done and film.frames < max_frames:
                obs, reward, terminated, truncated, _ = env.step(act(obs))
                episode_return, length, done = episode_return + float(reward), length + 1, terminated or truncated
                if done or length % stride == 0:
                    film.add(env.render())
    finally:
        env.close()
    return Filmed(film.mp4, film.frames, episode_return, length)


def film_game(act: Callable[[np.ndarray], np.ndarray], env_id: str, env_kwargs: dict[str, Any], seed: int,
              preprocessing: Preprocessing | None = None, max_frames: int = MAX_FRAMES) -> Filmed:
    """A PettingZoo env's game 0 from `seed` (envs/agents.py), every agent acting through `act`
    (rows -> actions), on film; its return is the mean of the agents' returns."""
    global_state = (preprocessing or Preprocessing()).global_state
    try:
        envs = SeededAgentVectorEnv(env_id, env_kwargs, 1, seed, global_state, render_mode="rgb_array")
        envs.reset()
        first = envs.games[0].render()
    except Exception as error:  # no renderer here: the run goes on without a film
        raise CannotFilm(f"{env_id} cannot render here: {type(error).__name__}: {error}") from None
    returns: list[float] = []
    length = 0
    try:
        stride, fps = film_rate(int(envs.games[0].metadata.get("render_fps") or 30))
        with Mp4Encoder(first.shape, fps) as film:
            film.add(first)
            while len(returns) < envs.num_envs and film.frames < max_frames:
                returns += envs.step(act(envs.obs)).episode_returns
                length += 1
                if returns or length % stride == 0:
                    film.add(envs.games[0].render())
    finally:
        envs.close()
    return Filmed(film.mp4, film.frames, float(np.mean(returns or [np.nan])), length)


class Mp4Encoder:
    """RGB frames of one size fed to an ffmpeg process as they come; the MP4's bytes once the
    `with` block ends. Odd sizes are padded by a pixel (yuv420p needs even ones)."""

    def __init__(self, shape: tuple[int, ...], fps: float):
        height, width = shape[:2]
        self.padding = ((0, height % 2), (0, width % 2), (0, 0))
        self.size = (width + width % 2, height + height % 2)
        self.fps = fps
        self.frames = 0
        self.mp4 = b""

    def __enter__(self) -> Mp4Encoder:
        import imageio_ffmpeg

        self._folder = tempfile.TemporaryDirectory()
        self._path = os.path.join(self._folder.name, "episode.mp4")
        self._writer = imageio_ffmpeg.write_frames(self._path, self.size, fps=self.fps, codec="libx264",
                                                   macro_block_size=1, ffmpeg_log_level="error",
                                                   output_params=["-preset", "veryfast"])
        self._writer.send(None)
        return self

    def add(self, frame: np.ndarray) -> None:
        self._writer.send(np.ascontiguousarray(np.pad(frame[..., :3], self.padding), dtype=np.uint8))
        self.frames += 1

    def __exit__(self, *error: object) -> None:
        try:
            self._writer.close()
            if error[0] is None:
                with open(self._path, "rb") as handle:
                    self.mp4 = handle.read()
        finally:
            self._folder.cleanup()
