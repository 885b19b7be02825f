"""Offline runs: a preset learns from a Minari dataset (here a run's own experience, exported)
without collecting; the budget is gradient steps and the rollout workers only evaluate. A dataset
that is missing, damaged or of another env is refused before any work, in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load

from gymflow.errors import UnusableWarmStart
from gymflow.flows.cli import main
from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import latest_version, read_checkpoint, read_policy, versions_on
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import local_overrides, written_files
from tests.killing import kill_flow_midway
from tests.stored import read_ledger

pytestmark = pytest.mark.e2e
minari = pytest.importorskip("minari")

DATASET_ID = "gymflow/corridor-v0"


TINY = {"distribution.rollout_workers": 2, "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 16,
        "schedule.evaluate_every_env_steps": 1280, "schedule.evaluation_episodes": 4, "schedule.target_return": None,
        "schedule.total_env_steps": 5120, "storage.keep_shards": "all"}
SAC_ON_THE_CORRIDOR = {"env.id": "gymflow.testing.envs:ContinuousCorridor", "agent.hidden_sizes": [16],
                       "agent.batch_size": 16, "agent.train_steps_per_iteration": 8, "schedule.heatup_env_steps": 128,
                       "distribution.mode": "sync"}


def _exported(tmp_path_factory, preset: str, overrides: dict) -> tuple[Path, float]:
    """A run's experience, exported as DATASET_ID; with the mean return of its episodes: the
    behaviour policy's."""
    workspace = tmp_path_factory.mktemp(preset)
    behaviour = improve(preset, {**TINY, **overrides, **local_overrides(workspace),
                                 "tracking.artifact_location": str(workspace / "mlruns")})  # not ./mlruns where pytest runs
    datasets = workspace / "datasets"
    assert main(["export", behaviour.run_id, "--root", str(workspace / "data"), "--to", str(datasets),
                 "--id", DATASET_ID]) == 0
    episodes = minari.MinariDataset(datasets / DATASET_ID / "data")
    return datasets, float(np.mean([sum(episode.rewards) for episode in episodes]))


@pytest.fixture(scope="module")
def corridor_dataset(tmp_path_factory, prefect_api) -> tuple[Path, float]:
    """A PPO run's experience on the corridor: its stochastic policy as it learned."""
    return _exported(tmp_path_factory, "cartpole-ppo", {"env.id": "gymflow.testing.envs:Corridor"})


@pytest.fixture(scope="module")
def continuous_dataset(tmp_path_factory, prefect_api) -> tuple[Path, float]:
    """A SAC run's experience on the continuous corridor: random heatup, then its sampled actions."""
    return _exported(tmp_path_factory, "pendulum-sac", SAC_ON_THE_CORRIDOR)


def offline(datasets: Path, workspace: Path, **changes) -> dict:
    return {"env.id": "gymflow.testing.envs:Corridor", "dataset.root": str(datasets), "dataset.id": DATASET_ID,
            "agent.hidden_sizes": [16], "agent.batch_size": 64, "agent.train_steps_per_iteration": 100,
            "schedule.total_train_steps": 600, "schedule.evaluate_every_train_steps": 200,
            "schedule.evaluation_episodes": 4, "distribution.learner_threads": 1, **local_overrides(workspace),
            **changes}


# default tier (one of its 25 slowest): BC learning offline, once (with the PPO run and export its dataset comes from)
def test_behaviour_cloning_reaches_the_return_of_the_policy_that_collected_the_data(corridor_dataset, workspace):
    datasets, behaviour_return = corridor_dataset
    cloned = improve("cartpole-bc", offline(datasets, workspace))
    assert (cloned.env_steps, cloned.gradient_steps, cloned.versions_committed) == (0, 600, 7)  # v0, one a 100 steps
    assert cloned.final_return >= max(behaviour_return, 0.9), behaviour_return  # the walk to the end (< 1)
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    losses = client.get_metric_history(cloned.mlflow_run_id, "train/cloning_loss")
    assert [m.step for m in losses] == [100, 200, 300, 400, 500, 600]  # logged against gradient steps
    assert losses[-1].value < losses[0].value
    assert [row.env_steps for row in cloned.evaluations] == [200, 400, 600]  # the clock: gradient steps


@pytest.mark.parametrize(("change", "says"), [
    ({"env.id": "CartPole-v1"}, "dataset.id: 'gymflow/corridor-v0' has observations Box(2,), the env's are Box(4,)"),
    ({"dataset.id": "gymflow/elsewhere-v0"}, "dataset.id: no Minari dataset 'gymflow/elsewhere-v0' under"),
    ({"agent.replay_capacity": 100}, "agent.replay_capacity: 100 transitions cannot hold dataset"),
], ids=["other-env", "missing", "too-big"])
def test_an_unusable_dataset_is_refused_in_one_line_before_any_work(corridor_dataset, workspace, capsys, change, says,
                                                                    monkeypatch):
    from gymflow.flows import cli

    def flow_started(*args, **kwargs):  # refused before Prefect: no flow run to fail, no second telling
        raise AssertionError("the flow started: the dataset was not checked by the command line first")

    monkeypatch.setattr(cli, "_under_prefect", flow_started)
    datasets, _ = corridor_dataset
    overrides = offline(datasets, workspace, **change)
    code = main(["run", "cartpole-bc", "--quiet", *(f"--set={key}={value}" for key, value in _as_text(overrides))])
    error = capsys.readouterr().err.strip()
    assert code == 2 and error.startswith(f"gymflow: error: {says}") and "\n" not in error, error
    assert not (workspace / "data").exists() or written_files(workspace / "data") == []


def test_a_damaged_dataset_is_refused_in_one_line(corridor_dataset, workspace, tmp_path, capsys):
    datasets, _ = corridor_dataset
    damaged = tmp_path / "damaged"
    for path in (datasets / DATASET_ID).rglob("*"):
        if path.is_file():
            target = damaged / DATASET_ID / path.relative_to(datasets / DATASET_ID)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = path.read_bytes()
            target.write_bytes(data if path.name == "metadata.json" else data[: len(data) // 3])
    overrides = offline(damaged, workspace)
    code = main(["run", "cartpole-bc", "--quiet", *(f"--set={key}={value}" for key, value in _as_text(overrides))])
    error = capsys.readouterr().err.strip()
    assert code == 2 and "dataset.id: the dataset at" in error and "cannot be read" in error and "\n" not in error


def _as_text(overrides: dict) -> list[tuple[str, str]]:
    import json

    return [(key, value if isinstance(value, str) else json.dumps(value)) for key, value in overrides.items()]


@pytest.mark.parametrize(("preset", "data"), [("cartpole-bc", "corridor_dataset"),
                                             pytest.param("hopper-iql", "continuous_dataset", marks=pytest.mark.slow)])
@pytest.mark.slow  # long tier: a killed run resumed stays in through tests/test_resume.py
def test_a_killed_offline_run_resumes_to_the_same_weights(preset, data, request, workspace):
    """The memory a resume rebuilds is the dataset read again, slot for slot: the resumed run
    takes the same samples and ends with the uninterrupted run's learner state, byte for byte."""
    datasets, _ = request.getfixturevalue(data)
    env = "gymflow.testing.envs:Corridor" if preset == "cartpole-bc" else "gymflow.testing.envs:ContinuousCorridor"
    run = offline(datasets, workspace, **{"env.id": env, "agent.normalize_observations": True,
                                         "schedule.total_train_steps": 2400})
    clean = improve(preset, {**run, "storage.root": str(workspace / "clean")})
    killed_root = workspace / "killed"
    kill_flow_midway(preset, {**run, "storage.root": str(killed_root)}, killed_root,
                     workspace / "killed-flow.log", kill_at=5)
    (run_dir,) = (killed_root / "runs").iterdir()
    assert not (run_dir / "checkpoints" / f"v{clean.versions_committed - 1:06d}").exists()
    assert main(["resume", run_dir.name, "--root", str(killed_root), "--quiet"]) == 0
    assert final_learner(killed_root, run_dir.name) == final_learner(workspace / "clean", clean.run_id)


# default tier (one of its 25 slowest): IQL learning offline, once (with the SAC run and export its dataset comes from)
def test_iql_learns_the_continuous_corridor_from_a_sac_run_s_experience(continuous_dataset, workspace):
    datasets, behaviour_return = continuous_dataset
    learned = improve("hopper-iql", offline(datasets, workspace, **{"env.id": "gymflow.testing.envs:ContinuousCorridor",
                                                                     "schedule.total_train_steps": 2000,
                                                                     "schedule.evaluate_every_train_steps": 500}))
    assert learned.env_steps == 0 and learned.final_return >= max(behaviour_return, 0.9), behaviour_return


def final_learner(root: Path, run_id: str) -> bytes:
    storage = Storage(StorageLocation(str(root)))
    version = latest_version(storage, RunLayout(run_id))
    return read_checkpoint(storage, RunLayout(run_id), version, ["learner.safetensors"])["learner.safetensors"]


def _observations_counted(root: Path, run_id: str) -> float:
    """The observation statistics' count in a run's final learner."""
    from gymflow.tasks.storage.checkpoints import LEARNER_TENSORS, LEARNER_TREE
    from gymflow.tasks.storage.codec import decode_state

    storage = Storage(StorageLocation(str(root)))
    version = latest_version(storage, RunLayout(run_id))
    blobs = read_checkpoint(storage, RunLayout(run_id), version, [LEARNER_TENSORS, LEARNER_TREE])
    state = decode_state(blobs[LEARNER_TENSORS], blobs[LEARNER_TREE])
    return round(float(state["actor"]["obs_norm.count"]))


def test_dqn_learns_offline_with_cql_s_conservative_penalty(corridor_dataset, workspace):
    datasets, behaviour_return = corridor_dataset
    learned = improve("cartpole-dqn", offline(datasets, workspace, **{
        "agent.cql_alpha": 1.0, "agent.target_update_every_train_steps": 100, "schedule.total_env_steps": 0,
        "schedule.heatup_env_steps": 0, "schedule.total_train_steps": 1000, "schedule.evaluate_every_train_steps": 500,
        "schedule.target_return": None}))
    assert learned.env_steps == 0 and learned.final_return >= max(behaviour_return, 0.9), behaviour_return
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    assert client.get_metric_history(learned.mlflow_run_id, "train/cql_penalty")[-1].value > 0


CONTINUOUS_CORRIDOR = {"env.id": "gymflow.testing.envs:ContinuousCorridor"}


def _iql_offline_then_online(datasets: Path, workspace: Path, evaluate_every_env_steps: int):
    """An IQL run offline on the continuous corridor (2,000 gradient steps), and the overrides that
    continue it online for 640 env steps with the dataset in memory."""
    offline_run = improve("hopper-iql", offline(datasets, workspace, **CONTINUOUS_CORRIDOR, **{
        "schedule.total_train_steps": 2000, "schedule.evaluate_every_train_steps": 500}))
    online = offline(datasets, workspace, **CONTINUOUS_CORRIDOR, **{
        "schedule.total_env_steps": 640, "schedule.rollout_steps_per_env": 16,
        "schedule.evaluate_every_env_steps": evaluate_every_env_steps, "agent.train_steps_per_iteration": 16,
        "distribution.envs_per_worker": 4})
    return offline_run, online


@pytest.mark.slow  # long tier: a run started from a policy (the collect-only run's --warm-start) stays in
def test_an_online_run_continues_an_offline_one_from_its_policy_with_the_dataset_in_memory(continuous_dataset,
                                                                                            workspace):
    datasets, _ = continuous_dataset
    offline_run, online = _iql_offline_then_online(datasets, workspace, evaluate_every_env_steps=256)
    continued = improve("hopper-iql", online, warm_start=offline_run.model_uri)
    assert continued.env_steps == 640 and continued.gradient_steps is None
    storage = Storage(StorageLocation(str(workspace / "data")))
    started_from, offline_final = (
        load(read_policy(storage, RunLayout(run.run_id), version, ["policy.safetensors"])["policy.safetensors"])
        for run, version in ((continued, 0), (offline_run, offline_run.delivered_version)))
    for name, tensor in offline_final.items():  # v0, which collected first, is the offline run's delivered policy:
        if name.startswith("obs_norm."):  # its statistics have seen the dataset once more (their count doubles)
            assert name.endswith("count") or torch.allclose(started_from[name], tensor, rtol=1e-4), name
        else:
            assert torch.equal(started_from[name], tensor), name
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    sizes = [m.value for m in client.get_metric_history(continued.mlflow_run_id, "train/replay_size")]
    steps = minari.MinariDataset(datasets / DATASET_ID / "data").total_steps
    assert sizes[0] == steps + 128 and sizes[-1] == steps + 640  # the dataset first, then what it collected


@pytest.mark.slow  # long tier: an online continuation from the offline policy stays in
def test_an_online_run_continues_an_offline_run_s_whole_learner(continuous_dataset, workspace):
    """`learner:RUN_ID` carries the critics and value with the policy: the online run's first updates
    improve on the offline policy instead of following fresh critics away from it."""
    datasets, _ = continuous_dataset
    offline_run, online = _iql_offline_then_online(datasets, workspace, evaluate_every_env_steps=128)
    continued = improve("hopper-iql", online, warm_start=f"learner:{offline_run.run_id}")
    assert offline_run.final_return >= 0.9 and min(row.mean for row in continued.evaluations) >= 0.9
    counted = {run.run_id: _observations_counted(workspace / "data", run.run_id) for run in (offline_run, continued)}
    assert counted[continued.run_id] == counted[offline_run.run_id] + continued.env_steps  # the dataset counted once
    with pytest.raises(UnusableWarmStart, match="learner holds"):
        improve("cartpole-bc", offline(datasets, workspace, **CONTINUOUS_CORRIDOR),
                warm_start=f"learner:{offline_run.run_id}")


# default tier (one of its 25 slowest): retraining from logged experience, once
def test_the_retraining_flow_trains_its_challenger_offline_and_scores_it_against_the_champion(corridor_dataset,
                                                                                               workspace):
    from gymflow.flows.retrain import retrain

    datasets, _ = corridor_dataset
    untrained = offline(datasets, workspace, **{"schedule.total_train_steps": 100,
                                                "schedule.evaluate_every_train_steps": 100})
    first = retrain("cartpole-bc", untrained, model_name="cloned", evaluation_episodes=8)
    assert first.outcome == "first champion registered"
    second = retrain("cartpole-bc", offline(datasets, workspace), model_name="cloned", evaluation_episodes=8)
    assert second.champion == first.challenger  # warm-started from it, trained on the dataset, scored beside it
    assert second.promoted == (second.challenger_return > second.champion_return)
    assert second.challenger_return >= 0.9


def _behaviour_run(datasets: Path) -> tuple[Path, str]:
    """The storage root and the id of the run a dataset fixture exported."""
    root = datasets.parent / "data"
    (run_dir,) = (root / "runs").iterdir()
    return root, run_dir.name


def _from_runs(overrides: dict, *run_ids: str, root: Path | None = None) -> dict:
    """`overrides` learning from runs' shards instead of the exported dataset."""
    kept = {key: value for key, value in overrides.items() if not key.startswith("dataset.")}
    return {**kept, "dataset.runs": list(run_ids), **({"dataset.root": str(root)} if root else {})}


def test_a_run_s_own_shards_are_the_experience_its_export_holds(corridor_dataset):
    from gymflow.envs.make import make_env
    from gymflow.presets.model import DatasetConfig, StorageConfig
    from gymflow.tasks.lake.source import open_dataset

    datasets, _ = corridor_dataset
    root, run_id = _behaviour_run(datasets)
    env = make_env("gymflow.testing.envs:Corridor")
    spaces = (env.observation_space, env.action_space)
    from_shards = open_dataset(DatasetConfig(runs=[run_id]), StorageConfig(root=str(root)), *spaces)
    exported = open_dataset(DatasetConfig(id=DATASET_ID, root=str(datasets)), StorageConfig(), *spaces)
    assert (from_shards.episodes, from_shards.steps) == (exported.episodes, exported.steps)
    assert exported.steps > 1000
    for ours, theirs in zip(from_shards.rollouts(), exported.rollouts(), strict=True):
        for name, array in ours._asdict().items():
            np.testing.assert_array_equal(array, getattr(theirs, name), err_msg=name)


def test_behaviour_cloning_learns_from_a_run_s_shards_named_on_the_command_line(corridor_dataset, workspace):
    datasets, behaviour_return = corridor_dataset
    root, run_id = _behaviour_run(datasets)
    overrides = _from_runs(offline(datasets, workspace), run_id, root=root)  # the preset's dataset id goes
    assert main(["run", "cartpole-bc", "--quiet", *(f"--set={key}={value}" for key, value in _as_text(overrides))]) == 0
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    (run,) = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id])
    assert run.data.params["dataset.runs"] == str([run_id]) and run.data.params["dataset.id"] == "None"
    assert run.data.metrics["eval/return_mean"] >= max(behaviour_return, 0.9)


@pytest.mark.parametrize(("change", "says"), [
    ({"dataset.runs": ["nowhere"]}, "dataset.runs: no run 'nowhere' under"),
    ({"env.id": "CartPole-v1"}, "dataset.runs: run 'RUN' has observations Box(2,), the env's are Box(4,)"),
    ({"dataset.id": "gymflow/corridor-v0"},
     "dataset: name a Minari dataset (id), gymflow runs (runs) or a decision log (decisions), one of"),
], ids=["missing", "other-env", "both"])
def test_unusable_runs_are_refused_in_one_line_before_any_work(corridor_dataset, workspace, capsys, change, says):
    datasets, _ = corridor_dataset
    root, run_id = _behaviour_run(datasets)
    overrides = {**_from_runs(offline(datasets, workspace), run_id, root=root), **change}
    code = main(["run", "cartpole-bc", "--quiet", *(f"--set={key}={value}" for key, value in _as_text(overrides))])
    error = capsys.readouterr().err.strip()
    assert code == 2 and error.startswith(f"gymflow: error: {says.replace('RUN', run_id)}") and "\n" not in error
    assert not (workspace / "data").exists() or written_files(workspace / "data") == []


@pytest.mark.slow  # long tier (57 s): the retraining flow's offline challenger (test_the_retraining_flow_trains_its_challenger_offline...) stays in
def test_the_retraining_flow_learns_offline_from_the_runs_logged_since_the_champion(prefect_api, workspace):
    from gymflow.errors import InvalidPreset
    from gymflow.flows.retrain import retrain

    online = {**TINY, "env.id": "gymflow.testing.envs:Corridor", "distribution.learner_threads": 1,
              **local_overrides(workspace)}
    offline_dqn = {**online, "agent.cql_alpha": 1.0, "agent.target_update_every_train_steps": 100,
                   "schedule.total_train_steps": 1000, "schedule.evaluate_every_train_steps": 500}
    first = retrain("cartpole-dqn", online, model_name="logged", evaluation_episodes=8)
    with pytest.raises(InvalidPreset, match="experience: no run of gymflow.testing.envs:Corridor has stored"):
        retrain("cartpole-dqn", offline_dqn, model_name="logged", evaluation_episodes=8, challenger={"experience": "logged"})
    since = improve("cartpole-dqn", online)  # experience collected after the champion was registered
    improve("cartpole-dqn", {**online, "env.hide": [1]})  # of another observation: passed over
    second = retrain("cartpole-dqn", offline_dqn, model_name="logged", evaluation_episodes=8, challenger={"experience": "logged"})
    assert second.champion == first.challenger
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    params = client.get_run(second.challenger.run_id).data.params
    assert params["dataset.runs"] == str([since.run_id]) and params["schedule.total_env_steps"] == "0"
    assert second.challenger_return >= 0.9 and second.promoted == (second.challenger_return > second.champion_return)


def test_a_collect_only_run_acts_with_its_starting_policy_throughout_and_keeps_every_shard(corridor_dataset,
                                                                                            workspace):
    """schedule.total_train_steps 0: a fixed policy's experience (D4RL's "medium" kind when the
    policy is half-trained), every shard kept though keep_shards says needed; BC learns from it."""
    datasets, _ = corridor_dataset
    root, behaviour = _behaviour_run(datasets)
    source = Storage(StorageLocation(str(root)))
    start = read_policy(source, RunLayout(behaviour), latest_version(source, RunLayout(behaviour)))
    (workspace / "start").mkdir()
    (workspace / "start" / "policy.safetensors").write_bytes(start["policy.safetensors"])
    collect = {**TINY, "env.id": "gymflow.testing.envs:Corridor", "schedule.total_train_steps": 0,
               "storage.keep_shards": "needed", **local_overrides(workspace)}
    assert main(["run", "cartpole-ppo", "--quiet", "--warm-start", str(workspace / "start" / "policy.safetensors"),
                 *(f"--set={key}={value}" for key, value in _as_text(collect))]) == 0
    storage = Storage(StorageLocation(str(workspace / "data")))
    (run_id,) = {key.split("/")[1] for key in storage.list("runs")}
    layout = RunLayout(run_id)
    published = versions_on(storage, layout.policies)
    last = read_policy(storage, layout, published[-1], ["policy.safetensors"])["policy.safetensors"]
    assert published[-1] == 5120 // (2 * 4 * 16) and load(last).keys() == load(start["policy.safetensors"]).keys()
    assert all(torch.equal(tensor, load(start["policy.safetensors"])[name]) for name, tensor in load(last).items())
    assert len(storage.list(layout.shards)) == 2 * 5120 // (2 * 4 * 16)  # every round's shard of both workers
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    (run,) = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id])
    assert run.data.metrics["eval/return_mean"] >= 0.9 and not [key for key in run.data.metrics if "train/" in key]
    cloned = improve("cartpole-bc", _from_runs(offline(datasets, workspace), run_id))
    assert cloned.final_return >= 0.9


@pytest.mark.parametrize(("change", "says"), [
    ({"distribution.mode": "async"}, "distribution.mode: a collect-only run"),
    ({"dataset.id": DATASET_ID}, "dataset: a collect-only run (schedule.total_train_steps 0) learns nothing"),
], ids=["async", "dataset"])
def test_a_collect_only_run_is_refused_where_it_cannot_be(workspace, capsys, change, says):
    overrides = {**TINY, "env.id": "gymflow.testing.envs:Corridor", "schedule.total_train_steps": 0,
                 **local_overrides(workspace), **change}
    code = main(["run", "cartpole-dqn", "--quiet", *(f"--set={key}={value}" for key, value in _as_text(overrides))])
    error = capsys.readouterr().err.strip()
    assert code == 2 and error.startswith(f"gymflow: error: {says}") and "\n" not in error, error


@pytest.mark.slow  # long tier: an online run from a dataset stays in (test_an_online_run_continues_an_offline_one_from_its_policy...)
def test_an_async_run_starts_from_a_dataset_and_resumes_with_it_after_a_kill(corridor_dataset, workspace):
    """ASYNC after a dataset: the memory holds the dataset, then the streamed chunks; killed
    midway, the resumed run rebuilds that memory (dataset included, slot for slot: its position
    is checked) and accounts for every chunk once."""
    datasets, _ = corridor_dataset
    run = {**offline(datasets, workspace), "schedule.total_env_steps": 2560, "schedule.rollout_steps_per_env": 16,
           "schedule.evaluate_every_env_steps": 640, "distribution.mode": "async", "distribution.samples_per_insert": 2,
           "distribution.commit_every_train_steps": 4, "agent.batch_size": 16, "schedule.heatup_env_steps": 0,
           "agent.train_steps_per_iteration": 8, "schedule.target_return": None}
    run.pop("schedule.total_train_steps")
    run.pop("schedule.evaluate_every_train_steps")
    killed_root = workspace / "killed"
    kill_flow_midway("cartpole-dqn", {**run, "storage.root": str(killed_root)}, killed_root,
                     workspace / "killed-flow.log", kill_at=3)
    (run_dir,) = (killed_root / "runs").iterdir()
    assert main(["resume", run_dir.name, "--root", str(killed_root), "--quiet"]) == 0
    storage = Storage(StorageLocation(str(killed_root)))
    ledger = read_ledger(storage, run_dir.name)
    accounted = ledger.inserted + ledger.dropped + ledger.unused
    assert sorted(accounted) == storage.list(f"runs/{run_dir.name}/shards/async") and len(set(accounted)) == len(accounted)
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    assert f"dataset {DATASET_ID}: " in (workspace / "killed-flow.log").read_text()  # read before the stream began


@pytest.mark.slow  # long tier: the collect-only run stays in, and killed runs resumed in tests/test_resume.py
def test_a_killed_collect_only_run_resumes_to_its_end_with_nothing_in_replay_but_heatup(prefect_api, workspace):
    """A collect-only DQN run learned from none of its rounds: a resume rebuilds its memory from
    heatup's shards alone (not from every round, which it never inserted), where the checkpoint
    says it stood."""
    from gymflow.presets import load_preset
    from gymflow.tasks.training.resume import inserted_newest_first
    from gymflow.tasks.training.state import STATE_BLOB, LoopState

    run = {**TINY, "env.id": "gymflow.testing.envs:Corridor", "schedule.total_train_steps": 0,
           "schedule.heatup_env_steps": 128, "storage.checkpoint_every_env_steps": 128, **local_overrides(workspace)}
    killed_root = workspace / "data"
    kill_flow_midway("cartpole-dqn", run, killed_root, workspace / "killed-flow.log", kill_at=5)
    (run_dir,) = (killed_root / "runs").iterdir()
    storage, layout = Storage(StorageLocation(str(killed_root))), RunLayout(run_dir.name)
    state = LoopState.from_json(read_checkpoint(storage, layout, latest_version(storage, layout), [STATE_BLOB])[STATE_BLOB])
    preset = load_preset("cartpole-dqn", run)
    assert state.version >= 4 and list(inserted_newest_first(storage, layout, state, preset)) == [
        [layout.shard(None, worker) for worker in range(2)]]
    assert main(["resume", run_dir.name, "--root", str(killed_root), "--quiet"]) == 0
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "time/policy_version")][-1] == 5120
