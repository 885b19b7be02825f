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


@dataclass(frozen=True)
class Evaluation:
    env_steps: int
    mean: float
    low: float
    high: float
    minutes: float  # from the run's start to this result's logging


def evaluations_of(tracking_uri: str, experiment: str, run_id: str | None) -> tuple[str, list[Evaluation]]:
    """The run's id (the experiment's newest run without `run_id`) and its evaluations by env steps."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if run_id is None:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise SystemExit(f"--experiment: no experiment {experiment!r} in {tracking_uri}")
        newest = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
        if not newest:
            raise SystemExit(f"--experiment: {experiment!r} has no runs in {tracking_uri}")
        run_id = newest[0].info.run_id
    started_ms = client.get_run(run_id).info.start_time
    histories = {key: {m.step: m for m in client.get_metric_history(run_id, f"eval/return_{key}")}
                 for key in ("mean", "min", "max")}
    rows = [Evaluation(step, mean.value, histories["min"][step].value, histories["max"][step].value,
                       (mean.timestamp - started_ms) / 60_000)
            for step, mean in sorted(histories["mean"].items())]
    return run_id, rows


def record(path: str, tracking_uri: str, run_id: str, rows: list[Evaluation], label: str) -> None:
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri).get_run(run_id).data.params
    line = {"label": label, "date": datetime.date.today().isoformat(), "mlflow_run_id": run_id,
            "preset": params.get("name"), "seed": params.get("seed"),
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
    run_id, rows = evaluations_of(args.tracking_uri, args.experiment, args.run_id)
    if args.record:
        record(args.record, args.tracking_uri, run_id, rows, args.label)
    print(f"run {run_id}: {len(rows)} evaluations")
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
