"""gymflow the way a Prefect estate runs it: a real `prefect server`, a process work pool,
`prefect deploy` from prefect.yaml, a `prefect worker`, and `prefect deployment run --watch`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gymflow.presets.load import builtin_presets
from gymflow.tasks.storage.checkpoints import latest_version, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.testing.http import wait_for_answer
from tests.conftest import STOPPED_RUN, free_port, still_running
from tests.prefect_databases import seed_prefect_database
from tests.prefect_workers import stop_worker
from tests.stored import newest_published

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def readme_deploy_block(page: Path = REPO / "README.md") -> list[str]:
    """A page's deploy block (the README's), as a user copies it: its command lines, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
    (block,) = [body for body in blocks if "deploy --all" in body]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and
            not line.strip().startswith("#")]


def _set_up_as_the_readme_says(lines: list[str], env: dict, port: int, deploy: tuple[str, ...]
                               ) -> subprocess.Popen | None:
    """Run the README's set-up lines in order (the venv's activation is this interpreter's PATH): the
    server it backgrounds (on `port`), its export, its work pool, and its `prefect deploy` in a
    terminal of its own (`script`), where a question would wait for an answer and the fixture time out;
    the worker and the runs are the tests'. Returns the server it started."""
    server = None
    for line in lines:
        if line.startswith(". .venv/bin/activate") or line.startswith("prefect worker") or " deployment run " in \
                f" {line}":
            continue
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value.replace(":4200", f":{port}")
        elif line.endswith("&"):
            assert line.startswith("prefect server start"), line  # the only other thing the block backgrounds
            server = subprocess.Popen(line.rstrip("&").split(), env={**env, "PREFECT_SERVER_API_PORT": str(port),
                                                                     "PREFECT_SERVER_API_HOST": "127.0.0.1"},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
            wait_for_answer(f"http://127.0.0.1:{port}/api/health", 120)
        else:
            command = line if " deploy --all" not in line or not deploy else line.replace("--all", " ".join(deploy))
            # `deploy --all` loads the flow once for each of prefect.yaml's 21 deployments and asks the server
            # ~20 times for each: ~50 s on a quiet 2-core VM, past 120 s beside the suite's other process
            done = subprocess.run(["script", "-qec", command, "/dev/null"], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=600, stdin=subprocess.DEVNULL)
            assert done.returncode == 0, (line, done.stdout[-3000:] + done.stderr[-3000:])
    return server


@contextmanager
def _server_with(tmp_path_factory, *deploy: str) -> Iterator[dict]:
    """A Prefect server with the gymflow process work pool and the deployments prefect.yaml holds
    (`deploy`: `prefect deploy`'s selection instead of `--all`), set up by the README's deploy block
    as written (tests/README.md): the environment that reaches it."""
    home = tmp_path_factory.mktemp("prefect-home")
    seed_prefect_database(home / "prefect.db")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PATH": f"{Path(PREFECT).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PREFECT_API_URL", None)
    server = None
    try:
        server = _set_up_as_the_readme_says(readme_deploy_block(), env, port, deploy)
        assert server is not None and env.get("PREFECT_API_URL") == f"http://127.0.0.1:{port}/api", env.get(
            "PREFECT_API_URL")
        yield env
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def test_the_readme_s_deploy_block_is_the_deploy_path_of_these_tests_and_deploy_md_s_alike():
    """The fixture above runs the README's block; docs/deploy.md's says the same in the same order
    (its server and worker left running in shells of their own), and every `prefect deploy` asks
    no question."""
    readme, guide = readme_deploy_block(), readme_deploy_block(REPO / "docs" / "deploy.md")
    setting_up = [line.rstrip("& ").strip() for line in readme if not line.startswith("prefect deployment run")]
    assert setting_up == guide, (setting_up, guide)
    assert all("--no-prompt" in line for line in readme + guide if " deploy " in f" {line} ")
    assert [line for line in readme if line.endswith("&")] == ["prefect server start &",
                                                             "prefect worker start --pool gymflow &"]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A Prefect server with every deployment of prefect.yaml."""
    with _server_with(tmp_path_factory, "--all") as env:
        yield env


@pytest.fixture(scope="module")
def deployed_cartpole_ppo(tmp_path_factory):
    """A Prefect server with improve/cartpole-ppo alone: all the cancelled run needs, in the suite's
    run of the `alone` tests (`deploy --all` takes ~20 s more)."""
    with _server_with(tmp_path_factory, "--name", "cartpole-ppo") as env:
        yield env


def _wait_for_no_children(pid: int, seconds: float) -> None:
    """Wait until the process `pid` has no child processes left (a worker's flow-run process writes
    its last files after the run's state is Completed)."""
    import psutil

    deadline = time.monotonic() + seconds
    while psutil.Process(pid).children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.5)


def _prefect(env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


@contextmanager
def _worker_of(env: dict, tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A `prefect worker` polling the gymflow pool; its log in worker.log. It asks for new runs each
    second (Prefect's default is every 10 s: up to 10 s of waiting before each run starts)."""
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen([PREFECT, "worker", "start", "--pool", "gymflow"],
                               env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, cwd=tmp_path,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        try:
            stop_worker(process, tmp_path / "worker.log")
        finally:
            log.close()


@pytest.fixture
def worker(deployed, tmp_path):
    with _worker_of(deployed, tmp_path) as process:
        yield process


@pytest.fixture
def cartpole_ppo_worker(deployed_cartpole_ppo, tmp_path):
    with _worker_of(deployed_cartpole_ppo, tmp_path) as process:
        yield process


def _stores(tmp_path: Path) -> dict:
    """A run's storage and MLflow store in tmp_path (not in the checkout, the worker's folder)."""
    return {"storage.root": str(tmp_path / "data"), "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "tracking.artifact_location": str(tmp_path / "mlartifacts")}


def _corridor_overrides(tmp_path: Path, total_env_steps: int, evaluate_every_env_steps: int) -> dict:
    """A short run on the test corridor, its stores in tmp_path; standing in for CartPole, under the preset's
    name (which names its registered model, as prefect.yaml's automations know it)."""
    return {"env.id": "gymflow.testing.envs:Corridor", "name": "cartpole-ppo", "schedule.total_env_steps": total_env_steps,
            "schedule.rollout_steps_per_env": 16, "distribution.envs_per_worker": 4,
            "schedule.evaluate_every_env_steps": evaluate_every_env_steps, **_stores(tmp_path)}


# long tier: the cancelled run (alone) runs improve/cartpole-ppo through a worker, and resumed, to its end
@pytest.mark.slow
def test_deploy_and_run_a_preset_through_a_process_worker(deployed, worker, tmp_path):
    env = deployed
    overrides = _corridor_overrides(tmp_path, total_env_steps=512, evaluate_every_env_steps=256)
    run = _prefect(env, "deployment", "run", "improve/cartpole-ppo", "-p", f"overrides={json.dumps(overrides)}",
                   "--watch", timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Completed" in run.stdout
    _wait_for_no_children(worker.pid, 60)  # the flow run's process exits after its state is Completed

    storage = Storage(StorageLocation(str(tmp_path / "data")))
    runs = [key.split("/")[1] for key in storage.list("runs") if key.endswith("preset.yaml")]
    assert len(runs) == 1 and latest_version(storage, RunLayout(runs[0])) == 4
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.tags["gymflow.run_id"] == runs[0]
    assert "eval/return_mean" in mlflow_run.data.metrics


# default tier (one of its 25 slowest): pays for the module's server and `prefect deploy --all`: every deployment of prefect.yaml deploys
def test_every_deployment_is_listed_and_the_retraining_schedules_are_deployed_paused(deployed):
    listed = _prefect(deployed, "deployment", "ls").stdout
    for name in ("improve/cartpole-ppo", "improve/cartpole-dqn", "improve/cartpole-dqn-async", "improve/pendulum-sac",
                 "improve/lunarlander-ppo", "improve/hopper-ppo", "improve/halfcheetah-ppo", "improve/hopper-td3",
                 "improve/halfcheetah-sac",
                 "retrain/cartpole-ppo-nightly", "retrain/cartpole-dqn-weekly", "sweep/cartpole-ppo-sweep",
                 "monitor/cartpole-ppo-champion", "retrain/cartpole-ppo-degraded"):
        assert name.split("/")[1] in listed, listed
    inspected = _prefect(deployed, "deployment", "inspect", "retrain/cartpole-ppo-nightly").stdout
    assert "0 3 * * *" in inspected and "'active': False" in inspected, inspected
    inspected = _prefect(deployed, "deployment", "inspect", "retrain/cartpole-dqn-weekly").stdout
    assert "0 4 * * 0" in inspected and "'active': False" in inspected and "'experience': 'logged'" in inspected


# default tier: the one run through a worker that is refused (its parameters; a missing champion in the long tier)
@pytest.mark.parametrize(("deployment", "bad", "says"), [
    ("improve/cartpole-ppo", {"overrides": {"agent.lr": -1}},
     "gymflow.flow-run.refused * agent.lr: Input should be greater than 0 (got -1)"),
    # a credential in a deployment run's parameters: refused, saying where it belongs (Prefect has stored it)
    ("improve/cartpole-ppo", {"overrides": {"storage.options.secret": "planted-s3cr3t"}},
     "gymflow.flow-run.refused * storage.options.secret: holds a credential: a deployment run's parameters are kept "
     "in Prefect's database and shown in its UI; allowed: the credential in a Prefect Secret block"),
    pytest.param("monitor/cartpole-ppo-champion", {"model_name": "nobody-s-model"},
                 "gymflow.flow-run.refused * model_name: 'nobody-s-model' has no champion", marks=pytest.mark.slow),
])
def test_a_refused_deployment_run_says_why_where_watch_shows_it(deployed, worker, tmp_path, deployment, bad, says):
    overrides = {**_corridor_overrides(tmp_path, total_env_steps=512, evaluate_every_env_steps=256),
                 **bad.pop("overrides", {})}
    parameters = [argument for name, value in bad.items() for argument in ("-p", f"{name}={value}")]
    run = _prefect(deployed, "deployment", "run", deployment, "-p", f"overrides={json.dumps(overrides)}", *parameters,
                   "--watch", timeout=400)
    watched = " ".join(run.stdout.split())  # rich wraps long lines to the terminal's width
    assert run.returncode == 1 and "Failed" in watched, watched[-3000:]
    assert says in watched, watched[-3000:]
    assert not (tmp_path / "data").exists()  # refused before anything was written


@pytest.mark.slow  # long tier: a retraining deployment through a worker stays in (the degraded champion's)
def test_the_weekly_retraining_learns_offline_from_the_runs_logged_through_the_worker(deployed, worker, tmp_path):
    """A DQN run made through the deployment, then the weekly retraining run now: with no champion
    yet, it learns offline from every stored run of the env, registers the first champion."""
    logged = {**_corridor_overrides(tmp_path, total_env_steps=1024, evaluate_every_env_steps=512),
              "schedule.heatup_env_steps": 128}
    assert _prefect(deployed, "deployment", "run", "improve/cartpole-dqn", "-p", f"overrides={json.dumps(logged)}",
                    "--watch", timeout=400).returncode == 0
    offline = {key: value for key, value in logged.items() if not key.startswith("schedule.")}
    offline.update({"agent.cql_alpha": 1.0, "schedule.total_train_steps": 256, "schedule.evaluate_every_train_steps": 128})
    run = _prefect(deployed, "deployment", "run", "retrain/cartpole-dqn-weekly",
                   "-p", f"overrides={json.dumps(offline)}", "--watch", timeout=400)
    assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    collected, learned = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id],
                                            order_by=["attributes.start_time ASC"])
    assert learned.data.params["dataset.runs"] == str([collected.data.tags["gymflow.run_id"]])
    assert learned.data.tags["gymflow.retrain.outcome"] == "first champion registered"


def _flow_runs_of(env: dict, deployment: str) -> list[dict]:
    flow_name, name = deployment.split("/")
    request = urllib.request.Request(f"{env['PREFECT_API_URL']}/deployments/name/{flow_name}/{name}")
    with urllib.request.urlopen(request, timeout=10) as response:
        deployment_id = json.load(response)["id"]
    body = json.dumps({"deployments": {"id": {"any_": [deployment_id]}}}).encode()
    request = urllib.request.Request(f"{env['PREFECT_API_URL']}/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


# default tier (one of its 25 slowest): the one test of the monitor flow and of prefect.yaml's automation (an event starts a retraining), through a worker
def test_a_degraded_champion_starts_the_retraining_deployment_with_the_events_payload(deployed, worker, prefect_api,
                                                                                       workspace):
    """The automation as prefect.yaml declares it, under a real `prefect server` (its triggers
    service on): a champion registered, the monitoring deployment scoring it below its threshold
    emits gymflow.model.degraded, and the trigger starts retrain/cartpole-ppo-degraded with the
    event's preset, overrides and model, which the worker runs to its end."""
    from gymflow.flows.retrain import retrain

    overrides = _corridor_overrides(workspace, total_env_steps=512, evaluate_every_env_steps=256)
    # the first champion, made in this process (the nightly deployment's run through a worker: test_team_stack)
    assert retrain("cartpole-ppo", overrides).outcome == "first champion registered"
    assert not _flow_runs_of(deployed, "retrain/cartpole-ppo-degraded")
    monitored = _prefect(deployed, "deployment", "run", "monitor/cartpole-ppo-champion", "-p",
                         f"overrides={json.dumps(overrides)}", "-p", "threshold=1000", "--watch", timeout=400)
    assert monitored.returncode == 0 and "Completed" in monitored.stdout, monitored.stdout[-3000:]

    deadline = time.monotonic() + 300
    while not (runs := _flow_runs_of(deployed, "retrain/cartpole-ppo-degraded")) \
            or runs[0]["state_type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        assert time.monotonic() < deadline, f"no retraining finished: {runs}; {(workspace / 'worker.log').read_text()[-3000:]}"
        time.sleep(1)
    (retraining,) = runs
    assert retraining["state_type"] == "COMPLETED", (workspace / "worker.log").read_text()[-3000:]
    assert retraining["parameters"]["overrides"] == overrides  # the event's payload, as a mapping
    assert retraining["parameters"]["preset"] == "cartpole-ppo"
    assert retraining["parameters"]["model_name"] == "gymflow-cartpole-ppo"
    versions = MlflowClient(overrides["tracking.tracking_uri"]).search_model_versions("name='gymflow-cartpole-ppo'")
    assert len(versions) == 2  # the first champion, and the challenger the automation trained


def test_flow_parameters_show_as_a_form_with_the_preset_models_descriptions_and_bounds(deployed):
    inspected = _prefect(deployed, "deployment", "inspect", "improve/cartpole-ppo").stdout
    assert "What to train: one of the built-in presets" in inspected
    assert not [name for name in builtin_presets() if name not in inspected]  # each named in the form's text
    assert "ScheduleConfigOverrides" in inspected and "AgentOverrides" in inspected
    assert "Stop after this many" in inspected
    assert "exclusiveMinimum" in inspected



def _flow_run(env: dict, flow_run_id: str) -> dict:
    with urllib.request.urlopen(f"{env['PREFECT_API_URL']}/flow_runs/{flow_run_id}", timeout=10) as response:
        return json.load(response)


def _deployment_run(env: dict, **parameters: object) -> str:
    """Start a run of improve/cartpole-ppo; its flow run id."""
    started = _prefect(env, "deployment", "run", "improve/cartpole-ppo",
                       *(arg for name, value in parameters.items() for arg in ("-p", f"{name}={json.dumps(value)}")))
    assert started.returncode == 0, started.stdout + started.stderr
    return re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)


def _wait_for_state(env: dict, flow_run_id: str, states: set[str], seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while (state := _flow_run(env, flow_run_id)["state_type"]) not in states:
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {state} after {seconds} s"
        time.sleep(0.1)
    return state


# long tier: the sweep deployment's cancellation (the improve drill below is the default tier's)
@pytest.mark.slow
def test_a_cancelled_sweep_deployment_run_ends_cancelled_within_seconds_with_its_runs_killed(deployed, worker,
                                                                                            tmp_path):
    import psutil

    spec = {"preset": "cartpole-ppo", "overrides": {**STOPPED_RUN, **_stores(tmp_path)}, "sampler": "grid",
            "space": {"agent.lr": {"values": [0.01, 0.003]}}, "seeds": 1, "concurrency": 2,
            "study_storage": f"sqlite:///{tmp_path / 'sweeps.db'}"}
    started = _prefect(deployed, "deployment", "run", "sweep/cartpole-ppo-sweep", "-p", f"spec={json.dumps(spec)}",
                       "-p", 'sweep_id="cancelled"')
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    runs = [tmp_path / "data" / "runs" / f"cancelled-c00{number}-s0" for number in (0, 1)]
    deadline = time.monotonic() + 240
    while not all(newest_published(tmp_path / "data", run.name) >= 3 for run in runs):  # each run has published v3
        assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
        time.sleep(0.05)
    running = psutil.Process(worker.pid).children(recursive=True)
    cancel = _prefect(deployed, "flow-run", "cancel", flow_run_id)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    accepted = time.monotonic()
    assert _wait_for_state(deployed, flow_run_id, {"CANCELLED", "CRASHED", "FAILED", "COMPLETED"}, 15) == "CANCELLED", \
        (tmp_path / "worker.log").read_text()[-4000:]
    _, alive = psutil.wait_procs(running, timeout=max(15 - (time.monotonic() - accepted), 0.1))
    assert not [process for process in alive if still_running(process)], [p.cmdline()[:4] for p in alive]
    said = (tmp_path / "worker.log").read_text()
    assert "did not complete in 3 attempts" not in said and "still stopping" not in said, said[-4000:]
    mlflow = MlflowClient(_stores(tmp_path)["tracking.tracking_uri"])
    statuses = [mlflow.get_run(json.loads((run / "run.json").read_text())["mlflow_run_id"]).info.status for run in runs]
    assert statuses == ["KILLED", "KILLED"]


# default tier (one of its 25 slowest): the Prefect-cancellation drill, and an improve deployment run through a worker, resumed to its end
# alone: its cancellation must end within 10 s, in a process of its own after the rest (tests/suite.py), with a
# server of its own holding the one deployment it runs
@pytest.mark.alone
def test_a_cancelled_deployment_run_stops_within_10_s_leaves_nothing_running_and_resumes_to_the_same_end(
        deployed_cartpole_ppo, cartpole_ppo_worker, clean_stopped_run, tmp_path):
    import psutil

    env, root, worker = deployed_cartpole_ppo, tmp_path / "data", cartpole_ppo_worker
    overrides = {**STOPPED_RUN, **_stores(tmp_path)}
    clean_root, clean = clean_stopped_run
    flow_run_id = _deployment_run(env, overrides=overrides)
    deadline = time.monotonic() + 240
    while newest_published(root) < 3:
        assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
        time.sleep(0.05)
    running = psutil.Process(worker.pid).children(recursive=True)  # the flow's process, its Dask workers, ...
    cancel = _prefect(env, "flow-run", "cancel", flow_run_id)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    accepted = time.monotonic()  # the server has the run as Cancelling (the CLI's own start-up is not the run's)
    try:
        assert _wait_for_state(env, flow_run_id, {"CANCELLED", "CRASHED", "FAILED", "COMPLETED"}, 10) == "CANCELLED"
        _, alive = psutil.wait_procs(running, timeout=max(10 - (time.monotonic() - accepted), 0.1))
        alive = [process for process in alive if still_running(process)]
        assert not alive, f"still running 10 s after the cancellation: {[p.cmdline()[:4] for p in alive]}"
    except AssertionError as failed:
        time.sleep(20)  # let the worker finish, so its log tells what took the time
        raise AssertionError(f"{failed}\nworker log: {(tmp_path / 'worker.log').read_text()[-4000:]}") from None

    (run_dir,) = (root / "runs").iterdir()
    mlflow = MlflowClient(overrides["tracking.tracking_uri"])
    mlflow_run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    assert mlflow.get_run(mlflow_run_id).info.status == "KILLED"

    resumed = _deployment_run(env, overrides={"storage.root": str(root)}, resume=run_dir.name)
    assert _wait_for_state(env, resumed, {"CANCELLED", "CRASHED", "FAILED", "COMPLETED"}, 300) == "COMPLETED"
    final = clean.versions_committed - 1
    clean_policy = read_policy(Storage(StorageLocation(str(clean_root))), RunLayout(clean.run_id), final,
                               ["policy.safetensors"])
    resumed_policy = read_policy(Storage(StorageLocation(str(root))), RunLayout(run_dir.name), final,
                                 ["policy.safetensors"])
    assert resumed_policy == clean_policy
    assert mlflow.get_run(mlflow_run_id).info.status == "FINISHED"
