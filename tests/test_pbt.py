"""Population-based training (`sampler: pbt`): its decisions against hand-worked populations
(the quantiles, perturbations inside their ranges, a finished member copied but not copying), a
pinned checkpoint kept whatever the retention, bad specs refused in one line before any member
starts; and a tiny population end to end under the real Prefect API, Dask workers and MLflow
store: copies made, the copier's settings applied after the copy, and a sweep SIGKILLed mid-way
and started again ending with the same lineage and the same weights for every member."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from mlflow.tracking import MlflowClient

from gymflow.errors import InvalidPreset
from gymflow.presets.sweep import check_sweep, sweep_spec
from gymflow.tasks.sweep.pbt import (
    MemberResult,
    check_perturbable,
    explored,
    first_plan,
    next_plan,
    pause_points,
)
from tests.conftest import local_overrides

SPACE = {"agent.lr": {"low": 0.0001, "high": 0.01, "log": True}, "agent.clip_range": {"values": [0.1, 0.2, 0.3]}}


def _spec(**changes) -> dict:
    return {"preset": "cartpole-ppo", "space": SPACE, "sampler": "pbt",
            "overrides": {"schedule.total_env_steps": 10_000}, "pbt": {"population": 4, "interval": 2_000},
            **changes}


def _result(member: int, score: float, finished: bool = False, interval: int = 0) -> MemberResult:
    return MemberResult(member, interval, f"s-m{member:03d}", "mlflow", score, 10 + member, 2_000, finished, score, ())


# --- the checks before any member starts ---------------------------------------------------

@pytest.mark.parametrize(("changes", "field", "says"), [
    ({"pbt": {"interval": 10_000}}, "pbt.interval", "is not shorter than the budget (10,000 env steps)"),
    ({"pbt": {"interval": 2_000, "quantile": 0.5}}, "pbt.quantile", "less than 0.5"),
    ({"space": {"env.id": {"values": ["CartPole-v1"]}}}, "space.env.id", "cannot be perturbed"),
    ({"seeds": 3}, "seeds", "each member of a pbt sweep is one run"),
    ({"pruner": "median"}, "pruner", "allowed: none"),
    ({"sampler": "tpe"}, "sampler", "pbt settings are for sampler pbt"),
    ({"pbt": None}, "pbt", "sampler pbt needs its settings"),
    ({"preset": "cartpole-appo"}, "distribution.mode", "single or sync mode"),
    ({"preset": "cartpole-dqn", "space": {"agent.lr": {"low": 0.001, "high": 0.01}}}, "storage.checkpoint_replay",
     "takes the source's replay memory from its checkpoint"),
])
def test_a_bad_pbt_spec_is_refused_with_one_line_naming_the_field(changes, field, says):
    with pytest.raises(InvalidPreset) as raised:
        check_sweep(sweep_spec(_spec(**changes)))
    assert raised.value.field == field and says in raised.value.problem and "\n" not in str(raised.value)


def test_a_field_that_changes_the_learners_tensors_cannot_be_perturbed():
    spec = _spec(space={"agent.recurrent": {"values": [16, 32]}})
    with pytest.raises(InvalidPreset) as raised:
        check_perturbable(check_sweep(sweep_spec(spec)))
    assert raised.value.field == "space.agent.recurrent" and "changes the learner's tensors" in raised.value.problem
    check_perturbable(check_sweep(sweep_spec(_spec())))  # lr and clip range: the same tensors


def test_a_field_that_changes_an_off_policy_members_replay_memory_cannot_be_perturbed():
    spec = {**_spec(preset="cartpole-dqn", space={"agent.replay_capacity": {"values": [5_000, 10_000]}}),
            "overrides": {"schedule.total_env_steps": 10_000, "storage.checkpoint_replay": True}}
    with pytest.raises(InvalidPreset) as raised:
        check_perturbable(check_sweep(sweep_spec(spec)))
    assert raised.value.field == "space.agent.replay_capacity" and "replay memory" in raised.value.problem
    spec["space"] = {"agent.lr": {"low": 0.0001, "high": 0.01, "log": True}}
    check_perturbable(check_sweep(sweep_spec(spec)))


# --- the decisions ----------------------------------------------------------------------------

def test_the_worst_quantile_copies_the_best_and_goes_on_with_perturbed_values():
    sweep = check_sweep(sweep_spec(_spec(pbt={"population": 8, "interval": 2_000, "quantile": 0.25})))
    plan = first_plan(sweep, "s")
    assert pause_points(sweep) == [2_000, 4_000, 6_000, 8_000, None]
    assert len({member.settings["agent.lr"] for member in plan}) == 8  # drawn per member
    scores = [5.0, 80.0, 10.0, 70.0, 60.0, 1.0, 50.0, 40.0]  # best: 1, 3; worst: 5, 0
    decided = next_plan(sweep, plan, [_result(m, score) for m, score in enumerate(scores)])

    assert [member.interval for member in decided] == [1] * 8 and {m.pause_at for m in decided} == {4_000}
    copies = {member.member: member.copy_from for member in decided if member.copy_from}
    assert sorted(copies) == [0, 5]
    for copier, copy in copies.items():
        assert copy.source in (1, 3) and copy.source_run_id == f"s-m{copy.source:03d}"
        assert copy.version == 10 + copy.source and copy.at_version == 10 + copier
        assert copy.settings_before == plan[copier].settings
        lr_before = plan[copy.source].settings["agent.lr"]
        lr = decided[copier].settings["agent.lr"]
        assert 0.0001 <= lr <= 0.01 and (lr in (pytest.approx(lr_before * 0.8), pytest.approx(lr_before * 1.2))
                                         or lr not in (lr_before,))
    for member in decided:
        if member.member not in copies:
            assert member.settings == plan[member.member].settings  # the others go on as they are
    assert next_plan(sweep, plan, [_result(m, score) for m, score in enumerate(scores)]) == decided  # seeded


def test_a_quantile_never_makes_a_member_both_source_and_copier_and_a_finished_member_copies_nothing():
    sweep = check_sweep(sweep_spec(_spec(pbt={"population": 3, "interval": 2_000, "quantile": 0.49})))
    plan = first_plan(sweep, "s")
    decided = next_plan(sweep, plan, [_result(0, 1.0), _result(1, 3.0), _result(2, 2.0)])
    assert [(m.member, m.copy_from.source if m.copy_from else None) for m in decided] == [(0, 1), (1, None), (2, None)]
    finished = next_plan(sweep, plan, [_result(0, 1.0, finished=True), _result(1, 3.0), _result(2, 2.0)])
    assert [m.member for m in finished] == [1, 2] and not any(m.copy_from for m in finished)


def test_a_member_that_ended_is_copied_from_a_checkpoint_it_kept(tmp_path):
    """A member that finished at its target delivers the version its deciding evaluation scored,
    whose checkpoint exists only where the cadence landed on it: a copier takes that one where it
    does, else the run's newest checkpoint (its end); a paused member's own checkpoint is its pause."""
    from gymflow.tasks.storage.checkpoints import commit_checkpoint
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.training.summary import RunSummary

    storage, layout = Storage(StorageLocation(str(tmp_path))), RunLayout("s-m000")
    for version in (0, 2, 6):  # the cadence's and the end's
        commit_checkpoint(storage, layout, version, {"learner.safetensors": bytes([version])})
    member = first_plan(check_sweep(sweep_spec(_spec(pbt={"population": 2, "interval": 2_000}))), "s")[0]

    def ended_at(delivered: int, paused: bool = False) -> int:
        summary = RunSummary("s-m000", "mlflow", "file:///", delivered_version=delivered, final_return=1.0, paused=paused)
        return MemberResult.of(member, summary, 2, storage).version

    assert ended_at(4) == 6 and ended_at(2) == 2 and ended_at(6) == 6
    assert ended_at(4, paused=True) == 4  # never asked: a pause is checkpointed where it pauses


def test_explored_values_stay_inside_their_ranges_and_lists():
    sweep = check_sweep(sweep_spec(_spec(space={"agent.lr": {"low": 0.001, "high": 0.002},
                                                "agent.epochs": {"low": 1, "high": 4, "integer": True},
                                                "agent.clip_range": {"values": [0.1, 0.2]}},
                                         pbt={"population": 2, "interval": 2_000, "resample_probability": 0.0})))
    rng = np.random.default_rng(0)
    for _ in range(50):
        values = explored(sweep, {"agent.lr": 0.002, "agent.epochs": 4, "agent.clip_range": 0.2}, rng)
        assert values["agent.lr"] in (pytest.approx(0.0016), 0.002)  # x1.2 clamped to the range's top
        assert values["agent.epochs"] in (3, 4) and isinstance(values["agent.epochs"], int)
        assert values["agent.clip_range"] in (0.1, 0.2)


def test_a_pinned_checkpoint_outlives_the_retention_until_it_is_let_go(workspace):
    from gymflow.presets.load import load_preset
    from gymflow.presets.validate import experiment_from
    from gymflow.tasks.storage.checkpoints import committed_versions
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.storage.retention import ShardFloor
    from gymflow.tasks.training.commits import Commits
    from gymflow.tasks.training.learning import create_learner
    from gymflow.tasks.training.state import LoopState

    preset = load_preset("cartpole-ppo", {"storage.keep_checkpoints": 1})
    learner = create_learner(experiment_from(preset))
    storage, layout = Storage(StorageLocation(str(workspace / "data"))), RunLayout("source")
    commits = Commits(storage, "source", preset.storage, policy_window=1)
    commits.pinnable = True
    floor = ShardFloor(workers=1, heatup=False)
    commits.checkpoint(learner, LoopState.start(1, 100), floor)
    storage.write(layout.pin(0, "copier"), b"")
    for version in (1, 2):
        commits.checkpoint(learner, LoopState.start(1, 100).committed(100) if version == 1 else
                           LoopState(2, 0, 100, (None,)), floor)
        commits.retirement.wait()
    assert committed_versions(storage, layout) == [0, 2]  # v1 retired, v0 kept for its copier
    storage.delete([layout.pin(0, "copier")])
    commits.checkpoint(learner, LoopState(3, 0, 100, (None,)), floor)
    commits.close()
    assert committed_versions(storage, layout) == [3]


# --- a population end to end ------------------------------------------------------------------

def _e2e_spec(workspace: Path, tiny_budget: dict) -> dict:
    return {
        "preset": "cartpole-ppo",
        "overrides": {**tiny_budget, "schedule.total_env_steps": 1024, "seed": 3, "agent.anneal_lr": False,
                      "agent.anneal_clip_range": False, "storage.keep_checkpoints": 100, **local_overrides(workspace)},
        "space": {"agent.lr": {"low": 0.000001, "high": 0.03, "log": True}, "agent.clip_range": {"values": [0.1, 0.3]}},
        "sampler": "pbt",
        "pbt": {"population": 3, "interval": 384, "quantile": 0.25},
        "concurrency": 3,
        "study_storage": f"sqlite:///{workspace / 'sweeps.db'}",
    }


def _lineage(spec: dict, sweep_id: str) -> list:
    study = optuna.load_study(study_name=sweep_id, storage=spec["study_storage"])
    return sorted((key, value) for key, value in study.user_attrs.items() if key.startswith("pbt:"))


def _member_weights(workspace: Path, sweep_id: str) -> dict[str, bytes]:
    from gymflow.tasks.storage.checkpoints import latest_version, read_policy
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    storage = Storage(StorageLocation(str(workspace / "data")))
    weights = {}
    for folder in sorted((workspace / "data" / "runs").glob(f"{sweep_id}-m*")):
        layout = RunLayout(folder.name)
        blobs = read_policy(storage, layout, latest_version(storage, layout))
        weights[folder.name.removeprefix(sweep_id)] = b"".join(blobs[name] for name in sorted(blobs))
    return weights


def _killed_in_its_second_interval(spec: dict, sweep_id: str) -> None:
    """Start the sweep in its own process; SIGKILL it (and its Dask workers) once the first member
    of its second interval has paused."""
    from prefect.settings import PREFECT_API_URL

    code = ("import json, sys\nfrom gymflow.flows.sweep import sweep\n"
            "if __name__ == '__main__':\n    sweep(json.loads(sys.argv[1]), sweep_id=sys.argv[2])")
    flow = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), sweep_id],
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not any(key.startswith("pbt:result:1:") for key, _ in _lineage_if_any(spec, sweep_id)):
        assert flow.poll() is None and time.monotonic() < deadline, "the sweep ended before it could be killed"
        time.sleep(0.1)
    os.killpg(flow.pid, signal.SIGKILL)
    flow.wait()


def _without_ids(lineage: list, sweep_id: str) -> list:
    """Plans and results as two sweeps of other ids and MLflow runs would record the same decisions."""
    kept = []
    for key, value in lineage:
        data = json.loads(value.replace(sweep_id, "SWEEP"))
        kept.append((key, [_no_ids(item) for item in data] if isinstance(data, list) else _no_ids(data)))
    return kept


def _no_ids(record: dict) -> dict:
    return {key: value for key, value in record.items()
            if key not in ("mlflow_parent_run_id", "mlflow_run_id", "model_uri")}


def _lineage_if_any(spec: dict, sweep_id: str) -> list:
    try:
        return _lineage(spec, sweep_id)
    except KeyError:  # the study is not created yet
        return []


@pytest.mark.slow  # long tier (56 s): PBT's exploit step stays in through the off-policy member's copy
@pytest.mark.e2e
def test_a_population_copies_its_best_into_its_worst_and_a_killed_sweep_ends_the_same(
        prefect_api, workspace, tiny_budget):
    from prefect.artifacts import Artifact

    from gymflow.flows.sweep import sweep
    from gymflow.presets.load import load_preset
    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_checkpoint
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    spec = _e2e_spec(workspace, tiny_budget)
    clean = sweep(spec, sweep_id="clean")

    lineage = dict(_lineage(spec, "clean"))
    plans = [json.loads(lineage[f"pbt:plan:{interval}"]) for interval in range(3)]
    results = [{int(key.rsplit(":", 1)[1]): json.loads(value) for key, value in lineage.items()
                if key.startswith(f"pbt:result:{interval}:")} for interval in range(3)]
    assert [len(plan) for plan in plans] == [3, 3, 3] and [len(r) for r in results] == [3, 3, 3]
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    storage = Storage(StorageLocation(str(workspace / "data")))
    for interval in (1, 2):
        before = results[interval - 1]
        ranked = sorted(before, key=lambda m: (-before[m]["score"], m))
        (copier,) = [m for m in plans[interval] if m["copy_from"]]  # ceil(3 x 0.25) = 1 copies
        copy = copier["copy_from"]
        assert copier["member"] == ranked[-1] and copy["source"] == ranked[0]
        assert copy["version"] == before[copy["source"]]["version"] and copy["at_version"] == before[ranked[-1]]["version"]
        run_id = f"clean-m{copier['member']:03d}"
        copied = read_checkpoint(storage, RunLayout(run_id), copy["at_version"] + 1, [POLICY_BLOB])  # its own version
        assert copied == read_checkpoint(storage, RunLayout(copy["source_run_id"]), copy["version"], [POLICY_BLOB])
        assert copied != read_checkpoint(storage, RunLayout(run_id), copy["at_version"], [POLICY_BLOB])
        mlflow_run = client.get_run(results[interval][copier["member"]]["mlflow_run_id"])
        lr_after = [m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/lr")
                    if m.step > before[copier["member"]]["clock"]]
        clip_after = [m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/clip_range")
                      if m.step > before[copier["member"]]["clock"]]
        assert lr_after[0] == pytest.approx(copier["settings"]["agent.lr"])  # explored after the copy, not the source's
        assert clip_after[0] == pytest.approx(copier["settings"]["agent.clip_range"])
        event = client.download_artifacts(mlflow_run.info.run_id, f"pbt/interval-{interval:03d}.json", str(workspace))
        assert json.loads(Path(event).read_text())["copied_member"] == copy["source"]
    assert not list((workspace / "data" / "runs").glob("clean-m*/pins/*"))  # every pin let go

    assert [row["outcome"] for row in clean.ranking] == ["complete"] * 3 and clean.runs_trained == 9
    parent = client.get_run(clean.mlflow_parent_run_id)
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"ranking.json", "lineage.md", "lineage.png", "best-preset.yaml"} <= artifacts
    assert parent.data.tags["gymflow.sweep.best_model"].startswith("models:/")
    best = load_preset(clean.best_preset_url.removeprefix("file://"))
    assert best.agent.lr == pytest.approx(plans[2][clean.ranking[0]["member"]]["settings"]["agent.lr"])
    assert "←" in str(Artifact.get("sweep-lineage").data)

    _killed_in_its_second_interval(spec, "killed")
    restarted = sweep(spec, sweep_id="killed")
    assert restarted.ranking == [{**row, "run": row["run"].replace("clean", "killed")} for row in clean.ranking]
    assert _without_ids(_lineage(spec, "killed"), "killed") == _without_ids(_lineage(spec, "clean"), "clean")
    assert _member_weights(workspace, "killed") == _member_weights(workspace, "clean")


# default tier (one of its 25 slowest): PBT's one test in the default run (it also pays for this process's Prefect API, ~16 s)
@pytest.mark.e2e
def test_an_off_policy_member_copies_the_sources_replay_memory_with_its_learner(prefect_api, workspace, tiny_budget):
    """DQN members: the copier's first version after a copy holds the source's policy and the
    source's replay memory as the source checkpointed them where it paused."""
    from gymflow.flows.sweep import sweep
    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, REPLAY_BLOB, read_checkpoint
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    spec = {"preset": "cartpole-dqn", "sampler": "pbt", "concurrency": 2,
            "overrides": {**tiny_budget, "schedule.total_env_steps": 1024, "schedule.heatup_env_steps": 128,
                          "storage.checkpoint_replay": True, "storage.keep_checkpoints": 100, **local_overrides(workspace)},
            "space": {"agent.lr": {"low": 0.00001, "high": 0.01, "log": True}},
            "pbt": {"population": 2, "interval": 512, "quantile": 0.25},
            "study_storage": f"sqlite:///{workspace / 'sweeps.db'}"}
    done = sweep(spec, sweep_id="dqn")
    (copier,) = [m for m in json.loads(dict(_lineage(spec, "dqn"))["pbt:plan:1"]) if m["copy_from"]]
    copy, storage = copier["copy_from"], Storage(StorageLocation(str(workspace / "data")))
    names = [POLICY_BLOB, REPLAY_BLOB]
    copied = read_checkpoint(storage, RunLayout(f"dqn-m{copier['member']:03d}"), copy["at_version"] + 1, names)
    assert copied == read_checkpoint(storage, RunLayout(copy["source_run_id"]), copy["version"], names)
    own = read_checkpoint(storage, RunLayout(f"dqn-m{copier['member']:03d}"), copy["at_version"], [REPLAY_BLOB])
    assert own[REPLAY_BLOB] != copied[REPLAY_BLOB]  # its own memory before the copy was another
    assert [row["outcome"] for row in done.ranking] == ["complete"] * 2


def test_an_evaluation_made_again_at_a_step_the_run_had_logged_before_a_kill_is_one_row(tmp_path):
    """A member killed after its pause's evaluation was logged, before its result was recorded,
    resumes at that step and is evaluated there again: its curve (and the window its score is the
    mean of) holds the step once, as a run never killed does."""
    from gymflow.tasks.cluster.messages import EvaluationResult
    from gymflow.tasks.tracking.tracker import Tracker
    from gymflow.tasks.training.evaluation import Scored
    from gymflow.tasks.training.summary import EvaluationRow, RunRecorder

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "pbt", "member", {})
    before_the_kill = RunRecorder(tracker, None, None)
    for step in (384, 768):
        before_the_kill.evaluated(Scored(step, EvaluationResult(6, (1.0, 3.0), (10, 10), 0.1)))
    resumed = RunRecorder(tracker, None, None, evaluations=[EvaluationRow(*row) for row in tracker.evaluation_rows()])
    resumed.evaluated(Scored(768, EvaluationResult(6, (1.0, 3.0), (10, 10), 0.1)))
    assert [(row.env_steps, row.mean) for row in resumed.evaluations] == [(384, 2.0), (768, 2.0)]
    tracker.finish("FINISHED")
