"""A flow process SIGKILLed mid-training is resumed from its last committed checkpoint and ends
exactly where an uninterrupted run of the same preset and seed ends."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from mlflow.tracking import MlflowClient

from gymflow.flows.cli import main
from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import read_checkpoint
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import local_overrides
from tests.killing import kill_flow_midway
from tests.stored import read_ledger

pytestmark = pytest.mark.e2e


def _final_weights(root, summary) -> bytes:
    storage = Storage(StorageLocation(str(root)))
    return read_checkpoint(storage, RunLayout(summary.run_id), summary.versions_committed - 1,
                           ["policy.safetensors"])["policy.safetensors"]


ASYNC = {"distribution.mode": "async", "distribution.samples_per_insert": 2, "distribution.commit_every_train_steps": 4,
         "agent.batch_size": 16, "agent.hidden_sizes": [16], "schedule.heatup_env_steps": 128}


# hopper-td3's agent on the test corridor's continuous twin, small enough for seconds
TD3_ON_THE_CORRIDOR = {"env.id": "gymflow.testing.envs:ContinuousCorridor", "agent.hidden_sizes": [16],
                       "agent.batch_size": 16, "agent.train_steps_per_iteration": 8, "schedule.heatup_env_steps": 128,
                       "distribution.learner_threads": 1}
NORMALIZED = {"agent.normalize_observations": True}  # the statistics resume with the learner, counted once


# The default run keeps SYNC PPO (normalised observations and rewards) killed and resumed; each other
# algorithm's whole state resumed is in the long tier (15-30 s each). ASYNC DQN's (its replay rebuilt
# from chunks, resumed to the end) stays in the default run in-process: tests/test_retention.py.
LONG = pytest.mark.slow


# default tier (one of its 25 slowest): the killed-flow drill: a SYNC run resumed (the other algorithms' in the long tier)
@pytest.mark.parametrize(("preset", "extra"), [
    ("cartpole-ppo", {**NORMALIZED, "agent.normalize_rewards": True}),
    pytest.param("cartpole-ppo", {**NORMALIZED, "distribution.mode": "single"}, marks=LONG),
    pytest.param("cartpole-ppo", {**NORMALIZED, "agent.recurrent": 8, "agent.hidden_sizes": [16]}, marks=LONG),  # memories in the shards
    pytest.param("cartpole-dqn", {"agent.train_steps_per_iteration": 8, "agent.hidden_sizes": [16],
                                  "schedule.heatup_env_steps": 128, **NORMALIZED}, marks=LONG),
    pytest.param("cartpole-dqn", {**ASYNC, **NORMALIZED}, marks=LONG),
    pytest.param("cartpole-appo", {"distribution.mode": "async", "agent.minibatch_size": 64, "agent.epochs": 2,  # batches as they land
                                   "agent.hidden_sizes": [16], "agent.normalize_rewards": True, "storage.keep_shards": "all",
                                   **NORMALIZED}, marks=LONG),
    pytest.param("hopper-td3", {**TD3_ON_THE_CORRIDOR, **NORMALIZED}, marks=LONG),
    # on the ALE's vector env, its cursors replayed: killed at v4, after 256 steps an env (its first games ended)
    pytest.param("breakout-ppo", {"env.id": "ALE/Breakout-v5", "agent.hidden_sizes": [32], "agent.minibatch_size": 64,
                                  "agent.epochs": 1, "schedule.rollout_steps_per_env": 64, "schedule.total_env_steps": 5120,
                                  "schedule.evaluate_every_env_steps": 100_000, "schedule.evaluation_episodes": 1},
                 marks=LONG),
    pytest.param("spread-ippo", {"env.id": "pettingzoo:gymflow.testing.agents:Exits", "env.kwargs": {},  # agents leaving games,
                                 "agent.policies": {"guide": "guides"},  # a policy for each of its two groups
                                 "agent.minibatch_size": 64, "agent.hidden_sizes": [16], **NORMALIZED}, marks=LONG),
    pytest.param("race-ppo", {"env.id": "pettingzoo:gymflow.envs.race", "env.kwargs": {}, "agent.hidden_sizes": [16],
                              "schedule.opponent_pool": {"size": 2, "every": 2, "share": 0.5}}, marks=LONG),  # past versions it plays
])
def test_a_killed_flow_resumes_to_the_same_end_as_an_uninterrupted_run(preset, extra, prefect_api, workspace, tiny_budget,
                                                                         caplog):
    """SYNC (with normalisation): the same weights and statistics as the uninterrupted run. ASYNC (which version a chunk acts with
    depends on timing): the same env steps, every chunk landed once."""

    run = {**tiny_budget, "schedule.total_env_steps": 2560, **extra, **local_overrides(workspace)}  # 20 rounds
    clean = improve(preset, {**run, "storage.root": str(workspace / "clean")})

    killed_root = workspace / "killed"
    # ASYNC commits as many versions as its learner keeps up with: kill halfway through the clean run's, at most at v4
    kill_at = min(4, clean.versions_committed // 2)
    assert kill_at >= 2, f"the clean run committed {clean.versions_committed} versions: too few to be killed midway"
    kill_flow_midway(preset, {**run, "storage.root": str(killed_root)}, killed_root, workspace / "killed-flow.log",
                     kill_at)
    (run_dir,) = (killed_root / "runs").iterdir()
    assert not (killed_root / "runs" / run_dir.name / "checkpoints" / f"v{clean.versions_committed - 1:06d}").exists()

    with caplog.at_level(logging.INFO):
        assert main(["resume", run_dir.name, "--root", str(killed_root), "--quiet"]) == 0
    said = [r.getMessage() for r in caplog.records if f"run {run_dir.name} continues from v" in r.getMessage()]
    assert len(said) == 1 and " env steps" in said[0], said  # where it stood, once
    storage = Storage(StorageLocation(str(killed_root)))
    record = json.loads(storage.read(f"runs/{run_dir.name}/run.json"))
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    mlflow_run = client.get_run(record["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"  # the same MLflow run, finished by the resumed flow
    steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "time/policy_version")]
    assert steps[0] < 1000 and steps[-1] == clean.env_steps  # before the kill, and to the end
    if extra.get("distribution.mode") == "async":
        ledger = read_ledger(storage, run_dir.name)
        accounted = ledger.inserted + ledger.dropped + ledger.unused
        assert sorted(accounted) == storage.list(f"runs/{run_dir.name}/shards/async")
        assert len(set(accounted)) == len(accounted)
        return
    resumed = replace(clean, run_id=run_dir.name)
    assert _final_weights(killed_root, resumed) == _final_weights(workspace / "clean", clean)
