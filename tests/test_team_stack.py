"""gymflow against a team's stack (`gymflow stack up`): PostgreSQL, a Prefect server on it with a
login, an MLflow server on it with the basic-auth app and its artifacts in an S3 bucket (moto), a
Dask scheduler with workers. Each user's runs go through the servers with their own MLflow login,
read back through the servers' own clients."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from gymflow.testing import stack as team
from tests.conftest import TINY_BUDGET

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
GYMFLOW = str(Path(sys.executable).with_name("gymflow"))


def _missing() -> str | None:
    if not any(Path("/usr/lib/postgresql").glob("*/bin/initdb")) and shutil.which("initdb") is None:
        return "PostgreSQL is not installed (make system-packages: Debian's postgresql)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "runuser is missing: PostgreSQL cannot be started as its own user"
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The team's stack, brought up and down by the command a user types; nothing of it runs after."""
    if reason := _missing():
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("team") / "stack"
    up = subprocess.run([GYMFLOW, "stack", "up", "--folder", str(folder)], capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    started = team.load(folder)
    assert "MLFLOW_TRACKING_USERNAME=alice" in up.stdout and started.mlflow_url in up.stdout
    try:
        yield started
    finally:
        down = subprocess.run([GYMFLOW, "stack", "down", "--folder", str(folder)], capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr
        alive = [name for name, pid in started.pids.items() if _alive(pid)]
        assert not alive and not folder.exists(), f"still running after `stack down`: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _as(stack: team.Stack, user: str, **changes: str) -> dict[str, str]:
    """The environment of a process run by `user`: their settings, `changes` on top, none of the tests' own servers."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("PREFECT_API", "MLFLOW_"))}
    return {**environment, **stack.environment(user), **changes}


def _retrain_code(overrides: dict, model_name: str) -> str:
    return ("import json, sys\nfrom gymflow.flows.retrain import retrain\n"
            f"decision = retrain('cartpole-ppo', json.loads({json.dumps(json.dumps(overrides))}), "
            f"model_name={model_name!r}, evaluation_episodes=4)\n"
            "print('DECISION', json.dumps({'outcome': decision.outcome, 'run_id': decision.challenger.run_id}))\n")


def _flow_runs(stack: team.Stack, name: str) -> list[dict]:
    """The flow runs of flow `name` on the stack's Prefect server, read with its login."""
    answer = httpx.post(f"{stack.prefect_api_url}/flow_runs/filter", json={"flows": {"name": {"any_": [name]}}},
                        auth=tuple(stack.prefect_auth_string.split(":", 1)), timeout=30)
    answer.raise_for_status()
    return answer.json()


def _mlflow_as(monkeypatch, stack: team.Stack, user: str):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", stack.mlflow_passwords[user])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL"):
        monkeypatch.setenv(name, stack.environment(user)[name])
    return MlflowClient(stack.mlflow_url)


def _bucket(stack: team.Stack):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=stack.s3_endpoint, key=stack.s3_key, secret=stack.s3_secret)


# default tier: the first of its capability (the team's stack): a retraining promotes a champion through
# the servers, through a PostgreSQL restart mid-run (a failover), and only its owner sees it
def test_a_retraining_on_the_team_stack_promotes_a_champion_through_a_database_restart_seen_only_by_its_owner(
        stack, monkeypatch):
    overrides = {**TINY_BUDGET, **stack.overrides("alice/runs"), "storage.options": {"endpoint_url": stack.s3_endpoint},
                 "tracking.experiment": "alice", "schedule.total_env_steps": 6400,
                 "schedule.evaluate_every_env_steps": 1280}
    retraining = subprocess.Popen([sys.executable, "-c", _retrain_code(overrides, "alice-corridor")],
                                  env=_as(stack, "alice"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(retraining.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("env steps (" in line for line in lines):  # training, and recording through the servers
        assert retraining.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    team.restart_postgres(stack, down_s=2.0)  # every connection of both servers cut
    assert retraining.wait(timeout=300) == 0, "".join(lines)
    reader.join(timeout=10)
    output = "".join(lines)
    decision = json.loads(output.split("DECISION ", 1)[1].splitlines()[0])
    assert decision["outcome"] == "first champion registered"
    assert "delivered to MLflow" in output and "Traceback" not in output

    # Alice reads it all back through the MLflow server: the run, every evaluation, the champion
    import mlflow

    alice = _mlflow_as(monkeypatch, stack, "alice")
    run = alice.get_run(decision["run_id"])
    assert run.info.status == "FINISHED"
    evaluated = [metric.step for metric in alice.get_metric_history(run.info.run_id, "eval/return_mean")]
    assert evaluated == [1280, 2560, 3840, 5120, 6400]  # every evaluation, none lost in the restart
    assert len(alice.get_metric_history(run.info.run_id, "time/env_steps")) == 6400 // 128  # every round
    champion = alice.get_model_version_by_alias("alice-corridor", "champion")
    assert champion.run_id == run.info.run_id
    mlflow.set_tracking_uri(stack.mlflow_url)
    try:
        model = mlflow.pyfunc.load_model("models:/alice-corridor@champion")
    finally:
        mlflow.set_tracking_uri(None)
    actions = model.predict(np.zeros((3, *model.metadata.get_input_schema().inputs[0].shape[1:]), np.float32))
    assert np.asarray(actions).shape[0] == 3
    films = [path for path in _bucket(stack).find(f"{stack.bucket}/mlflow-artifacts") if path.endswith(".mp4")]
    assert any(run.info.run_id in path for path in films), films
    # the flows' states on the Prefect server: the retraining and its improve run, Completed
    assert {flow_run["state_type"] for flow_run in _flow_runs(stack, "retrain")} == {"COMPLETED"}
    assert {flow_run["state_type"] for flow_run in _flow_runs(stack, "improve")} == {"COMPLETED"}

    # Bob sees none of it, until alice's experiment is shared with him
    from mlflow.exceptions import MlflowException

    bob = _mlflow_as(monkeypatch, stack, "bob")
    with pytest.raises(MlflowException, match="Permission denied"):
        bob.get_run(run.info.run_id)
    assert [experiment.name for experiment in bob.search_experiments()] == []
    team.grant(stack, run.info.experiment_id, "bob", "READ")
    assert bob.get_run(run.info.run_id).data.metrics["eval/return_mean"] == run.data.metrics["eval/return_mean"]


def test_a_wrong_login_or_someone_else_s_experiment_is_refused_in_one_line_before_any_work(stack):
    settings = [argument for setting in stack.settings("refused/runs") for argument in ("--set", setting)]
    command = [GYMFLOW, "run", "cartpole-ppo", *settings, "--set", "tracking.experiment=alice-private", "--quiet"]
    server, api = f"the MLflow server at {stack.mlflow_url}", f"the Prefect server at {stack.prefect_api_url}"
    experiment_id = _an_experiment_of_alice(stack, "alice-private")
    improve_runs = len(_flow_runs(stack, "improve"))
    for environment, says in [
        (_as(stack, "alice", MLFLOW_TRACKING_PASSWORD="wrong"), f"tracking.tracking_uri: {server} refused the login "
         "of user 'alice' (401 Unauthorized): check MLFLOW_TRACKING_PASSWORD"),
        (_as(stack, "alice", MLFLOW_TRACKING_USERNAME=""), f"tracking.tracking_uri: {server} asks for a login "
         "(401 Unauthorized): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
        (_as(stack, "alice", PREFECT_API_AUTH_STRING="admin:wrong"), f"PREFECT_API_AUTH_STRING: {api} refused the "
         "login of user 'admin' (401 Unauthorized): check PREFECT_API_AUTH_STRING"),
        (_as(stack, "bob"), f"tracking.experiment: {server} refused user 'bob' access to experiment 'alice-private' "
         "(403 Permission denied); ask its owner for EDIT permission, or name one of your own"),
        ("READ", f"tracking.experiment: {server} lets user 'bob' read experiment 'alice-private' but not run in it "
         "(403 Permission denied); ask its owner for EDIT permission, or name one of your own"),
    ]:
        if environment == "READ":
            team.grant(stack, experiment_id, "bob", "READ")
            environment = _as(stack, "bob")
        refused = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
        assert (refused.returncode, refused.stderr.strip()) == (2, f"gymflow: error: {says}"), refused.stdout
    assert not _bucket(stack).exists(f"{stack.bucket}/refused")  # nothing written
    assert len(_flow_runs(stack, "improve")) == improve_runs  # no flow run started


def _an_experiment_of_alice(stack: team.Stack, name: str) -> str:
    """Its id; made by alice through the server."""
    import requests

    made = requests.post(f"{stack.mlflow_url}/api/2.0/mlflow/experiments/create", json={"name": name}, timeout=30,
                         auth=("alice", stack.mlflow_passwords["alice"]))
    made.raise_for_status()
    return made.json()["experiment_id"]
