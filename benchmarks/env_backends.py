"""Env steps per second on one core: the C++ backends' envs stepping alone (EnvPool's; for Breakout
the ALE's vector env's too), gymflow's collection on them, and gymflow's collection on the Gymnasium
(Python) path, for Breakout and HalfCheetah.

    .venv/bin/python benchmarks/env_backends.py                  # 8 envs, 3 rounds of 6 s a side
    .venv/bin/python benchmarks/env_backends.py --envs 16 --seconds 10 --rounds 5

Each side runs in this process, pinned to one core (the first this process may use), with one
C++ thread: what one rollout worker process gets.
- **envpool alone**, **ale alone**: `envpool.make(...).step`, `AtariVectorEnv(...).step` with
  uniformly random actions, nothing else.
- **gymflow on envpool**, **gymflow on ale**: the rollout job a Dask worker runs
  (tasks/cluster/jobs.py's `run_rollout`: heatup's random policy, the envs live between jobs, each
  job's shard written to a local folder) with `env.backend: envpool` (async runs' default) or
  `ale` (sync and single Atari runs' default).
- **gymflow on gymnasium**: the same job on the Python path (`env.backend: gymnasium`).

Breakout: ALE/Breakout-v5 under gymflow's Atari preprocessing (noop 30, frame skip 4 with
max-pool, 84x84 grey, 4 stacked, sticky actions 0.25, life loss signalled); HalfCheetah-v5 as
Gymnasium defines it. The sides alternate round by round (this VM's speed drifts by tens of
percent within minutes); each figure is the median over rounds, each ratio the median of the
rounds' own ratios. The last line:

    collection on the fast backend / its stepping alone: R (Breakout), R (HalfCheetah)

(EnvPool's figures; the ALE vector env's Breakout ratio is on the line before.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

BACKENDS = {"Breakout": ("envpool", "ale"), "HalfCheetah": ("envpool",)}  # the C++ backends that have the task
TASKS = {  # name: (Gymnasium id, kwargs, Atari's preprocessing, steps a job takes per env)
    "Breakout": ("ALE/Breakout-v5", {"repeat_action_probability": 0.25}, True, 128),
    "HalfCheetah": ("HalfCheetah-v5", {}, False, 256),
}


def _preprocessing(name: str):
    from gymflow.envs.make import Preprocessing

    return Preprocessing(frame_stack=4, atari=True) if TASKS[name][2] else Preprocessing()


def backend_alone(name: str, backend: str, envs: int, seconds: float) -> float:
    """A C++ backend's envs stepping alone with random actions: env steps per second."""
    env_id, kwargs, _, _ = TASKS[name]
    if backend == "envpool":
        import envpool

        from gymflow.envs.envpool_backend import pool_task

        task = pool_task(env_id, kwargs, _preprocessing(name))
        made = envpool.make(task.task_id, env_type="gymnasium", num_envs=envs, seed=0, num_threads=1, **task.options)
        made.reset()
        space = made.action_space
    else:
        from ale_py.vector_env import AtariVectorEnv

        from gymflow.envs.ale_backend import ale_game

        game = ale_game(env_id, kwargs, _preprocessing(name))
        made = AtariVectorEnv(game.game, envs, num_threads=1, **game.options)
        made.reset(seed=0)
        space = made.single_action_space
    rng = np.random.default_rng(0)
    random_actions = (lambda: rng.integers(0, space.n, envs, dtype=np.int32)) if not space.shape else \
        (lambda: rng.uniform(space.low, space.high, (envs, *space.shape)))
    steps, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        made.step(random_actions())
        steps += envs
    made.close()
    return steps / seconds


def gymflow_collection(name: str, backend: str, envs: int, seconds: float, folder: str,
                       threads: int = 1) -> Callable[[], float]:
    """A function that runs rollout jobs for `seconds` and returns their env steps per second; the
    envs stay live between its calls, as on a worker."""
    from gymflow.presets.load import load_preset
    from gymflow.tasks.cluster.jobs import run_rollout
    from gymflow.tasks.cluster.messages import RolloutSpec
    from gymflow.tasks.storage.objects import StorageLocation

    env_id, kwargs, atari, steps = TASKS[name]
    preset = load_preset("breakout-appo" if atari else "halfcheetah-sac")
    spec = RolloutSpec(StorageLocation(os.path.join(folder, backend)), f"{name.lower()}-{backend}", env_id, kwargs,
                       _preprocessing(name), preset.agent, policy_version=None, worker=0, num_envs=envs, steps_per_env=steps, env_seed=0, policy_seed=0,
                       exploration=1.0, resume_from=None, backend=backend, env_threads=threads)
    state = {"chunk": 0, "cursor": None}

    def collect_for_a_while() -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            job = replace(spec, chunk=state["chunk"], resume_from=state["cursor"], policy_seed=state["chunk"])
            state["cursor"], state["chunk"] = run_rollout(job).key, state["chunk"] + 1
            done += envs * steps
        return done / (time.perf_counter() - started)

    return collect_for_a_while


def _paired(sides: list[float], against: list[float]) -> float:
    """The median of each round's ratio: the sides ran seconds apart, so the VM's drift cancels."""
    return statistics.median(side / other for side, other in zip(sides, against, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = parser.parse_args()
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    print(f"one core (cpu {core}), {args.envs} envs, {args.rounds} rounds of {args.seconds:g} s a side, "
          f"{os.cpu_count()} cores here")
    ratios = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.tasks:
            figures = _measure(name, BACKENDS[name], args, folder)
            for fast in BACKENDS[name]:
                ratios[(name, fast)] = _paired(figures[f"gymflow on {fast}"], figures[f"{fast} alone"])
                print(f"{name:12s} gymflow on {fast} / {fast} alone: {ratios[(name, fast)]:.2f}; "
                      f"/ gymflow on gymnasium: {_paired(figures[f'gymflow on {fast}'], figures['gymflow on gymnasium']):.2f}")
    print("collection on the fast backend / its stepping alone: "
          + ", ".join(f"{ratios[(name, 'envpool')]:.2f} ({name})" for name in args.tasks))


def _measure(name: str, backends: tuple[str, ...], args: argparse.Namespace, folder: str) -> dict[str, list[float]]:
    """Each side's env steps per second, round by round, the sides alternating; printed as medians."""
    sides: dict[str, Callable[[], float]] = {}
    for backend in backends:
        sides[f"{backend} alone"] = lambda backend=backend: backend_alone(name, backend, args.envs, args.seconds)
        sides[f"gymflow on {backend}"] = gymflow_collection(name, backend, args.envs, args.seconds, folder)
    sides["gymflow on gymnasium"] = gymflow_collection(name, "gymnasium", args.envs, args.seconds, folder)
    for side in sides.values():
        side()  # warm: imports, the envs made, the first shard's files
    figures: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, measure in sides.items():
            figures[side].append(measure())
    for side, values in figures.items():
        print(f"{name:12s} {side:22s} {statistics.median(values):10,.0f} env steps/s  (rounds: "
              f"{', '.join(f'{v:,.0f}' for v in values)})")
    return figures


if __name__ == "__main__":
    main()
