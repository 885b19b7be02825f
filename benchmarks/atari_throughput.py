"""Training throughput on pixels: gymflow's SYNC PPO and APPO end to end against the rate the
cores step the envs alone, and against Stable-Baselines3's PPO, on one machine in one invocation.

    .venv/bin/pip install -e ".[bench]"                          # stable-baselines3, benchmark-only
    .venv/bin/python benchmarks/atari_throughput.py               # CPU mode: Catch on this machine's cores
    .venv/bin/python benchmarks/atari_throughput.py --env breakout --steps 30000
    python3 benchmarks/atari_throughput.py --mode gpu             # a 16-core GPU machine: Breakout, <= 8 minutes

What runs, `--repeats` times with the sides alternating (each training run `--steps` env steps):
- **stepping alone** (the Python path's limit): one process per core used for envs, each stepping
  its share of the envs (the preset's env and preprocessing, on Gymnasium) with uniformly random
  actions, nothing else. gymflow's runs step on `--backend` (default auto: SYNC PPO on the ALE's
  vector env, APPO on EnvPool where it is installed; benchmarks/env_backends.py has their limits).
- **gymflow SYNC PPO** (`catch-ppo` / `breakout-ppo`) and **gymflow APPO** (`catch-appo` /
  `breakout-appo`), the same network, epochs, minibatches and learning rate, the same workers x
  envs x steps per chunk: `improve` end to end (a LocalCluster, the temporary Prefect API, MLflow,
  storage), evaluations pushed past the run and films off. SYNC's learner takes every core used
  (the workers idle while it learns); APPO's takes one torch thread on the CPU (the workers
  keep the other cores), or the GPU. In GPU mode APPO runs twice: with `distribution.inference`
  auto (the workers' network outputs computed on the GPU beside the learner, the workers stepping
  envs alone) and worker (each worker's CNN on its own CPU thread).
- **SB3 PPO** with the same settings, envs (gymflow's own make_env: the same preprocessing) and
  network (gymflow's pixel encoder and hidden layer): in CPU mode the same envs in a DummyVecEnv,
  in GPU mode one SubprocVecEnv env (fork) a core, as the 1,904 env steps/s figure of the issue
  was measured; skipped with a note where stable-baselines3 is not installed.

GPU mode on the lent machine (`../shared/device/build-wheelhouse.sh --add stable-baselines3==2.9.2`,
then `source .devrun/install.sh && cd /tmp && python3 $OLDPWD/benchmarks/atari_throughput.py
--mode gpu`): Breakout, cores - 2 workers x 8 envs, the learners on cuda, 200,000 env steps a
training run, one repeat: about 5 minutes.

Each training run's steady rate is read from its own clock after a warm-up (the first quarter of
its steps): for gymflow the MLflow metrics each step logs (env steps, and the learner's, the
collection's and the commit's seconds), for SB3 a callback at each rollout's start and end. The
learner's busy share is the time in its updates over the wall-clock of the same window.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PRESETS = {"catch": ("catch-ppo", "catch-appo"), "breakout": ("breakout-ppo", "breakout-appo")}  # SYNC, ASYNC
BUDGETS = {("cpu", "catch"): 40_000, ("cpu", "breakout"): 20_000, ("gpu", "catch"): 600_000,
           ("gpu", "breakout"): 200_000}  # env steps a training run: ~15-60 s each (gpu breakout: SB3 ~100 s)
WARM_UP = 0.25  # the share of a run's env steps left out of its steady rate


@dataclass
class Measured:
    name: str
    env_steps_per_second: float
    learner_busy: float | None = None  # the learner's update time over the window's wall-clock
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per 1,000 env steps, by part
    workers_could: float | None = None  # ASYNC: every worker's own collecting rate, summed (env steps/s)


def _step_share(env_id: str, kwargs: dict, preprocessing, envs: int, seed: int, seconds: float, queue) -> None:
    import numpy as np

    from gymflow.envs.vector import make_vector_env

    env = make_vector_env(env_id, kwargs, envs, seed, preprocessing)
    env.reset()
    rng = np.random.default_rng(seed)
    steps, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        env.step(rng.integers(0, env.action_space.n, envs))
        steps += envs
    queue.put(steps)


def step_envs_alone(preset: str, workers: int, envs: int, seconds: float) -> Measured:
    """The limit: `workers` processes stepping `envs` envs each with random actions."""
    from gymflow.presets.validate import resolve_experiment

    env = resolve_experiment(preset).preset.env
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_step_share, args=(env.id, dict(env.kwargs), env.preprocessing(), envs,
                                                              worker, seconds, queue)) for worker in range(workers)]
    for process in processes:
        process.start()
    steps = sum(queue.get() for _ in processes)
    for process in processes:
        process.join()
    return Measured("stepping alone (random actions)", steps / seconds)


def train_with_gymflow(preset: str, overrides: dict, folder: str, name: str, workers: int) -> Measured:
    from mlflow.tracking import MlflowClient

    from gymflow.flows.improve import improve

    tracking = f"sqlite:///{folder}/mlflow.db"
    summary = improve(preset, {**overrides, "storage.root": f"{folder}/data", "tracking.tracking_uri": tracking})
    client = MlflowClient(tracking)
    history = {key: sorted(client.get_metric_history(summary.mlflow_run_id, key), key=lambda m: m.timestamp)
               for key in ("time/env_steps", "time/learn_seconds", "time/collect_seconds", "time/commit_seconds")}
    steps = history["time/env_steps"]
    first = next(i for i, m in enumerate(steps) if m.value >= WARM_UP * steps[-1].value)
    window = steps[first:]
    seconds = (window[-1].timestamp - window[0].timestamp) / 1000
    done = window[-1].value - window[0].value
    parts = {key.removeprefix("time/").removesuffix("_seconds"): sum(m.value for m in history[key][first + 1:])
             for key in history if key != "time/env_steps"}
    rates = [m.value for m in client.get_metric_history(summary.mlflow_run_id, "async/worker_env_steps_per_second")
             if m.timestamp >= window[0].timestamp]
    return Measured(name, done / seconds, parts["learn"] / seconds,
                    {part: 1e6 * value / done for part, value in parts.items()} | {"wall": 1e6 * seconds / done},
                    workers * statistics.median(rates) if rates else None)


def train_with_sb3(preset: str, envs: int, total_steps: int, gpu: bool, epochs: int | None) -> Measured | str:
    """SB3's PPO with the preset's settings and gymflow's envs and network, `envs` envs (in GPU
    mode one subprocess each); a note if SB3 is missing."""
    try:
        from stable_baselines3 import PPO
    except ImportError:
        return "stable-baselines3 not installed (pip install -e '.[bench]')"
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    from gymflow.agents.networks import PixelEncoder
    from gymflow.envs.make import make_env
    from gymflow.presets.validate import resolve_experiment

    config = resolve_experiment(preset).preset
    agent, env_config = config.agent, config.env

    class GymflowPixels(BaseFeaturesExtractor):
        """gymflow's pixel encoder and hidden layer: the network both sides train."""

        def __init__(self, observation_space, features_dim: int = agent.hidden_sizes[0]):
            super().__init__(observation_space, features_dim)
            encoder = PixelEncoder(observation_space.shape)
            self.layers = torch.nn.Sequential(encoder, torch.nn.Linear(encoder.features, features_dim),
                                              torch.nn.ReLU())

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.layers(obs * 255.0 if obs.dtype.is_floating_point else obs)

    class Clock(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.marks: list[tuple[str, float, int]] = []

        def _on_rollout_start(self) -> None:
            self.marks.append(("start", time.perf_counter(), self.num_timesteps))

        def _on_rollout_end(self) -> None:
            self.marks.append(("end", time.perf_counter(), self.num_timesteps))

        def _on_step(self) -> bool:
            return True

    vec_env_cls, vec_kwargs = (SubprocVecEnv, {"start_method": "fork"}) if gpu else (DummyVecEnv, {})
    env = make_vec_env(lambda: make_env(env_config.id, dict(env_config.kwargs), preprocessing=env_config.preprocessing()),
                       n_envs=envs, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_kwargs)
    model = PPO("CnnPolicy", env, learning_rate=agent.lr, n_steps=config.schedule.rollout_steps_per_env,
                batch_size=agent.minibatch_size, n_epochs=epochs or agent.epochs, gamma=agent.gamma, gae_lambda=agent.gae_lambda,
                clip_range=agent.clip_range, ent_coef=agent.entropy_coef, vf_coef=agent.value_coef,
                max_grad_norm=agent.max_grad_norm, device="cuda" if gpu else "cpu", verbose=0, seed=0,
                policy_kwargs={"features_extractor_class": GymflowPixels, "net_arch": [], "normalize_images": False})
    clock = Clock()
    model.learn(total_steps, callback=clock)
    env.close()
    marks = [mark for mark in clock.marks if mark[2] >= WARM_UP * total_steps]
    starts = [mark for mark in marks if mark[0] == "start"]
    seconds, done = starts[-1][1] - starts[0][1], starts[-1][2] - starts[0][2]
    collect = sum(end[1] - start[1] for start, end in zip(marks, marks[1:], strict=False)
                  if start[0] == "start" and end[0] == "end" and end[1] <= starts[-1][1])
    learn = seconds - collect
    return Measured("SB3 PPO", done / seconds, learn / seconds,
                    {"collect": 1e6 * collect / done, "learn": 1e6 * learn / done, "wall": 1e6 * seconds / done})


def gymflow_overrides(workers: int, envs: int, total_steps: int, learner_threads: int, gpu: bool,
                      epochs: int | None, backend: str = "auto") -> dict:
    return {"distribution.rollout_workers": workers, "distribution.envs_per_worker": envs, "env.backend": backend,
            "distribution.learner_threads": learner_threads, "distribution.learner_device": "cuda" if gpu else "cpu",
            **({"agent.epochs": epochs} if epochs else {}),
            "schedule.total_env_steps": total_steps, "schedule.evaluate_every_env_steps": 10 * total_steps,
            "schedule.evaluation_episodes": 2, "schedule.target_return": None, "tracking.video": "off"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--env", choices=["catch", "breakout"], default=None, help="catch (cpu) or breakout (gpu)")
    parser.add_argument("--workers", type=int, default=None, help="rollout workers (default: cores - 2, >= 2)")
    parser.add_argument("--envs", type=int, default=None, help="envs per worker (default: the preset's; gpu: 8)")
    parser.add_argument("--steps", type=int, default=None, help="env steps a training run (default: BUDGETS)")
    parser.add_argument("--stepping-seconds", type=float, default=15.0, help="how long the envs step alone")
    parser.add_argument("--repeats", type=int, default=None, help="default: cpu 2, gpu 1 (8 minutes in all)")
    parser.add_argument("--epochs", type=int, default=None, help="every side's epochs (default: the presets')")
    parser.add_argument("--appo-threads", type=int, default=1, help="APPO's learner torch threads (cpu mode)")
    parser.add_argument("--backend", choices=["auto", "gymnasium", "envpool", "ale"], default="auto",
                        help="env.backend of gymflow's runs (auto: ale for SYNC PPO, envpool for APPO where installed)")
    parser.add_argument("--only", nargs="+", default=None, help="some sides: stepping sync sync-all-cores appo appo-worker-inference sb3")
    args = parser.parse_args()
    gpu = args.mode == "gpu"
    env = args.env or ("breakout" if gpu else "catch")
    sync_preset, async_preset = PRESETS[env]
    from gymflow.presets.validate import resolve_experiment

    preset = resolve_experiment(sync_preset).preset
    cores = os.cpu_count() or 2
    workers = args.workers or max(cores - 2, 2)
    envs = args.envs or (8 if gpu else preset.distribution.envs_per_worker)
    total, seconds = args.steps or BUDGETS[args.mode, env], args.stepping_seconds
    used = min(workers, cores)
    repeats = args.repeats or (1 if gpu else 2)
    print(f"{args.mode} mode, {env}: {workers} workers x {envs} envs x {preset.schedule.rollout_steps_per_env} steps, "
          f"{cores} cores ({used} used for envs), {total:,} env steps a training run, {repeats} repeats")

    threads = preset.distribution.learner_threads

    def run_sync(learner_threads: int) -> Callable[[], Measured]:
        overrides = gymflow_overrides(workers, envs, total, learner_threads, gpu, args.epochs, args.backend)
        name = f"gymflow SYNC PPO ({sync_preset}, {learner_threads} learner thread{'s' * (learner_threads > 1)})"
        return lambda: train_with_gymflow(sync_preset, overrides, tempfile.mkdtemp(), name, workers)

    def run_appo(inference: str) -> Callable[[], Measured]:
        overrides = {**gymflow_overrides(workers, envs, total, args.appo_threads, gpu, args.epochs, args.backend),
                     "distribution.inference": inference}
        acting = "inference beside the learner" if inference == "auto" and gpu else "inference on the workers"
        name = f"gymflow APPO ({async_preset}, {acting})" if gpu else \
            f"gymflow APPO ({async_preset}, {args.appo_threads} learner thread{'s' * (args.appo_threads > 1)})"
        return lambda: train_with_gymflow(async_preset, overrides, tempfile.mkdtemp(), name, workers)

    sides = {
        "stepping": lambda: step_envs_alone(sync_preset, workers, envs, seconds),
        "sync": run_sync(threads),
        "sync-all-cores": run_sync(used),
        "appo": run_appo("auto"),
        "appo-worker-inference": run_appo("worker"),
        "sb3": lambda: train_with_sb3(sync_preset, cores if gpu else workers * envs, total, gpu, args.epochs),
    }
    if threads == used or gpu:  # the preset's SYNC already learns on every core used (or on the GPU)
        del sides["sync-all-cores"]
    if not gpu:  # without a GPU, auto is worker: the same run twice
        del sides["appo-worker-inference"]
    sides = {key: side for key, side in sides.items() if key in (args.only or sides)}
    runs: dict[str, list[Measured]] = {}
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")  # as gymflow's own temporary API: no telemetry
    with prefect_test_harness(server_startup_timeout=120):  # one temporary Prefect API for every gymflow run
        for repeat in range(repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))  # alternate: the VM drifts
            for key in order:
                measured = sides[key]()
                if isinstance(measured, str):
                    print(f"  SB3: {measured}")
                    continue
                runs.setdefault(key, []).append(measured)
                could = f" (its workers collecting alone: {measured.workers_could:,.0f})" if measured.workers_could else ""
                print(f"  [{repeat}] {measured.name}: {measured.env_steps_per_second:,.0f} env steps/s{could}",
                      flush=True)
    _report(runs, used, preset.env.atari)


def _report(runs: dict[str, list[Measured]], cores_used: int, atari: bool) -> None:
    medians = {key: statistics.median(m.env_steps_per_second for m in measured) for key, measured in runs.items()}
    frames = 4 if atari else 1  # Atari's frame skip: 4 emulator frames a step
    print(f"\n{'run':60} {'env steps/s':>12} {'frames/s/core':>14} {'of stepping':>12} {'learner busy':>13}  "
          "us per env step")
    for key, measured in runs.items():
        last = measured[-1]
        of_stepping = f"{medians[key] / medians['stepping']:12.2f}" if "stepping" in medians else f"{'':12}"
        busy = [m.learner_busy for m in measured if m.learner_busy is not None]
        parts = ", ".join(f"{part} {value:.0f}" for part, value in last.breakdown.items())
        print(f"{last.name:60} {medians[key]:12,.0f} {frames * medians[key] / cores_used:14,.0f} "
              f"{of_stepping} {f'{statistics.median(busy):.0%}' if busy else '':>13}  "
              f"{parts}")
    for sync in ("sync", "sync-all-cores"):
        if sync in medians and "appo" in medians:
            print(f"\nAPPO / {runs[sync][-1].name}: {medians['appo'] / medians[sync]:.2f}x env steps/s")
    if "appo-worker-inference" in medians and "appo" in medians:
        print(f"APPO, inference beside the learner / on the workers: "
              f"{medians['appo'] / medians['appo-worker-inference']:.2f}x env steps/s")
    if "sb3" in medians and "appo" in medians:
        print(f"APPO / SB3 PPO: {medians['appo'] / medians['sb3']:.2f}x env steps/s")


if __name__ == "__main__":
    main()
