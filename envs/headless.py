"""Rendering without a display. MuJoCo draws through OpenGL, and its default (GLFW) needs a
window system: on a headless machine a film fails with "an OpenGL platform library has not been
loaded", after a GLFWError warning. Off-screen rendering needs EGL or OSMesa instead. Gymnasium
reads MUJOCO_GL when a film's first OpenGL context is made, and PyOpenGL fixes its platform at
its first import then, so the choice is made before the process's first MuJoCo env
(`envs.make.prepare_mujoco`), and costs nothing in a process that makes none."""

from __future__ import annotations

import ctypes.util
import os

# MUJOCO_GL's off-screen backends, best first, each with the library it loads and Debian's package for it
OFFSCREEN_BACKENDS = (("egl", "EGL", "libegl1"), ("osmesa", "OSMesa", "libosmesa6"))


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def offscreen_backend() -> str | None:
    """The first off-screen backend whose library this machine has, or None."""
    for backend, library, _ in OFFSCREEN_BACKENDS:
        if ctypes.util.find_library(library):
            return backend
    return None


def choose_mujoco_backend() -> str | None:
    """Without a display, and unless the user chose one (MUJOCO_GL), render MuJoCo off-screen with
    EGL, else OSMesa. Returns the backend now in force (None: MuJoCo's own default)."""
    if not os.environ.get("MUJOCO_GL") and not has_display():
        backend = offscreen_backend()
        if backend is not None:
            os.environ["MUJOCO_GL"] = backend
    return os.environ.get("MUJOCO_GL")


def missing_renderer_hint() -> str:
    """What to install where MuJoCo has no way to render off-screen."""
    packages = " or ".join(package for _, _, package in OFFSCREEN_BACKENDS)
    return f"no display and no off-screen OpenGL library: install Debian's {packages} (or set MUJOCO_GL)"
