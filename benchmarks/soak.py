"""A long ASYNC run, watched as an operator would: memory, storage and commit time, every minute.

    .venv/bin/python benchmarks/soak.py --minutes 30                      # cartpole-dqn-async, the recorded figures
    .venv/bin/python benchmarks/soak.py --minutes 3 --preset pendulum-sac  # any preset; the target is switched off

Starts `gymflow run PRESET` (the whole pipeline: a temporary Prefect API, a Dask LocalCluster,
a local storage folder and MLflow store in a temporary folder) with the target return off and a
budget it cannot reach, and prints once a minute: the flow process's resident memory, the bytes
the run holds in storage, and the median and p99 of `time/commit_seconds` (publishing a policy
version, and writing a checkpoint when one is due) over that minute, read back from MLflow.

At the end it checks the three figures issue 15 asks for, against the run itself:
  - RSS: after the replay memory is full, it grows by at most 5%;
  - storage: under keep_checkpoints x checkpoint size + the replay capacity's worth of shards
    (+ the policy window and a commit period's worth of chunks in flight), from the run's own sizes;
  - commit time: the last minute's p99 is at most 1.2x the second minute's.
The process group it started is ended on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cartpole-dqn-async")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more preset overrides")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        root, tracking = Path(folder, "data"), f"sqlite:///{Path(folder, 'mlflow.db')}"
        command = [sys.executable, "-m", "gymflow.flows.cli", "run", args.preset, "--quiet",
                   "--set", f"storage.root={root}", "--set", f"tracking.tracking_uri={tracking}",
                   "--set", "schedule.target_return=null", "--set", "schedule.total_env_steps=1000000000",
                   *(item for pair in args.set for item in ("--set", pair))]
        flow = subprocess.Popen(command, cwd=folder, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=open(Path(folder, "flow.log"), "wb"))
        try:
            rows = watch(flow, root, tracking, args.minutes)
        finally:
            stop(flow)
        report(args.preset, rows, root)


def watch(flow: subprocess.Popen, root: Path, tracking: str, minutes: float) -> list[dict]:
    """One row a minute, from the run's first committed version until `minutes` have passed."""
    from mlflow.tracking import MlflowClient

    run_folder = wait_for_run(flow, root)
    mlflow_run_id = json.loads((run_folder / "run.json").read_text())["mlflow_run_id"]
    client, process = MlflowClient(tracking), psutil.Process(flow.pid)
    started, rows = time.time(), []
    print(f"{'minute':>6} {'env steps':>11} {'version':>8} {'RSS MB':>8} {'storage MB':>10} {'files':>6} "
          f"{'commit p50 ms':>13} {'commit p99 ms':>13}", flush=True)
    for minute in range(1, int(minutes) + 1):
        time.sleep(max(started + 60 * minute - time.time(), 0))
        if flow.poll() is not None:
            raise SystemExit(f"the run ended early (exit {flow.returncode}); see its log")
        commits = [m.value for m in client.get_metric_history(mlflow_run_id, "time/commit_seconds")
                   if m.timestamp >= 1000 * (started + 60 * (minute - 1))]
        steps = client.get_metric_history(mlflow_run_id, "time/env_steps")
        versions = client.get_metric_history(mlflow_run_id, "time/policy_version")
        used, files = folder_size(run_folder)
        row = {"minute": minute, "env_steps": int(max((m.value for m in steps), default=0)),
               "version": int(max((m.value for m in versions), default=0)), "rss": process.memory_info().rss,
               "storage": used, "files": files, "p50": percentile(commits, 50), "p99": percentile(commits, 99),
               "commits": len(commits)}
        rows.append(row)
        print(f"{minute:>6} {row['env_steps']:>11,} {row['version']:>8,} {row['rss'] / 2**20:>8.0f} "
              f"{used / 1e6:>10.1f} {files:>6} {1000 * row['p50']:>13.2f} {1000 * row['p99']:>13.2f}", flush=True)
    return rows


def wait_for_run(flow: subprocess.Popen, root: Path, timeout_s: float = 300) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.glob("runs/*/policies/v000001/manifest.json"))
        if found:
            return found[0].parents[2]
        if flow.poll() is not None:
            raise SystemExit(f"the run exited ({flow.returncode}) before committing a version")
        time.sleep(0.5)
    raise SystemExit("no version committed within 5 minutes")


def folder_size(folder: Path) -> tuple[int, int]:
    sizes = [path.stat().st_size for path in folder.rglob("*") if path.is_file()]
    return sum(sizes), len(sizes)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(round(q / 100 * (len(ordered) - 1))), len(ordered) - 1)]


def stop(flow: subprocess.Popen) -> None:
    """End the process group this script started: the flow, its Prefect API and Dask workers."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(flow.pid, sig)
        except ProcessLookupError:
            return
        try:
            flow.wait(wait_s)
            time.sleep(1)  # let the group's other processes go too
        except subprocess.TimeoutExpired:
            continue


def storage_bound(run_folder: Path, preset: dict) -> tuple[int, str]:
    """keep_checkpoints x checkpoint size + the replay capacity's worth of shards (+ the policy
    window and one round of chunks in flight), from the run's preset and its own file sizes."""
    storage, agent, distribution = preset["storage"], preset["agent"], preset["distribution"]
    checkpoints = [folder_size(path)[0] for path in (run_folder / "checkpoints").glob("v*")]
    policies = [folder_size(path)[0] for path in (run_folder / "policies").glob("v*")]
    chunks = list((run_folder / "shards").rglob("c*.npz"))
    chunk_bytes = max(path.stat().st_size for path in chunks)
    chunk_steps = distribution["envs_per_worker"] * preset["schedule"]["rollout_steps_per_env"]
    replay_chunks = -(-agent["replay_capacity"] // chunk_steps) + 2 * distribution["rollout_workers"]
    window = distribution["max_policy_lag"] + 2
    bound = (storage["keep_checkpoints"] * max(checkpoints) + replay_chunks * chunk_bytes + window * max(policies)
             + (1 + storage["keep_checkpoints"]) * 65_536)  # the run's small files: preset, record, ledger segments
    explained = (f"{storage['keep_checkpoints']} checkpoints x {max(checkpoints) / 1e6:.2f} MB + "
                 f"{replay_chunks} chunks x {chunk_bytes / 1e3:.1f} kB (replay capacity {agent['replay_capacity']:,} / "
                 f"{chunk_steps} steps a chunk, + 2 a worker) + {window} policies x {max(policies) / 1e3:.1f} kB")
    return bound, explained


def report(preset: str, rows: list[dict], root: Path) -> None:
    (run_folder,) = root.glob("runs/*")
    preset_fields = yaml_preset(run_folder)
    capacity = preset_fields["agent"].get("replay_capacity", 0)
    heatup = preset_fields["schedule"].get("heatup_env_steps", 0)
    print(f"\n{preset}, {len(rows)} minutes; machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    full = next((row for row in rows if row["env_steps"] >= capacity + heatup), None)
    if full is None or full is rows[-1]:
        print("RSS: the replay memory did not fill with a minute to spare; run longer")
    else:
        growth = rows[-1]["rss"] / full["rss"] - 1
        print(f"RSS after the replay memory filled (minute {full['minute']}): {full['rss'] / 2**20:.0f} MB -> "
              f"{rows[-1]['rss'] / 2**20:.0f} MB at minute {rows[-1]['minute']}: {100 * growth:+.1f}% "
              f"({'ok' if growth <= 0.05 else 'OVER'} the 5% bound)")
    bound, explained = storage_bound(run_folder, preset_fields)
    peak = max(row["storage"] for row in rows)
    print(f"storage: peak {peak / 1e6:.1f} MB, final {rows[-1]['storage'] / 1e6:.1f} MB; bound {bound / 1e6:.1f} MB = "
          f"{explained} ({'ok' if peak <= bound else 'OVER'})")
    if len(rows) >= 3:
        ratio = rows[-1]["p99"] / rows[1]["p99"]
        print(f"commit p99: minute 2 {1000 * rows[1]['p99']:.2f} ms, minute {rows[-1]['minute']} "
              f"{1000 * rows[-1]['p99']:.2f} ms: {ratio:.2f}x ({'ok' if ratio <= 1.2 else 'OVER'} the 1.2x bound); "
              f"medians {1000 * statistics.median(r['p50'] for r in rows):.2f} ms over the run")


def yaml_preset(run_folder: Path) -> dict:
    import yaml

    return yaml.safe_load((run_folder / "preset.yaml").read_text())


if __name__ == "__main__":
    main()
