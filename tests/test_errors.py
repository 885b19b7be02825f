"""Each kind of bad input has its own error type, and each says in one line what failed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gymflow.errors import ClusterUnavailable, GymflowError, InvalidPreset, StorageRefused, UnusableWarmStart
from gymflow.presets.model import DistributionConfig
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.cluster.client import dask_client
from gymflow.tasks.storage.objects import StorageLocation, check_storage
from gymflow.tasks.tracking.models import read_warm_start
from gymflow.tasks.training.learning import create_learner
from tests.conftest import free_port


def _one_line(error: GymflowError, field: str) -> None:
    assert str(error).startswith(f"{field}: ") and "\n" not in str(error)
    assert error.field == field


def test_a_bad_preset_value_is_an_invalid_preset():
    with pytest.raises(InvalidPreset) as caught:
        resolve_experiment("cartpole-ppo", {"agent.lr": -1})
    _one_line(caught.value, "agent.lr")


def test_a_storage_root_that_is_a_file_is_refused_storage(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StorageRefused) as caught:
        check_storage(StorageLocation(str(tmp_path / "file" / "data")))
    _one_line(caught.value, "storage.root")


@pytest.mark.slow  # long tier (10 s of Dask's connect timeout): tests/test_improve_flow.py's unreachable scheduler is its twin
def test_a_scheduler_nobody_runs_is_an_unavailable_cluster():
    config = DistributionConfig(scheduler_address=f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ClusterUnavailable) as caught, dask_client(config):
        pass
    _one_line(caught.value, "distribution.scheduler_address")


def test_a_policy_that_does_not_fit_or_cannot_be_read_is_an_unusable_warm_start(tmp_path):
    experiment = resolve_experiment("cartpole-ppo")
    with pytest.raises(UnusableWarmStart, match="it has no log_std") as caught:
        create_learner(experiment, {"actor.0.weight": torch.zeros(3, 3)})
    _one_line(caught.value, "warm_start")
    weights = create_learner(experiment).policy_weights()
    with pytest.raises(UnusableWarmStart, match=r"actor.0.weight is \(3, 3\), this network's is \(64, 4\)"):
        create_learner(experiment, weights | {"actor.0.weight": torch.zeros(3, 3)})
    with pytest.raises(UnusableWarmStart) as caught:
        read_warm_start(str(tmp_path / "missing.safetensors"), f"sqlite:///{tmp_path / 'mlflow.db'}")
    _one_line(caught.value, "warm_start")
    normalized = create_learner(resolve_experiment("cartpole-ppo", {"agent.normalize_observations": True}))
    with pytest.raises(UnusableWarmStart, match="agent.normalize_observations must be as it was") as caught:
        create_learner(experiment, normalized.policy_weights())
    _one_line(caught.value, "warm_start")


def test_the_kinds_are_told_apart_but_all_are_gymflow_errors():
    kinds = (InvalidPreset, StorageRefused, ClusterUnavailable, UnusableWarmStart)
    assert all(issubclass(kind, GymflowError) for kind in kinds)
    assert not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)


@pytest.mark.parametrize(("overrides", "field", "says"), [
    ({"storage.root": "ftp://files.example/runs"}, "storage.root", "unsupported scheme 'ftp'"),
    ({"storage.root": ""}, "storage.root", "not be empty"),
    ({"tracking.tracking_uri": "mongodb://db/runs"}, "tracking.tracking_uri", "unsupported tracking URI"),
    ({"agent.hidden_sizes": [64, -4]}, "agent.hidden_sizes.1", "greater than or equal to 1"),
])
def test_bad_roots_uris_and_widths_are_refused_by_the_cli_before_anything_starts(overrides, field, says, tmp_path,
                                                                               monkeypatch, capsys):
    from gymflow.flows.cli import main

    monkeypatch.chdir(tmp_path)
    settings = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    assert main(["run", "cartpole-ppo", *settings]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"gymflow: error: {field}: ") and says in error and "\n" not in error
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_env_class_in_the_working_folder_is_found(tmp_path, monkeypatch, capsys):
    from gymflow.flows.cli import main

    (tmp_path / "my_corridor.py").write_text("from gymflow.testing.envs import Corridor\n\n\nclass MyCorridor(Corridor):\n"
                                            "    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert main(["show", "cartpole-ppo", "--set", "env.id=my_corridor:MyCorridor"]) == 0
    assert "id: my_corridor:MyCorridor" in capsys.readouterr().out


def _error_types() -> list[type[BaseException]]:
    """Every exception type gymflow defines, in any of its modules (the flows define none)."""
    import importlib
    import inspect
    import pkgutil

    names = ["gymflow.errors"]
    for package in ("gymflow.agents", "gymflow.envs", "gymflow.presets", "gymflow.tasks"):
        path = importlib.import_module(package).__path__
        names += [package] + [info.name for info in pkgutil.walk_packages(path, f"{package}.")]
    found = {}
    for name in names:
        module = importlib.import_module(name)
        for _, member in inspect.getmembers(module, inspect.isclass):
            if issubclass(member, BaseException) and member.__module__ == module.__name__:
                found[f"{member.__module__}.{member.__qualname__}"] = member
    return list(found.values())


def test_every_gymflow_error_type_survives_pickling_as_itself():
    import inspect
    import pickle

    types = _error_types()
    assert {"GymflowError", "JobFailed", "EnvSpecError", "CheckpointError", "ShardError", "HostLost"} <= {
        error_type.__name__ for error_type in types}
    for error_type in types:
        try:
            parameters = inspect.signature(error_type).parameters.items()
        except ValueError:  # Exception's own constructor: any arguments
            parameters = {}.items()
        arguments = [name for name, parameter in parameters
                     if parameter.default is inspect.Parameter.empty and parameter.kind is parameter.POSITIONAL_OR_KEYWORD]
        error = error_type(*[f"<{name}>" for name in arguments] or ["what went wrong"])
        error.add_note("a note")
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is error_type and str(copy) == str(error), error_type
        assert copy.__notes__ == ["a note"], error_type
        assert vars(copy) == vars(error), error_type


def test_a_worker_that_does_not_see_the_flows_local_root_is_told_in_one_line(tmp_path):
    from gymflow.tasks.storage.objects import check_shared_root, ready_storage

    location = StorageLocation(str(tmp_path / "shared" / "runs"))
    with pytest.raises(StorageRefused) as caught:  # as on a worker without the shared mount
        check_shared_root(location)
    _one_line(caught.value, "storage.root")
    assert "must be mounted at the same path on every worker" in str(caught.value)
    check_storage(location)
    assert not (tmp_path / "shared").exists()  # checking writes nothing
    ready_storage(location)  # the flow's side makes the (empty) root
    check_shared_root(location)


@pytest.fixture
def small_file_system(tmp_path):
    """A 600 KB file system (tmpfs) of its own: a storage root that fills mid-run, for real."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"no small file system can be mounted here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


# default tier: the storage that fills (a run's writes refused mid-run), through the command line
def test_a_storage_root_that_fills_mid_run_stops_it_in_one_line_and_the_run_resumes_once_there_is_room(
        small_file_system, workspace, prefect_api):
    from prefect.settings import PREFECT_API_URL

    gymflow, root = str(Path(sys.executable).with_name("gymflow")), str(small_file_system)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the tests' API: no temporary one a command
    filled = subprocess.run([gymflow, "run", "cartpole-ppo", "--quiet", f"--set=storage.root={root}",
                             "--set=schedule.total_env_steps=8192", "--set=schedule.target_return=null"],
                            capture_output=True, text=True, timeout=240, env=env)
    said = filled.stdout + filled.stderr
    assert filled.returncode == 2, said[-3000:]
    assert "Traceback" not in said and "Errno" not in said
    (last,) = [line for line in filled.stderr.splitlines() if line.startswith("gymflow: error:")]
    stopped = re.fullmatch(rf"gymflow: error: (.*: )?storage.root: {root} refused a write: No space left on device; "
                           rf"free space there, then `gymflow resume (\S+) --root {root}` continues the run from what it "
                           r"committed", last)
    assert stopped, last
    assert not list(small_file_system.rglob("*.tmp-*"))  # nothing half-written

    subprocess.run(["mount", "-o", "remount,size=20m", root], check=True)
    resumed = subprocess.run([gymflow, "resume", stopped[2], "--root", root, "--quiet"], capture_output=True, text=True,
                             timeout=240, env=env)
    assert resumed.returncode == 0 and "after 8,192 env steps" in resumed.stdout, resumed.stderr[-3000:]


def test_importing_every_module_leaves_the_process_s_signals_as_they_were():
    """No module changes a process's signals by being imported (a fork server's preload once ignored
    SIGINT and SIGTERM at import: the test process that imported it could no longer end its pool's
    children, which hung the suite)."""
    import signal

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    _error_types()  # imports every module of agents, envs, presets and tasks
    assert {number: signal.getsignal(number) for number in before} == before
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
