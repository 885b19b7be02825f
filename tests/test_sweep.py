"""Sweeps: a tiny sweep end to end under the real Prefect API, Dask workers, MLflow store and
Optuna's SQLite storage; a sweep SIGKILLed mid-way and started again ends with the same table and
trains no run twice; a pruned configuration shows as pruned in MLflow and Prefect; bad search
spaces are refused before any trial, one line each. And the aggregates against hand-computed
figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gymflow.errors import InvalidPreset
from gymflow.flows.cli import main
from gymflow.presets.load import load_preset
from gymflow.presets.sweep import check_sweep, sweep_spec
from gymflow.tasks.cluster.messages import EvaluationResult
from gymflow.tasks.sweep.aggregate import area_under_curve, interquartile_mean, iqm_with_interval
from gymflow.tasks.sweep.trial import SweepTrial, TrialJudge
from gymflow.tasks.training.evaluation import Scored
from tests.conftest import local_overrides, prefect_events

LEARNING_RATES = [0.01, 0.000001, 0.003]  # the second learns nothing by its first evaluation: pruned
# Seeds 3 and 4: their initial greedy policies walk the corridor the wrong way (seeds 0 and 2 already walk it
# right: PPO's action layer starts near zero, and its argmax goes either way), so learning nothing shows
FIRST_SEED = 3


def _spec(workspace: Path, tiny_budget: dict, **changes) -> dict:
    return {
        "preset": "cartpole-ppo",
        "overrides": {**tiny_budget, "schedule.total_env_steps": 1280, "seed": FIRST_SEED, **local_overrides(workspace)},
        "space": {"agent.lr": {"values": LEARNING_RATES}},
        "sampler": "grid",
        "seeds": 2,
        "study_storage": f"sqlite:///{workspace / 'sweeps.db'}",
        **changes,
    }


def _sweep_runs(workspace: Path, sweep_id: str) -> list:
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    return client.search_runs([client.get_experiment_by_name("gymflow").experiment_id],
                              f"tags.`gymflow.sweep_id` = '{sweep_id}'")


# --- the checks before any trial -------------------------------------------------------------

@pytest.mark.parametrize(("space", "field", "says"), [
    ({"agent.learning_rate": {"values": [0.1]}}, "space.agent.learning_rate", "no such preset field"),
    ({"agent.lr": {"low": 0.01, "high": 0.001}}, "space.agent.lr", "the range is empty"),
    ({"agent.lr": {"values": []}}, "space.agent.lr", "the list of values is empty"),
    ({"agent.lr": {"low": -1.0, "high": 0.1}}, "space.agent.lr", "-1.0 is not allowed"),
    ({"agent.epochs": {"values": [4, 0]}}, "space.agent.epochs", "0 is not allowed"),
    ({"agent.lr": {"low": 0.0, "high": 0.1, "log": True}}, "space.agent.lr", "log range needs low > 0"),
    ({"seed": {"values": [1, 2]}}, "space.seed", "cannot be searched"),
    ({"agent.lr": {"lo": 0.1}}, "space.agent.lr", "expected {values: [...]} or {low: L, high: H"),
])
def test_a_bad_search_space_is_refused_with_one_line_naming_the_field(space, field, says):
    with pytest.raises(InvalidPreset) as refused:
        check_sweep(sweep_spec({"space": space}))
    assert refused.value.field == field and says in refused.value.problem
    assert "\n" not in str(refused.value)


def test_the_grid_sampler_needs_lists_and_at_most_its_size_in_trials():
    with pytest.raises(InvalidPreset, match="^space.agent.lr: the grid sampler needs a list"):
        check_sweep(sweep_spec({"space": {"agent.lr": {"low": 0.001, "high": 0.01}}, "sampler": "grid"}))
    with pytest.raises(InvalidPreset, match="^trials: 5 is more than the grid's 4"):
        check_sweep(sweep_spec({"space": {"agent.lr": {"values": [0.1, 0.2]}, "agent.epochs": {"values": [1, 2]}},
                                "sampler": "grid", "trials": 5}))
    assert check_sweep(sweep_spec({"space": {"agent.lr": {"values": [0.1, 0.2]}, "agent.epochs": {"values": [1, 2]}},
                                   "sampler": "grid"})).configurations == 4


def test_the_command_line_refuses_a_bad_spec_before_anything_is_written(workspace, capsys):
    spec = {"space": {"agent.lr": {"low": 0.01, "high": 0.001}}, "study_storage": f"sqlite:///{workspace / 's.db'}"}
    (workspace / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(workspace / "spec.yaml")]) == 2
    assert capsys.readouterr().err == ("gymflow: error: space.agent.lr: the range is empty: low 0.01 must be below "
                                       "high 0.001\n")
    assert sorted(p.name for p in workspace.iterdir()) == ["spec.yaml"]


def test_a_sweep_refused_inside_its_flow_leaves_no_log_as_a_refused_run_does(prefect_api, workspace, tiny_budget,
                                                                              capsys, monkeypatch):
    """A study storage that cannot be opened is found inside the flow, after the sweep's log began: the refusal
    is one line and the log goes with it, as a refused run's does."""
    monkeypatch.chdir(workspace)
    spec = _spec(workspace, tiny_budget, study_storage=f"sqlite:///{workspace / 'no-such-folder' / 'sweeps.db'}")
    (workspace / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(workspace / "spec.yaml"), "--id", "refused"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].startswith("gymflow: error: study_storage: cannot open ") and "unable to open" in said[-1], said
    assert not (workspace / "gymflow-logs").exists() and not (workspace / "data").exists()


# --- the aggregates ----------------------------------------------------------------------------

def test_the_interquartile_mean_drops_the_best_and_worst_quarter():
    assert interquartile_mean(np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0])) == pytest.approx(3.5)
    assert interquartile_mean(np.array([1.0, 3.0])) == pytest.approx(2.0)  # two seeds: their mean


def test_the_interquartile_mean_is_scipy_s_trimmed_mean_of_a_quarter_at_each_end_for_any_number_of_runs():
    """gymflow computes it with numpy (scipy is not installed with gymflow alone); rliable's is scipy's."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for runs in range(1, 24):
        scores = rng.normal(size=runs) * 10
        assert interquartile_mean(scores) == pytest.approx(stats.trim_mean(scores, 0.25), rel=1e-12), runs


def test_the_bootstrap_interval_holds_the_estimate_and_is_the_same_each_time():
    scores = np.array([10.0, 12.0, 9.0, 30.0, 11.0])
    estimate = iqm_with_interval(scores)
    assert estimate.low <= estimate.value <= estimate.high
    assert 9.0 <= estimate.low and estimate.high <= 30.0 and estimate.high > estimate.low
    assert iqm_with_interval(scores) == estimate
    per_task = iqm_with_interval(np.stack([scores, scores + 100.0], axis=1))  # stratified: 2 tasks x 5 runs
    assert per_task.value == pytest.approx(interquartile_mean(np.concatenate([scores, scores + 100.0])))


def test_the_area_under_the_curve_is_the_mean_return_over_the_budget():
    assert area_under_curve([100, 200], [0.0, 10.0], 200) == pytest.approx((0.0 * 100 + 5.0 * 100) / 200)
    assert area_under_curve([100], [4.0], 400) == pytest.approx(4.0)  # held from step 0 to the end


# --- end to end --------------------------------------------------------------------------------

def test_a_resumed_run_judges_again_the_steps_its_stopped_start_reported_without_reporting_them_twice(tmp_path):
    """A stopped sweep's run resumes from its checkpoint and evaluates again the versions after it; Optuna
    ignored their second report with a UserWarning on the terminal."""
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    trial_id = optuna.create_study(study_name="resumed", storage=storage, direction="maximize").ask()._trial_id
    link = SweepTrial(sweep_id="resumed", study_storage=storage, trial_id=trial_id, configuration=0, seed=0,
                      reports=True, pruner="median")

    def scored(version: int, step: int, mean_return: float) -> Scored:
        return Scored(step, EvaluationResult(version, (mean_return,), (1,), 0.0))

    assert not TrialJudge(link).should_stop(scored(10, 1280, 0.5))  # the start that was stopped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = TrialJudge(link)
        assert not resumed.should_stop(scored(10, 1280, 0.5))
        assert not resumed.should_stop(scored(20, 2560, 0.75))
    (trial,) = optuna.load_study(study_name="resumed", storage=storage).trials
    assert trial.intermediate_values == {1280: 0.5, 2560: 0.75}


def _train_seed_spans(flow_run_id: str, runs: int) -> list[tuple]:
    """(start, end) of the sweep's train-seed task runs, by start. Their MLflow runs may not overlap
    though the tasks do: a subflow's creation on the SQLite Prefect API can meet "database is locked",
    answered 503, and the client retries after 2, 4, 8 s."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

    spans: list[tuple] = []
    for _ in range(40):  # task runs reach the API as events, shortly after they finish
        with get_client(sync_client=True) as client:
            found = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                          task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="train-c")))
        spans = sorted((run.start_time, run.end_time) for run in found if run.start_time and run.end_time)
        if len(spans) == runs:
            return spans
        time.sleep(0.25)
    raise AssertionError(f"{len(spans)} of the sweep's {runs} train-seed task runs reached the Prefect API: {spans}")


@pytest.mark.e2e
@pytest.mark.slow  # long tier (48-67 s: 4 runs of 10,240 steps): the sweep command's test below ranks, logs and names the best
def test_a_sweep_runs_each_configuration_over_seeds_and_reports_a_ranking(prefect_api, workspace, tiny_budget):
    from prefect.artifacts import Artifact

    from gymflow.flows.sweep import sweep

    spec = _spec(workspace, tiny_budget, space={"agent.lr": {"values": [0.01, 0.003]}}, concurrency=2,
                 overrides={**tiny_budget, "schedule.total_env_steps": 10240, **local_overrides(workspace)})
    result = sweep(spec, sweep_id="ranked")

    runs = _sweep_runs(workspace, "ranked")
    (parent,) = [run for run in runs if run.data.tags.get("gymflow.sweep.role") == "parent"]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4 and {run.info.status for run in children} == {"FINISHED"}
    assert sorted((run.data.params["agent.lr"], run.data.params["seed"]) for run in children) == [
        ("0.003", "0"), ("0.003", "1"), ("0.01", "0"), ("0.01", "1")]
    spans = _train_seed_spans(parent.data.tags["prefect.flow_run_id"], 4)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), f"concurrency 2 ran one at a time: {spans}"

    assert [row["outcome"] for row in result.ranking] == ["complete", "complete"]
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    for row in result.ranking:
        finals = [float(client.get_metric_history(run.info.run_id, "eval/return_mean")[-1].value) for run in children
                  if float(run.data.params["agent.lr"]) == row["agent.lr"]]
        assert row["final return IQM"] == pytest.approx(np.mean(finals), abs=1e-3)  # two seeds: their mean
    first, second = result.ranking
    assert (first["final return IQM"], first["AUC IQM"]) >= (second["final return IQM"], second["AUC IQM"])

    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"ranking.json", "ranking.md", "sweep_curves.png", "best-preset.yaml"} <= artifacts
    assert parent.info.status == "FINISHED" or client.get_run(parent.info.run_id).info.status == "FINISHED"
    best = load_preset(result.best_preset_url.removeprefix("file://"))  # `gymflow run` takes it as it is
    assert best.agent.lr == first["agent.lr"] and best.schedule.total_env_steps == 10240
    table = Artifact.get("sweep-ranking")
    assert table is not None and str(first["agent.lr"]) in str(table.data)
    (ended,) = prefect_events("gymflow.sweep.ranked", ["gymflow.sweep.finished"])
    assert ended.payload["best"] == first and ended.payload["best_preset"] == result.best_preset_url


@pytest.mark.e2e
def test_the_sweep_command_ranks_its_configurations_and_names_the_best_as_a_preset(prefect_api, workspace, tiny_budget,
                                                                                   capfd):
    """`gymflow sweep SPEC`, the verb itself (in this process: the long tier's concurrent sweeps run it as a
    command): what it prints a person can use."""
    spec = _spec(workspace, tiny_budget, space={"agent.lr": {"values": [0.01, 0.003]}}, seeds=1,
                 overrides={**tiny_budget, "seed": FIRST_SEED, **local_overrides(workspace)})
    (workspace / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(workspace / "spec.yaml"), "--id", "verb"]) == 0
    said = capfd.readouterr()
    assert "sweep verb: 2 configurations, 2 runs trained by this start" in said.out, said.out[-3000:]
    assert "distributed." not in said.err and "database tables" not in said.err, said.err[-3000:]
    assert "{'rank'" not in said.out + said.err  # the best configuration in words, not a dict
    best = said.out.split("best configuration as a preset: ")[1].split()[0]
    assert load_preset(best).agent.lr in (0.01, 0.003)  # a path `gymflow run` and `show` take
    runs = _sweep_runs(workspace, "verb")
    (parent,) = [run for run in runs if run.data.tags.get("gymflow.sweep.role") == "parent"]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and {run.info.status for run in children} == {"FINISHED"}
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"ranking.json", "ranking.md", "sweep_curves.png", "best-preset.yaml"} <= artifacts
    (ended,) = prefect_events("gymflow.sweep.verb", ["gymflow.sweep.finished"])
    assert ended.payload["best_preset"].removeprefix("file://") == best


def _killed_after_a_checkpoint_of_its_third_run(workspace: Path, spec: dict, sweep_id: str) -> None:
    """Start the sweep in its own process, SIGKILL it (and its Dask workers) once the third run
    of the sweep has committed a checkpoint."""
    from prefect.settings import PREFECT_API_URL

    code = ("import json, sys\nfrom gymflow.flows.sweep import sweep\n"
            "if __name__ == '__main__':\n    sweep(json.loads(sys.argv[1]), sweep_id=sys.argv[2])")
    flow = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), sweep_id],
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    third = Path(spec["overrides"]["storage.root"]) / "runs" / f"{sweep_id}-c001-s{FIRST_SEED}" / "checkpoints"
    deadline = time.monotonic() + 240
    while not list(third.glob("v*/manifest.json")):
        assert flow.poll() is None and time.monotonic() < deadline, "the sweep ended before it could be killed"
        time.sleep(0.05)
    os.killpg(flow.pid, signal.SIGKILL)
    flow.wait()


@pytest.mark.slow  # long tier: a sweep killed and restarted; the sweep ranking stays in
@pytest.mark.e2e
def test_a_killed_sweep_restarts_to_the_same_table_without_training_a_run_twice(prefect_api, workspace, tiny_budget):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from gymflow.flows.sweep import sweep

    spec = _spec(workspace, tiny_budget, pruner="median")
    clean = sweep(spec, sweep_id="clean")
    assert [row["outcome"] for row in clean.ranking] == ["complete", "complete", "pruned"]
    assert clean.ranking[2]["agent.lr"] == LEARNING_RATES[1] and clean.ranking[2]["seeds"] == 1  # its second seed never ran

    _killed_after_a_checkpoint_of_its_third_run(workspace, spec, "killed")
    study = optuna.load_study(study_name="killed", storage=spec["study_storage"])
    assert [trial.state for trial in study.trials] == [optuna.trial.TrialState.COMPLETE,
                                                       optuna.trial.TrialState.RUNNING]
    restarted = sweep(spec, sweep_id="killed")

    assert restarted.ranking == clean.ranking  # the same numbers: SYNC runs resume exactly
    assert restarted.runs_trained == 3  # c001's first seed (resumed), c002's two; c000's two were kept
    finished = [run for run in _sweep_runs(workspace, "killed") if "mlflow.parentRunId" in run.data.tags]
    assert len(finished) == 5 and {run.info.status for run in finished} == {"FINISHED"}  # no run trained twice
    (pruned,) = [run for run in finished if run.data.tags.get("gymflow.sweep.pruned") == "true"]
    assert pruned.data.tags["gymflow.run_id"] == f"killed-c001-s{FIRST_SEED}"
    assert pruned.data.tags.get("prefect.flow_run_id.resumed")  # resumed from its checkpoint, in its own run

    async def pruned_state() -> str:
        async with get_client() as client:
            (run,) = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[f"killed-c001-s{FIRST_SEED} (resumed)"])))
            return run.state.name

    import asyncio

    assert asyncio.run(pruned_state()) == "Pruned"


@pytest.mark.slow  # long tier: single mode's twin is tests/test_single.py (a run, byte-identical to SYNC)
@pytest.mark.e2e
def test_a_sweep_in_single_mode_ranks_as_the_same_sweep_on_a_cluster(prefect_api, workspace, tiny_budget):
    """Each trial's jobs run in the trial's own thread of the sweep's process, two trials at once,
    and every trial ends as it does on the LocalCluster (single and sync runs are the same)."""
    from gymflow.flows.sweep import sweep

    spec = _spec(workspace, tiny_budget, concurrency=2)
    synced = sweep(spec, sweep_id="synced")
    single = sweep({**spec, "overrides": {**spec["overrides"], "distribution.mode": "single"}}, sweep_id="single")

    assert single.ranking == synced.ranking
    assert [row["outcome"] for row in single.ranking] == ["complete"] * len(LEARNING_RATES)
    trials = [run for run in _sweep_runs(workspace, "single") if "mlflow.parentRunId" in run.data.tags]
    assert len(trials) == 2 * len(LEARNING_RATES)
    assert {run.data.params["distribution.mode"] for run in trials} == {"single"}


def _final_policies(workspace: Path, sweep_id: str) -> dict[str, bytes]:
    from gymflow.tasks.storage.checkpoints import latest_version, read_policy
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    storage = Storage(StorageLocation(str(workspace / "data")))
    runs = sorted(path.name for path in (workspace / "data" / "runs").glob(f"{sweep_id}-c*"))
    policies = {}
    for run_id in runs:
        layout = RunLayout(run_id)
        blobs = read_policy(storage, layout, latest_version(storage, layout))
        policies[run_id.removeprefix(sweep_id)] = b"".join(blobs[name] for name in sorted(blobs))
    return policies


@pytest.mark.slow  # long tier (91 s): `gymflow sweep` itself stays in through test_the_sweep_command_ranks...
@pytest.mark.e2e
# [5]: 170 s on the AVX-512 kind beside another test, past 300 s on the AVX2 kind
@pytest.mark.parametrize("attempts", [3, pytest.param(5, marks=[pytest.mark.slow, pytest.mark.timeout(900)])])
def test_the_same_concurrent_sweep_run_again_ends_with_the_same_weights_for_every_run(
        prefect_api, workspace, tiny_budget, attempts):
    """Two trials at once share the sweep's process (their learners) and its LocalCluster's
    workers (their jobs): neither may change the other's results, whatever the timing. Each sweep
    starts in a fresh process, as `gymflow sweep` does: its first two trials wait on the same
    first imports, then build their learners at the same moment."""
    from prefect.settings import PREFECT_API_URL

    spec = _spec(workspace, tiny_budget, space={"agent.lr": {"values": [0.01, 0.003]}}, concurrency=2)
    code = ("import json, sys\nfrom gymflow.flows.sweep import sweep\n"
            "if __name__ == '__main__':\n    sweep(json.loads(sys.argv[1]), sweep_id=sys.argv[2])")
    (workspace / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    finals = []
    for attempt in range(attempts):
        if attempt == 0:  # the command line itself, once: what it prints a person can use
            done = subprocess.run([str(Path(sys.executable).with_name("gymflow")), "sweep", str(workspace / "spec.yaml"),
                                   "--id", "again0"], env=env, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "distributed." not in done.stderr and "database tables" not in done.stderr, done.stderr[-3000:]
            assert "{'rank'" not in done.stderr  # the best configuration in words, not a dict
            best = done.stdout.split("best configuration as a preset: ")[1].split()[0]
            assert load_preset(best).agent.lr in (0.01, 0.003)  # a path `gymflow run` and `show` take
        else:
            subprocess.run([sys.executable, "-c", code, json.dumps(spec), f"again{attempt}"], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=240)
        finals.append(_final_policies(workspace, f"again{attempt}"))
    assert sorted(finals[0]) == [f"-c00{c}-s{FIRST_SEED + s}" for c in range(2) for s in range(2)]
    for attempt, policies in enumerate(finals[1:], start=1):
        differing = [run for run in finals[0] if policies[run] != finals[0][run]]
        assert not differing, f"sweep {attempt} ended these runs with other weights than sweep 0: {differing}"
