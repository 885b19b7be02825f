"""The learner's own work on the CPU against a CUDA device, preset by preset, the two alternating.

    .venv/bin/python benchmarks/learner_device.py --rounds 3
    .venv/bin/python benchmarks/learner_device.py --presets hopper-td3 breakout-ppo --cpu-threads 2 16

What a run's learner does between rounds, on random data of each preset's env shapes (no env is
made, so neither MuJoCo nor the ALE is needed): an off-policy preset's gradient steps (ms a step,
sampling from a replay memory of 20,000 random transitions: `train`), an on-policy preset's
whole update on one round of its rollouts (`learn`: rollout_workers x envs_per_worker x
rollout_steps_per_env steps, its epochs and minibatches; a recurrent preset's over whole env
sequences, from a random memory where they began). Each side builds its learner with
`distribution.learner_device` cpu or cuda, as a run would; the CPU side runs with each of
`--cpu-threads` torch threads (the preset's `learner_threads` by default). Rounds alternate which
side goes first. Prints each figure, then per preset the medians and the ratio CPU / CUDA (how
many times faster the device is). Without a CUDA device only the CPU side runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gymnasium import spaces

from gymflow.agents.algorithms import algorithm_of
from gymflow.presets.load import load_preset
from gymflow.testing.rollouts import random_rollout

# each preset's env's observation and action spaces, written out so that no env need be made
SPACES: dict[str, tuple[spaces.Space, spaces.Space]] = {
    "hopper-td3": (spaces.Box(-np.inf, np.inf, (11,), np.float32), spaces.Box(-1, 1, (3,), np.float32)),
    "halfcheetah-sac": (spaces.Box(-np.inf, np.inf, (17,), np.float32), spaces.Box(-1, 1, (6,), np.float32)),
    "hopper-ppo": (spaces.Box(-np.inf, np.inf, (11,), np.float32), spaces.Box(-1, 1, (3,), np.float32)),
    "breakout-ppo": (spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(4)),
    "breakout-dqn": (spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(4)),
    "breakout-appo": (spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(4)),
    "catch-ppo": (spaces.Box(0, 255, (2, 20, 10), np.uint8), spaces.Discrete(3)),
    "catch-appo": (spaces.Box(0, 255, (2, 20, 10), np.uint8), spaces.Discrete(3)),
    "hopper-iql": (spaces.Box(-np.inf, np.inf, (11,), np.float32), spaces.Box(-1, 1, (3,), np.float32)),
    # Pendulum's cos and sin of the angle, its velocity hidden; an LSTM policy
    "pendulum-po-ppo": (spaces.Box(-1, 1, (2,), np.float32), spaces.Box(-2, 2, (1,), np.float32)),
}
REPLAY_FILL = 20_000


def timed_work(preset: str, device: str, threads: int, overrides: dict | None = None
               ) -> tuple[str, Callable[[], float]]:
    """The preset's learner on `device`, ready, and a function that does one measured piece of its
    work and returns its milliseconds (a gradient step's, or an on-policy update's)."""
    config = load_preset(preset, overrides)
    observation_space, action_space = SPACES[preset]
    algorithm = algorithm_of(config.agent)
    torch.set_num_threads(threads)
    learner = algorithm.learner(config.agent, observation_space, action_space, 0, device)
    rng = np.random.default_rng(0)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if algorithm.on_policy:
        distribution = config.distribution
        envs = distribution.rollout_workers * distribution.envs_per_worker
        rollout = random_rollout(observation_space, action_space, config.schedule.rollout_steps_per_env, envs, rng)
        if getattr(config.agent, "recurrent", None):  # the memory (h, c) the rollout began with
            rollout = rollout._replace(memory=rng.standard_normal((2, envs, config.agent.recurrent), dtype=np.float32))
        learner.learn([rollout], 0.0)  # warm-up: allocations, kernels chosen

        def one_update() -> float:
            started = time.perf_counter()
            learner.learn([rollout], 0.0)
            synchronize()
            return (time.perf_counter() - started) * 1e3
        return "ms an update", one_update
    learner.insert([random_rollout(observation_space, action_space, REPLAY_FILL // 4, 4, rng)])
    learner.train(20, 0.0)
    steps = 100

    def gradient_steps() -> float:
        started = time.perf_counter()
        learner.train(steps, 0.0)
        synchronize()
        return (time.perf_counter() - started) * 1e3 / steps
    return "ms a gradient step", gradient_steps


def compare(preset: str, rounds: int, cpu_threads: list[int], cuda_sides: dict[str, dict], overrides: dict | None = None
            ) -> tuple[str, dict[str, float]]:
    """What is timed, and the median milliseconds of each side over `rounds` alternating rounds
    (`cuda_sides`: each CUDA side's name and the overrides it adds)."""
    sides = {f"cpu x{threads}": timed_work(preset, "cpu", threads, overrides) for threads in cpu_threads}
    for name, own in cuda_sides.items():
        sides[name] = timed_work(preset, "cuda", 1, {**(overrides or {}), **own})
    unit = next(iter(sides.values()))[0]
    figures: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(rounds):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for name in order:
            torch.set_num_threads(int(name.split("x")[1]) if name.startswith("cpu") else 1)
            figures[name].append(sides[name][1]())
        print(f"{preset} round {round_index}: " + ", ".join(f"{n} {figures[n][-1]:.2f}" for n in order)
              + f" ({unit})", flush=True)
    return unit, {name: statistics.median(values) for name, values in figures.items()}


def profile(preset: str, overrides: dict | None, side: str) -> None:
    """One CUDA update under torch's profiler: the wall-clock, the GPU's kernel time within it, and
    the operators that take the most of the CPU's time (launch overhead shows there)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _, one_update = timed_work(preset, "cuda", 1, overrides)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        wall_ms = one_update()
    events = profiled.key_averages()
    kernel_ms = sum(event.self_device_time_total for event in events) / 1e3
    print(f"{preset} ({side}) profiled update: {wall_ms:.1f} ms wall, {kernel_ms:.1f} ms of GPU kernels "
          f"({kernel_ms / wall_ms:.0%} busy)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(SPACES), choices=list(SPACES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-threads", nargs="+", type=int, default=None,
                        help="torch threads on the CPU side (default: each preset's learner_threads)")
    parser.add_argument("--round", nargs=2, type=int, default=None, metavar=("WORKERS", "ENVS"),
                        help="an on-policy update's round: rollout workers x envs per worker (default: the preset's)")
    parser.add_argument("--profile", action="store_true", help="also profile one CUDA update: where its time goes")
    parser.add_argument("--cuda-only", action="store_true", help="no CPU side (a big round takes minutes there)")
    parser.add_argument("--cuda-eager", action="store_true",
                        help="also the CUDA side with agent.cuda_graph false: each minibatch's kernels launched one by one")
    args = parser.parse_args()
    overrides = {"distribution.rollout_workers": args.round[0], "distribution.envs_per_worker": args.round[1]} \
        if args.round else None
    with_cuda = torch.cuda.is_available()
    cuda_sides = {"cuda": {}, **({"cuda eager": {"agent.cuda_graph": False}} if args.cuda_eager else {})} \
        if with_cuda else {}
    device_name = torch.cuda.get_device_name() if with_cuda else "none"
    print(f"torch {torch.__version__}, CUDA device: {device_name}, {torch.get_num_threads()} CPU threads available")
    table = []
    for preset in args.presets:
        threads = [] if args.cuda_only else args.cpu_threads or [load_preset(preset).distribution.learner_threads]
        table.append((preset, *compare(preset, args.rounds, threads, cuda_sides, overrides)))
        for side, own in cuda_sides.items() if args.profile else ():
            profile(preset, {**(overrides or {}), **own}, side)
    print(f"\n{'preset':<16} " + "  ".join(f"{name:>10}" for name in table[0][2]) + "  cpu/cuda  unit")
    for preset, unit, medians in table:
        cpu = [value for name, value in medians.items() if name.startswith("cpu")]
        ratio = f"{min(cpu) / medians['cuda']:7.1f}x" if with_cuda and cpu else " " * 8
        print(f"{preset:<16} " + "  ".join(f"{value:>10.2f}" for value in medians.values()) + f"  {ratio}  {unit}")
        if "cuda eager" in medians:
            print(f"{preset:<16} cuda eager / cuda graph: {medians['cuda eager'] / medians['cuda']:.2f}x")


if __name__ == "__main__":
    main()
