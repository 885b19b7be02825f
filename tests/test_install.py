"""What `make train` installs (gymflow alone: what the main job needs), and what a feature whose
extra is not installed says: one line naming the extra, before anything is made."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from gymflow.flows.cli import main

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# what the main job does without: the test bench, MLflow's server and UI (the full `mlflow` package, with
# its pyarrow, scikit-learn and scipy), the ONNX export, and every env family's simulator
NOT_FOR_THE_MAIN_JOB = {"mlflow", "scipy", "pyarrow", "scikit-learn", "onnx", "onnxruntime", "pytest", "moto",
                        "playwright", "ruff", "hypothesis", "envpool", "ale-py", "mujoco", "box2d", "minari",
                        "kubernetes-validate", "dask-kubernetes", "dask-jobqueue", "psycopg"}


def test_gymflow_alone_installs_what_the_main_job_needs_and_make_train_installs_nothing_more():
    core = {Requirement(line).name.lower() for line in PROJECT["dependencies"]}
    assert not core & NOT_FOR_THE_MAIN_JOB, core & NOT_FOR_THE_MAIN_JOB
    extras = PROJECT["optional-dependencies"]
    assert {"ui", "onnx", "atari", "mujoco", "envpool", "stack", "slurm", "kube", "test"} <= set(extras)
    assert "gymflow[all]" in extras["test"] and set(extras) - {"all", "test", "bench"} == set(
        Requirement(extras["all"][0]).extras)  # `make test` installs every extra
    commands = subprocess.run(["make", "-n", "-B", "train", "VENV=/nonexistent-venv"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout
    assert 'pip install --quiet -e "."' in commands and "[test]" not in commands, commands
    tests = subprocess.run(["make", "-n", "-B", "test", "VENV=/nonexistent-venv"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout
    assert 'pip install --quiet -e ".[test]"' in tests, tests


def test_stack_up_without_the_stack_extra_is_refused_in_one_line_and_makes_no_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "moto", None)  # as if not installed
    assert main(["stack", "up", "--folder", str(tmp_path / "stack")]) == 2
    said = capsys.readouterr().err.strip()
    assert said == "gymflow: error: `gymflow stack up` needs moto[server], not installed: gymflow's stack extra has " \
                   "them (pip install 'gymflow[stack]')"
    assert not (tmp_path / "stack").exists()


def test_kube_without_the_kube_extra_is_refused_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kubernetes_validate", None)
    assert main(["kube", "cartpole-ppo", "--image", "registry.example.com/gymflow:1", "--out", str(tmp_path / "k")]) == 2
    assert capsys.readouterr().err.strip() == "gymflow: error: `gymflow kube` needs kubernetes-validate, not " \
                                              "installed: gymflow's kube extra has them (pip install 'gymflow[kube]')"
    assert not (tmp_path / "k").exists()


def test_without_the_onnx_extra_the_export_says_which_extra_in_one_line(monkeypatch):
    from safetensors.torch import save

    from gymflow.agents.export import CannotExport, onnx_policy
    from gymflow.presets.validate import resolve_experiment

    experiment = resolve_experiment("cartpole-ppo", {})
    algorithm, config = experiment.algorithm, experiment.preset.agent
    weights = save(algorithm.network(config, experiment.observation_space, experiment.action_space).state_dict())
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(CannotExport) as refused:
        onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space, weights)
    assert str(refused.value) == "onnx and onnxruntime are not installed (gymflow's onnx extra: " \
                                 "pip install 'gymflow[onnx]')"


def test_a_run_s_page_says_how_to_add_mlflow_s_ui_where_only_its_client_is_installed(monkeypatch):
    from gymflow.tasks.tracking import pages

    assert pages.mlflow_ui_installed()  # the test bench has it
    assert "pip" not in pages.served_by("sqlite:///mlflow.db") and "mlflow ui --backend-store-uri" in \
        pages.served_by("sqlite:///mlflow.db")
    monkeypatch.setattr(pages, "mlflow_ui_installed", lambda: False)
    said = pages.served_by("sqlite:///mlflow.db")
    assert "install 'mlflow>=3'` adds MLflow's UI and " in said and "ui --backend-store-uri sqlite:///mlflow.db" in said
    assert pages.served_by("http://mlflow.internal:5000") == ""  # a server serves its own UI


def test_a_logged_model_s_mlflow_requirement_holds_where_only_mlflow_s_client_is_installed(monkeypatch):
    from gymflow.tasks.tracking import models

    version = metadata.version

    def skinny_only(name: str) -> str:
        if name.lower() == "mlflow":
            raise metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(metadata, "version", skinny_only)
    assert models.unsatisfied_requirements(["mlflow>=3", "numpy<1"])[0].startswith("numpy")
    assert len(models.unsatisfied_requirements(["mlflow>=3"])) == 0


def test_a_listing_piped_into_a_reader_that_leaves_early_ends_without_a_traceback():
    gymflow = Path(sys.executable).with_name("gymflow")
    piped = subprocess.run(f"'{gymflow}' presets | true", shell=True, capture_output=True, text=True, timeout=120)
    assert piped.stderr == ""
