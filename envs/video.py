"""One greedy episode on film: an env's `rgb_array` frames encoded as MP4 (H.264 in yuv420p,
which browsers and MLflow's artifact view play), by the ffmpeg the imageio-ffmpeg wheel ships."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from gymflow.envs.make import make_env, render_modes

# pygame (the classic-control and Box2D renderers) greets on import and SDL looks for a display
# and a sound server; an rgb_array film needs neither
for _name, _value in (("PYGAME_HIDE_SUPPORT_PROMPT", "1"), ("SDL_VIDEODRIVER", "dummy"), ("SDL_AUDIODRIVER", "dummy")):
    os.environ.setdefault(_name, _value)

MAX_FRAMES = 3_000  # a film stops here (a minute at 50 fps) even if the episode goes on


class Filmed(NamedTuple):
    mp4: bytes
    frames: int  # the first observation's frame and one per step
    episode_return: float
    episode_length: int


class CannotFilm(Exception):
    """The env offers no `rgb_array` rendering, or its renderer is not usable on this machine."""


def film_episode(act: Callable[[np.ndarray], np.ndarray], env_id: str, env_kwargs: dict[str, Any], seed: int,
                 max_frames: int = MAX_FRAMES) -> Filmed:
    """Play one episode from `reset(seed=seed)` with `act` (observation -> action) and film it."""
    if "rgb_array" not in render_modes(env_id):
        raise CannotFilm(f"{env_id} offers no rgb_array rendering")
    try:
        env = make_env(env_id, env_kwargs, render_mode="rgb_array")
        obs, _ = env.reset(seed=seed)
        frames = [env.render()]
    except Exception as error:  # pygame missing, no OpenGL for MuJoCo, ...: the run goes on without a film
        raise CannotFilm(f"{env_id} cannot render here: {type(error).__name__}: {error}") from None
    episode_return, length, done = 0.0, 0, False
    try:
        while not done and len(frames) < max_frames:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            episode_return, length, done = episode_return + float(reward), length + 1, terminated or truncated
            frames.append(env.render())
        fps = int(env.metadata.get("render_fps") or 30)
    finally:
        env.close()
    return Filmed(encode_mp4(frames, fps), len(frames), episode_return, length)


def encode_mp4(frames: list[np.ndarray], fps: int) -> bytes:
    """H.264 MP4 of RGB frames; odd sizes are padded by a pixel (yuv420p needs even ones)."""
    import imageio_ffmpeg

    height, width = frames[0].shape[:2]
    padding = ((0, height % 2), (0, width % 2), (0, 0))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "episode.mp4")
        writer = imageio_ffmpeg.write_frames(path, (width + width % 2, height + height % 2), fps=fps,
                                             codec="libx264", macro_block_size=1, ffmpeg_log_level="error",
                                             output_params=["-preset", "veryfast"])
        writer.send(None)
        for frame in frames:
            writer.send(np.ascontiguousarray(np.pad(frame[..., :3], padding), dtype=np.uint8))
        writer.close()
        with open(path, "rb") as handle:
            return handle.read()
