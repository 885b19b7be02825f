"""A run's evaluations as they were logged: env steps, greedy return (mean, min, max) and the
minutes from the run's start to the moment each evaluation's result reached MLflow; with
`--target`, the first one at or above it. Reads the run's MLflow store only, so it also reads a
run that was stopped mid-way (a time-boxed run on a lent GPU machine, `benchmarks/gpu_session.sh`
stage `pong`).

    .venv/bin/python benchmarks/evaluation_history.py --tracking-uri sqlite:///mlflow.db --target 18
    .venv/bin/python benchmarks/evaluation_history.py --tracking-uri sqlite:///mlflow.db --run-id RUN_ID
    ... --record benchmarks/records/pong-appo.jsonl --label "pong-appo seed 1, H100, 14 x 8"

`--record` appends the run's evaluations as one JSON line (with `--label`, the date and the run's
params: preset, seed), so seeds run in different sessions can be put side by side later.

The minutes are wall-clock from the MLflow run's start (the flow's first step, after the cluster
and the Prefect API are up) to the evaluation's logging: an ASYNC run evaluates a version while it
trains on, so the time counts the evaluation itself too.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass

from gymflow.tasks.tracking.tracker import evaluation_histories


@dataclass(frozen=True)
class Evaluation:
    env_steps: int
    mean: float
    low: float
    high: float
    minutes: float  # from the run's start to this result's logging


def newest_run_id(client, experiment: str, tracking_uri: str) -> str:
    """The id of `experiment`'s newest run."""
    found = client.get_experiment_by_name(experiment)
    newest = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"],
                                max_results=1) if found else []
    if not newest:
        raise SystemExit(f"--experiment: no run of an experiment {experiment!r} in {tracking_uri}")
    return newest[0].info.run_id


def evaluations_of(client, run) -> list[Evaluation]:
    """The MLflow `run`'s evaluations by env steps, with the minutes from its start to each."""
    mean, low, high, _ = evaluation_histories(client, run.info.run_id)
    return [Evaluation(step, metric.value, low[step].value, high[step].value,
                       (metric.timestamp - run.info.start_time) / 60_000)
            for step, metric in sorted(mean.items())]


def record(path: str, run, rows: list[Evaluation], label: str) -> None:
    """Append the run's evaluations to the JSON-lines file at `path`."""
    line = {"label": label, "date": datetime.date.today().isoformat(), "mlflow_run_id": run.info.run_id,
            "preset": run.data.params.get("name"), "seed": run.data.params.get("seed"),
            "evaluations": [asdict(row) for row in rows]}
    with open(path, "a") as records:
        records.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="gymflow")
    parser.add_argument("--run-id", default=None, help="default: the experiment's newest run")
    parser.add_argument("--target", type=float, default=None, help="say which evaluation first reached this return")
    parser.add_argument("--record", default=None, help="append the run's evaluations to this JSON-lines file")
    parser.add_argument("--label", default="", help="with --record: what the run was (machine, settings)")
    args = parser.parse_args()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(args.tracking_uri)
    run = client.get_run(args.run_id or newest_run_id(client, args.experiment, args.tracking_uri))
    rows = evaluations_of(client, run)
    if args.record:
        record(args.record, run, rows, args.label)
    print(f"run {run.info.run_id}: {len(rows)} evaluations")
    print(f"{'env steps':>12} {'mean':>8} {'min':>8} {'max':>8} {'minutes':>8}")
    for row in rows:
        print(f"{row.env_steps:>12,} {row.mean:>8.2f} {row.low:>8.2f} {row.high:>8.2f} {row.minutes:>8.2f}")
    if args.target is not None:
        reached = next((row for row in rows if row.mean >= args.target), None)
        print(f"target {args.target:g}: " + (f"first reached at {reached.env_steps:,} env steps, "
                                              f"{reached.minutes:.2f} minutes from the run's start"
                                              if reached else "not reached"))


if __name__ == "__main__":
    main()
