"""Each kind of bad input has its own error type, and each says in one line what failed."""

from __future__ import annotations

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


def test_a_scheduler_nobody_runs_is_an_unavailable_cluster():
    config = DistributionConfig(scheduler_address=f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ClusterUnavailable) as caught, dask_client(config):
        pass
    _one_line(caught.value, "distribution.scheduler_address")


def test_a_policy_that_does_not_fit_or_cannot_be_read_is_an_unusable_warm_start(tmp_path):
    experiment = resolve_experiment("cartpole-ppo")
    with pytest.raises(UnusableWarmStart) as caught:
        create_learner(experiment, {"actor.0.weight": torch.zeros(3, 3)})
    _one_line(caught.value, "warm_start")
    with pytest.raises(UnusableWarmStart) as caught:
        read_warm_start(str(tmp_path / "missing.safetensors"), f"sqlite:///{tmp_path / 'mlflow.db'}")
    _one_line(caught.value, "warm_start")


def test_the_kinds_are_told_apart_but_all_are_gymflow_errors():
    kinds = (InvalidPreset, StorageRefused, ClusterUnavailable, UnusableWarmStart)
    assert all(issubclass(kind, GymflowError) for kind in kinds)
    assert not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)
