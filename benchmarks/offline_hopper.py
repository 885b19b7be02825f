"""Offline RL on Hopper-v5 from experience gymflow makes itself: IQL against behaviour cloning and
against the dataset's own mean episode return, seed by seed, with D4RL's published figures for the
same kind of dataset beside them as context.

    .venv/bin/pip install -e ".[bench,mujoco,lake]"
    .venv/bin/python benchmarks/offline_hopper.py --source-steps 100000 --train-steps 200000 --seeds 0 1 2 \
        --online-steps 50000 --folder /tmp/offline-hopper --record benchmarks/records/offline-hopper.jsonl

The dataset: every transition of a SAC run (the halfcheetah-sac preset's rl-zoo settings on
Hopper-v5) of `--source-steps` env steps, kept whole (`storage.keep_shards: all`) and exported
with `gymflow export`: random heatup, then a policy that improves from nothing to where the run
stopped. That is D4RL's "medium-replay" kind (the replay buffer of a policy trained to a medium
level). `--kind medium` is D4RL's other kind: as many env steps of that run's final policy, fixed,
sampling its actions (a collect-only run: schedule.total_train_steps 0, warm-started from it).
Each is made once in `--folder` and reused. Then, for each seed, `hopper-iql` (the IQL
paper's locomotion settings) and BC (the same networks, `agent.algo: bc`) each train
`--train-steps` gradient steps on it, offline, the two alternating which goes first (the VM
drifts); their final greedy evaluation (10 episodes) is the figure.

Offline to online (`--online-steps N`): each seed's IQL run goes on collecting for N env steps,
its whole learner carried over (`warm_start=learner:RUN_ID`) and the dataset in its memory, at
the source run's collection settings (2 workers x 1 env x 32 steps, 64 gradient steps a round);
the figure is the first evaluation at which it reaches the SAC source run's final return, against
the env steps that source run, learning from scratch, took to reach it.

Scores are also given D4RL-normalised: 100 x (return - random) / (expert - random), with D4RL's
Hopper references (random -20.27, expert 3234.3). Context, not a target (other data, other
budgets: 1M gradient steps, Hopper-v2): the IQL paper's Table 1 on hopper-medium-replay-v2, BC
18.1 and IQL 94.7; on hopper-medium-v2, BC 52.9 and IQL 66.3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

EVALUATION_EPISODES = 10
HOPPER_RANDOM, HOPPER_EXPERT = -20.272305, 3234.3  # D4RL's reference scores for Hopper
D4RL_CONTEXT = {"hopper-medium-replay-v2": {"bc": 18.1, "iql": 94.7}, "hopper-medium-v2": {"bc": 52.9, "iql": 66.3}}
LEARNERS = {  # preset and the fields that make it BC or IQL on Hopper with the same networks
    "iql": ("hopper-iql", {}),
    "bc": ("hopper-iql", {"agent": {"algo": "bc", "lr": 3e-4, "batch_size": 256, "replay_capacity": 2_000_000,
                                    "train_steps_per_iteration": 1000, "hidden_sizes": [256, 256],
                                    "normalize_observations": True}}),
}


def normalised(score: float) -> float:
    return 100.0 * (score - HOPPER_RANDOM) / (HOPPER_EXPERT - HOPPER_RANDOM)


def tracking(folder: str) -> dict:
    return {"tracking.tracking_uri": f"sqlite:///{folder}/mlflow.db", "tracking.artifact_location": f"{folder}/mlart"}


ONLINE = {"schedule.rollout_steps_per_env": 32, "agent.train_steps_per_iteration": 64}  # the source run's collection


def first_reaching(evaluations: list[list[float]], level: float) -> int | None:
    """The env steps of the first evaluation (step, mean) at `level` or above; None: never."""
    return next((int(step) for step, mean in evaluations if mean >= level), None)


def source_run(folder: str, source_steps: int) -> dict:
    """The SAC run the datasets come from (made once per budget, every shard kept): its run id,
    storage root, delivered version, final return and evaluations."""
    record = os.path.join(folder, f"source-{source_steps}.json")
    if not os.path.exists(record):
        from gymflow.flows.improve import improve

        source = os.path.join(folder, f"source-{source_steps}")
        run = improve("halfcheetah-sac", {"env.id": "Hopper-v5", "schedule.total_env_steps": source_steps,
                                          "storage.keep_shards": "all", "storage.root": source, **tracking(folder)})
        print(f"source run {run.run_id}: final greedy return {run.final_return:.1f}", flush=True)
        with open(record, "w") as out:
            json.dump({"run_id": run.run_id, "root": source, "version": run.delivered_version,
                       "final_return": run.final_return,
                       "evaluations": [[row.env_steps, row.mean] for row in run.evaluations]}, out)
    with open(record) as saved:
        return json.load(saved)


def collected_by_the_final_policy(folder: str, source: dict, steps: int) -> tuple[str, str]:
    """(storage root, run id) of a collect-only run (schedule.total_train_steps 0) acting with the
    source run's delivered policy, sampling its actions, for `steps` env steps."""
    from gymflow.flows.improve import improve
    from gymflow.tasks.storage.checkpoints import read_policy
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    policy = os.path.join(folder, f"medium-policy-{steps}.safetensors")
    blobs = read_policy(Storage(StorageLocation(source["root"])), RunLayout(source["run_id"]), source["version"])
    with open(policy, "wb") as out:
        out.write(blobs["policy.safetensors"])
    root = os.path.join(folder, f"medium-{steps}")
    run = improve("halfcheetah-sac", {"env.id": "Hopper-v5", "schedule.total_env_steps": steps,
                                      "schedule.total_train_steps": 0, "schedule.heatup_env_steps": 0,
                                      "storage.root": root, **tracking(folder)}, warm_start=policy)
    return root, run.run_id


def make_dataset(folder: str, source_steps: int, kind: str) -> tuple[str, str, float, dict]:
    """(datasets root, dataset id, the dataset's mean episode return, the source run): made once
    per budget and kind."""
    import minari
    import numpy as np

    from gymflow.tasks.lake.export import DatasetRequest, export_run
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    source = source_run(folder, source_steps)
    root, dataset_id = os.path.join(folder, "datasets"), f"gymflow/hopper-sac-{kind}-{source_steps}-v0"
    data = os.path.join(root, dataset_id, "data")
    if not os.path.exists(os.path.join(data, "metadata.json")):
        run_root, run_id = (source["root"], source["run_id"]) if kind == "medium-replay" \
            else collected_by_the_final_policy(folder, source, source_steps)
        export_run(Storage(StorageLocation(run_root)), run_id, Storage(StorageLocation(root)), DatasetRequest(dataset_id))
    episodes = minari.MinariDataset(data)
    return root, dataset_id, float(np.mean([float(np.sum(episode.rewards)) for episode in episodes])), source


def train_offline(learner: str, seed: int, train_steps: int, root: str, dataset_id: str, folder: str
                  ) -> tuple[float, float, str]:
    """(final greedy return, seconds, run id) of one offline run."""
    from gymflow.flows.improve import improve

    preset, fields = LEARNERS[learner]
    started = time.perf_counter()
    summary = improve(preset, {
        **fields, "seed": seed, "dataset.root": root, "dataset.id": dataset_id,
        "schedule.total_train_steps": train_steps, "schedule.evaluate_every_train_steps": max(train_steps // 10, 1),
        "schedule.evaluation_episodes": EVALUATION_EPISODES,
        "storage.root": os.path.join(folder, f"{learner}-{seed}"), **tracking(folder),
    })
    return summary.final_return, time.perf_counter() - started, summary.run_id


def continue_online(seed: int, offline_run: str, online_steps: int, root: str, dataset_id: str, folder: str,
                    level: float) -> list:
    """[env steps to reach `level` (None: not within the budget), final greedy return, seconds] of
    the IQL run `offline_run` continued online, its whole learner and its dataset carried over."""
    from gymflow.flows.improve import improve

    started = time.perf_counter()
    summary = improve("hopper-iql", {
        **ONLINE, "seed": seed, "dataset.root": root, "dataset.id": dataset_id,
        "schedule.total_env_steps": online_steps, "schedule.evaluate_every_env_steps": max(online_steps // 10, 64),
        "schedule.evaluation_episodes": EVALUATION_EPISODES,
        "storage.root": os.path.join(folder, f"iql-{seed}"), **tracking(folder),
    }, warm_start=f"learner:{offline_run}")
    reached = first_reaching([[row.env_steps, row.mean] for row in summary.evaluations], level)
    return [reached, summary.final_return, time.perf_counter() - started]


def recorded(record: str | None, key: dict) -> list[dict]:
    if record is None or not os.path.exists(record):
        return []
    with open(record) as lines:
        entries = [json.loads(line) for line in lines if line.strip()]
    return [entry for entry in entries if all(entry[k] == v for k, v in key.items())]


def run_seed(seed: int, args: argparse.Namespace, root: str, dataset_id: str, source_final: float,
             offline: dict | None) -> dict:
    """The seed's IQL and BC runs (or, `offline`, their recorded figures), then IQL online."""
    if offline is None:
        order = ["iql", "bc"] if seed % 2 == 0 else ["bc", "iql"]
        results = {learner: train_offline(learner, seed, args.train_steps, root, dataset_id, args.folder)
                   for learner in order}
        row = {learner: list(result[:2]) for learner, result in results.items()} | {"iql_run": results["iql"][2]}
    else:  # recorded by an offline-only invocation of the same budget: continued, not trained again
        row = {"iql": offline["iql"], "bc": offline["bc"],
               "iql_run": offline.get("iql_run") or first_run(os.path.join(args.folder, f"iql-{seed}"))}
    print(f"seed {seed}: " + ", ".join(f"{k} {row[k][0]:.1f} ({normalised(row[k][0]):.1f}) in {row[k][1]:.0f} s"
                                       for k in ("bc", "iql")), flush=True)
    if args.online_steps:
        row["online"] = continue_online(seed, row["iql_run"], args.online_steps, root, dataset_id, args.folder,
                                        source_final)
        print(f"seed {seed}: IQL online from its offline learner: reached {source_final:.1f} at "
              f"{row['online'][0]} env steps, final {row['online'][1]:.1f}", flush=True)
    return row


def first_run(storage_root: str) -> str:
    """The first run under a storage root (run ids begin with their start time): a seed's offline
    IQL run, which its online continuation follows in the same root."""
    return sorted(os.listdir(os.path.join(storage_root, "runs")))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source-steps", type=int, default=100_000, help="env steps of the SAC run that makes the data")
    parser.add_argument("--train-steps", type=int, default=200_000, help="gradient steps of every offline run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--kind", choices=["medium-replay", "medium"], default="medium-replay",
                        help="the SAC run's own experience, or as many env steps of its final policy's (collect only)")
    parser.add_argument("--online-steps", type=int, default=0, help="env steps of each IQL run continued online "
                                                                      "(0: none); a seed whose offline runs are "
                                                                      "recorded (online 0) continues its IQL run")
    parser.add_argument("--folder", required=True, help="where the dataset, runs and MLflow store go (reused)")
    parser.add_argument("--record", help="a JSON-lines file: finished seeds are kept there and not run again")
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    root, dataset_id, data_mean, source = make_dataset(args.folder, args.source_steps, args.kind)
    key = {"source_steps": args.source_steps, "train_steps": args.train_steps, "online_steps": args.online_steps,
           "kind": args.kind}
    rows = recorded(args.record, key)
    offline = {row["seed"]: row for row in recorded(args.record, {**key, "online_steps": 0})}
    for seed in [s for s in args.seeds if s not in {row["seed"] for row in rows}]:
        row = run_seed(seed, args, root, dataset_id, source["final_return"], offline.get(seed))
        rows.append({**key, "seed": seed, **row, "dataset_mean": data_mean, "date": time.strftime("%Y-%m-%d %H:%M"),
                     "cores": os.cpu_count()})
        if args.record:
            with open(args.record, "a") as lines:
                lines.write(json.dumps(rows[-1]) + "\n")
    report(sorted(rows, key=lambda row: row["seed"]), data_mean, args)
    if args.online_steps:
        report_online(rows, source)


def report(rows: list[dict], data_mean: float, args: argparse.Namespace) -> None:
    print(f"\nmachine: {os.cpu_count()} cores; Hopper-v5, {args.kind}: a SAC run's {args.source_steps:,} env steps "
          "(medium: its final policy's) as the dataset "
          f"(mean episode return {data_mean:.1f}, normalised {normalised(data_mean):.1f}); "
          f"{args.train_steps:,} gradient steps; final greedy return over {EVALUATION_EPISODES} episodes")
    print(f"{'seed':>4} {'IQL':>9} {'norm':>6} {'s':>6}   {'BC':>9} {'norm':>6} {'s':>6}")
    for row in rows:
        (i_return, i_s), (b_return, b_s) = row["iql"], row["bc"]
        print(f"{row['seed']:>4} {i_return:>9.1f} {normalised(i_return):>6.1f} {i_s:>6.0f}   "
              f"{b_return:>9.1f} {normalised(b_return):>6.1f} {b_s:>6.0f}")
    iql, bc = (statistics.median(row[k][0] for row in rows) for k in ("iql", "bc"))
    print(f"median: IQL {iql:.1f} ({normalised(iql):.1f}), BC {bc:.1f} ({normalised(bc):.1f}), dataset mean "
          f"{data_mean:.1f} ({normalised(data_mean):.1f}); IQL > BC: {iql > bc}, IQL > dataset: {iql > data_mean}")
    for name, scores in D4RL_CONTEXT.items():
        print(f"context, IQL paper Table 1, {name} (normalised): BC {scores['bc']}, IQL {scores['iql']}")


def report_online(rows: list[dict], source: dict) -> None:
    level = source["final_return"]
    from_scratch = first_reaching(source["evaluations"], level)
    print(f"\noffline to online: env steps to reach the SAC source run's final return {level:.1f} "
          f"(from scratch, the source run itself: {from_scratch:,})")
    for row in sorted(rows, key=lambda row: row["seed"]):
        reached, final, seconds = row["online"]
        print(f"{row['seed']:>4} IQL continued: {'not reached' if reached is None else f'{reached:,}'} "
              f"(final {final:.1f}, {seconds:.0f} s)")


if __name__ == "__main__":
    main()
