"""What storing a round costs the single-mode loop on S3 against a local folder: the case for (or
against) making S3's writes behind the loop, as a local folder's are.

    .venv/bin/python benchmarks/s3_commit_cost.py --repeats 2

Runs `cartpole-ppo` in single mode (`--steps` env steps, evaluations pushed past the run, films
off) with its storage in a local folder (writes behind the loop) and in a bucket of a moto S3
server on loopback (writes in the loop: every PUT waits for its answer), the two alternating.
Prints each run's commit seconds per round (`time/commit_seconds`: shards, policy, checkpoint and
manifest stored, as the loop sees them), the round's wall-clock, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from gymflow.testing.s3 import moto_on_loopback

S3_BUCKET = "bench"


@contextmanager
def moto_bucket() -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback with the benchmark's bucket; the storage options that reach it."""
    import boto3

    with moto_on_loopback() as endpoint:
        options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                     aws_secret_access_key="bench").create_bucket(Bucket=S3_BUCKET)
        yield options


def one_run(root: str, options: dict[str, str], steps: int) -> tuple[float, float, int]:
    """(commit ms a round, wall ms a round, rounds) of one single-mode run stored at `root`."""
    from mlflow.tracking import MlflowClient

    from gymflow.flows.improve import improve

    folder = tempfile.mkdtemp()
    tracking = f"sqlite:///{folder}/mlflow.db"
    summary = improve("cartpole-ppo", {"storage.root": root, "storage.options": options, "distribution.mode": "single",
                                       "schedule.total_env_steps": steps, "schedule.target_return": None,
                                       "schedule.evaluate_every_env_steps": 10 * steps, "tracking.video": "off",
                                       "tracking.tracking_uri": tracking})
    client = MlflowClient(tracking)
    commits = client.get_metric_history(summary.mlflow_run_id, "time/commit_seconds")
    clock = sorted(client.get_metric_history(summary.mlflow_run_id, "time/env_steps"), key=lambda m: m.timestamp)
    rounds = len(commits)
    wall_ms = (clock[-1].timestamp - clock[0].timestamp) / max(len(clock) - 1, 1)
    return 1e3 * statistics.mean(m.value for m in commits), wall_ms, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40_960)
    args = parser.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")
    figures: dict[str, list[tuple[float, float, int]]] = {"local folder (writes behind)": [], "S3 (moto, loopback)": []}
    with moto_bucket() as options, prefect_test_harness(server_startup_timeout=120):
        for repeat in range(args.repeats):
            sides = list(figures) if repeat % 2 == 0 else list(figures)[::-1]
            for side in sides:
                root = tempfile.mkdtemp() if side.startswith("local") else f"s3://{S3_BUCKET}/r{repeat}"
                figures[side].append(one_run(root, {} if side.startswith("local") else options, args.steps))
                commit, wall, rounds = figures[side][-1]
                print(f"  [{repeat}] {side}: commit {commit:.1f} ms a round of {wall:.1f} ms ({rounds} rounds)",
                      flush=True)
    print(f"\n{'storage':32} {'commit ms/round':>16} {'round ms':>10} {'commit share':>13}")
    for side, runs in figures.items():
        commit, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{side:32} {commit:16.1f} {wall:10.1f} {commit / wall:13.0%}")


if __name__ == "__main__":
    main()
