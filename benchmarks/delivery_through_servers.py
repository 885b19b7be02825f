"""What a run's end costs through a team's servers: `gymflow run cartpole-ppo` on the embedded
defaults (a SQLite MLflow store and a storage folder in the working folder, its own temporary
Prefect API, a LocalCluster) against the same command through `gymflow stack up`'s servers (the
MLflow server on PostgreSQL with logins and its artifacts in S3 through its proxy, the Prefect
server on PostgreSQL with a login, storage in the S3 bucket, the stack's Dask workers), the two
alternating, `--repeats` times each. Delivery is what a run does after its last evaluation: the
preset, checkpoint and learning curve logged, the policy logged as a model (its code, weights and
signature through the artifact proxy), the summary; read off the run's own log (from the
`done: eval` line to the `run ... done` line), with the `vN delivered to MLflow ... in X s` line
gymflow prints for the part inside `deliver`. Medians, and the servers' cost over the defaults.

    .venv/bin/python benchmarks/delivery_through_servers.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from gymflow.flows import team_stack as team

GYMFLOW = str(Path(sys.executable).with_name("gymflow"))
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def _run(folder: Path, environment: dict[str, str], settings: list[str]) -> dict[str, float]:
    started = time.monotonic()
    done = subprocess.run([GYMFLOW, "run", "cartpole-ppo", "--quiet", *[a for s in settings for a in ("--set", s)]],
                          cwd=folder, env=environment, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"gymflow run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    log = max((folder / "gymflow-logs").glob("*.log"), key=os.path.getmtime).read_text()
    trained = _stamp(log, r"env steps \(\d+%\) done: eval")
    reported = _stamp(log, r"run \S+ done: ")
    inside = float(re.search(r"delivered to MLflow \(.*?\) in ([\d.]+) s", log).group(1))
    return {"delivery_s": reported - trained, "deliver_s": inside, "wall_s": wall}


def _stamp(log: str, pattern: str) -> float:
    line = re.search(_STAMP + r".*" + pattern, log, re.M)
    return datetime.strptime(line.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = {name: value for name, value in os.environ.items() if not name.startswith(("PREFECT_API", "MLFLOW_"))}
    with tempfile.TemporaryDirectory(prefix="gymflow-delivery-") as scratch:
        print("starting the team's stack ...", flush=True)
        with team.running(Path(scratch) / "stack") as stack:
            sides = {
                "defaults": (base, []),
                "team stack": ({**base, **stack.environment("alice")},
                               [*stack.settings("bench"), "tracking.experiment=bench"]),
            }
            figures: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for repeat in range(args.repeats):
                for side, (environment, settings) in sides.items():  # alternating: the VM's drift hits both
                    folder = Path(scratch) / f"{side.replace(' ', '-')}-{repeat}"
                    folder.mkdir()
                    figures[side].append(_run(folder, environment, settings))
                    print(f"  {side:<11} run {repeat + 1}: " + ", ".join(f"{key} {value:.1f}" for key, value in
                                                                        figures[side][-1].items()), flush=True)
    medians = {side: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
               for side, rows in figures.items()}
    print(f"\nmedians of {args.repeats} runs each (CartPole PPO to 475, {os.cpu_count()} cores):")
    for side, row in medians.items():
        print(f"  {side:<11} delivery {row['delivery_s']:.1f} s (inside deliver {row['deliver_s']:.1f} s), "
              f"whole command {row['wall_s']:.1f} s")
    extra = medians["team stack"]["delivery_s"] - medians["defaults"]["delivery_s"]
    print(f"  the servers' cost: delivery +{extra:.1f} s "
          f"({medians['team stack']['delivery_s'] / medians['defaults']['delivery_s']:.2f}x the defaults')")


if __name__ == "__main__":
    main()
