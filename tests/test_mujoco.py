"""The MuJoCo presets end to end, on a tiny budget: a real Prefect API, Dask worker processes,
Gymnasium's MuJoCo envs (the mujoco extra), MLflow."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from gymflow.flows.improve import improve
from tests.conftest import TINY_MUJOCO, local_overrides

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("preset", "extra"), [
    ("hopper-ppo", {"agent.minibatch_size": 64}),
    pytest.param("halfcheetah-sac", {"schedule.heatup_env_steps": 256, "agent.batch_size": 32,
                                     "agent.train_steps_per_iteration": 8},
                 marks=[pytest.mark.slow, pytest.mark.timeout(900)]),  # 115 s on the AVX-512 kind beside another test
    ("hopper-td3", {"schedule.heatup_env_steps": 256, "agent.batch_size": 32, "agent.train_steps_per_iteration": 8,
                    "distribution.learner_threads": 1}),
])
def test_a_mujoco_preset_runs_end_to_end(preset, extra, prefect_api, workspace):
    summary = improve(preset, {**TINY_MUJOCO, **extra, **local_overrides(workspace)})
    rounds = (1024 - extra.get("schedule.heatup_env_steps", 0)) // 256  # heatup's steps count in the budget
    assert summary.env_steps == 1024 and summary.versions_committed == rounds + 1
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED" and "eval/return_mean" in run.data.metrics
    # filmed off-screen on a machine without a display: an MP4 the MLflow UI plays
    (film,) = client.list_artifacts(summary.mlflow_run_id, "videos")
    assert film.path.endswith(".mp4") and film.file_size > 1000
