"""From the shell to a solved CartPole: `gymflow run cartpole-ppo` against a Stable-Baselines3
script solving CartPole-v1 with rl-zoo's settings, each a new process, the two alternating,
`--repeats` times; medians and the ratio gymflow / SB3. And where gymflow's start-up goes: when
each milestone line of its output arrived, counted from the moment the process was started.

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python benchmarks/startup_vs_sb3.py --repeats 3

Both solve to the same rule: 10 greedy episodes every 4,096 env steps, stop at a mean of 475
(gymflow's preset as it ships; SB3 with EvalCallback + StopTrainingOnRewardThreshold, rl-zoo's
PPO hyper-parameters for CartPole-v1, 8 envs). No Prefect API is configured: gymflow starts its
temporary one. Each side keeps one working folder, warmed by a first run that is not counted (a
user's project folder: gymflow's MLflow store is there already); `--fresh-folders` gives every
run a new empty folder instead (a user's very first run: the store's creation is counted), and
`--prefect-server` has gymflow use a Prefect API started before the runs (PREFECT_API_URL, as on
a machine where `prefect server start` runs) instead of starting its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SB3_SCRIPT = """
import sys
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold
from stable_baselines3.common.env_util import make_vec_env

seed = int(sys.argv[1])
env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
stop = StopTrainingOnRewardThreshold(reward_threshold=475, verbose=0)
evaluation = EvalCallback(make_vec_env("CartPole-v1", n_envs=1, seed=seed + 1000), n_eval_episodes=10,
                          eval_freq=4096 // 8, deterministic=True, callback_on_new_best=stop, verbose=0)
model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
            learning_rate=lambda p: p * 0.001, clip_range=lambda p: p * 0.2, seed=seed, device="cpu", verbose=0)
model.learn(100_000, callback=evaluation)
print(f"sb3: {model.num_timesteps} env steps, best evaluation {evaluation.best_mean_reward:.1f}")
"""

# gymflow's output lines that mark the stages of a run, in the order they appear
MILESTONES = {
    "flow run begins (imports, Prefect API)": re.compile(r"Beginning flow run"),
    "cluster, storage and MLflow run ready": re.compile(r"Dask dashboard"),
    "rollout workers ready: training starts": re.compile(r"workers ready"),
    "first training round done": re.compile(r"env steps \(\d+%\) v1 "),
    "first train task done": re.compile(r"Task run 'train-from-v0'"),
    "last evaluation done": re.compile(r"Task run 'evaluate-v\d+' - Finished"),
    "summary printed": re.compile(r"reached its target|did not reach its target"),
}


PREFECT_API: dict[str, str] = {}  # PREFECT_API_URL of a server already running, with --prefect-server


def timed_process(args: list[str], cwd: str) -> tuple[float, dict[str, float], str]:
    """Run a process; returns its wall-clock, when each milestone line arrived, and its output."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")} | PREFECT_API
    started = time.perf_counter()
    process = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            now = time.perf_counter() - started
            lines.append(line)
            for name, pattern in MILESTONES.items():
                if (name not in seen or name.startswith("last")) and pattern.search(line):
                    seen[name] = now

    reader = threading.Thread(target=read)
    reader.start()
    code = process.wait()
    reader.join()
    wall = time.perf_counter() - started
    output = "".join(lines)
    if code != 0:
        raise RuntimeError(f"{args[:4]} exited with {code}:\n{output[-3000:]}")
    return wall, seen, output


def run_gymflow(seed: int, folder: str, changes: tuple[str, ...] = ()) -> tuple[float, dict[str, float], str]:
    """`gymflow run cartpole-ppo` with this seed and the `--set` changes given."""
    beside = os.path.join(os.path.dirname(sys.executable), "gymflow")
    gymflow = beside if os.path.exists(beside) else shutil.which("gymflow") or beside
    sets = [arg for change in (f"seed={seed}", *changes) for arg in ("--set", change)]
    return timed_process([gymflow, "run", "cartpole-ppo", "--quiet", *sets], folder)


def run_sb3(seed: int, folder: str) -> tuple[float, str]:
    wall, _, output = timed_process([sys.executable, "-c", SB3_SCRIPT, str(seed)], folder)
    return wall, output


def working_folder(fresh: bool, kept: str) -> contextlib.AbstractContextManager[str]:
    """A new empty folder for each run (a user's first run: gymflow creates its MLflow store), or
    the side's one folder for all its runs (a user's project folder)."""
    return tempfile.TemporaryDirectory() if fresh else contextlib.nullcontext(kept)


def import_seconds() -> float:
    """What importing the improve flow costs a fresh interpreter (part of the first milestone)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gymflow.flows.improve"], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fresh-folders", action="store_true",
                        help="every run in a new empty folder (default: each side keeps one folder, after a warm-up run)")
    parser.add_argument("--prefect-server", action="store_true",
                        help="gymflow uses a Prefect server started before the runs (default: its temporary API)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset change for gymflow's side (repeatable), e.g. tracking.video=off")
    args = parser.parse_args()
    if args.prefect_server:
        from gymflow.flows.stopping import TemporaryApi

        server = TemporaryApi()  # stopped when this script exits
        server.wait_ready()
        PREFECT_API["PREFECT_API_URL"] = server.url
    kept = {side: tempfile.mkdtemp(prefix=f"startup-{side}-") for side in ("gymflow", "sb3")}
    if not args.fresh_folders:  # the warm-up: a project folder that has seen a run, and a warm page cache
        run_gymflow(100, kept["gymflow"], tuple(args.set))
        run_sb3(100, kept["sb3"])
    gymflow_walls, sb3_walls, stages = [], [], []
    for repeat in range(args.repeats):
        sides = ("gymflow", "sb3") if repeat % 2 == 0 else ("sb3", "gymflow")  # alternate who goes first
        for side in sides:
            if side == "gymflow":
                with working_folder(args.fresh_folders, kept[side]) as folder:
                    wall, seen, output = run_gymflow(repeat, folder, tuple(args.set))
                gymflow_walls.append(wall)
                stages.append(seen)
                verdict = next((line.strip() for line in output.splitlines() if "its target" in line), "?")
                print(f"repeat {repeat}: gymflow {wall:6.1f} s  {verdict[:110]}", flush=True)
            else:
                with working_folder(args.fresh_folders, kept[side]) as folder:
                    wall, output = run_sb3(repeat, folder)
                sb3_walls.append(wall)
                print(f"repeat {repeat}: sb3     {wall:6.1f} s  {output.strip().splitlines()[-1]}", flush=True)
    print(f"\nimporting gymflow.flows.improve in a fresh interpreter: {import_seconds():.1f} s")
    print("\ngymflow's milestones, seconds after the process started (median over repeats):")
    for name in MILESTONES:
        times = [seen[name] for seen in stages if name in seen]
        if times:
            print(f"  {statistics.median(times):6.1f}  {name}")
    gymflow, sb3 = statistics.median(gymflow_walls), statistics.median(sb3_walls)
    for folder in kept.values():
        shutil.rmtree(folder, ignore_errors=True)
    setting = (f"{'new folders' if args.fresh_folders else 'kept folders'}, "
               f"{'a Prefect server running' if args.prefect_server else 'temporary Prefect API'}")
    print(f"\nend to end, median of {args.repeats} ({setting}): gymflow {gymflow:.1f} s, SB3 {sb3:.1f} s; "
          f"gymflow / SB3 = {gymflow / sb3:.2f}")


if __name__ == "__main__":
    main()
