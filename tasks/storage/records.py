"""What a run writes beside its checkpoints so that it can be found and resumed from storage
alone: its preset (`preset.yaml`, credentials redacted) and its record (`run.json`: the MLflow
run it logs into)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import yaml

from gymflow.errors import InvalidPreset
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage

RUN_RECORD = "run.json"


@dataclass(frozen=True)
class RunRecord:
    mlflow_run_id: str
    experiment: str
    tracking_uri: str  # its password masked: a run record is data at rest


def write_run_record(storage: Storage, run_id: str, record: RunRecord) -> None:
    storage.write(f"{RunLayout(run_id).prefix}/{RUN_RECORD}", json.dumps(asdict(record), indent=1).encode())


def has_run_record(storage: Storage, run_id: str) -> bool:
    """Whether a run of this id was started under this storage (it can be resumed)."""
    return storage.exists(f"{RunLayout(run_id).prefix}/{RUN_RECORD}")


def read_run_record(storage: Storage, run_id: str) -> RunRecord:
    key = f"{RunLayout(run_id).prefix}/{RUN_RECORD}"
    if not has_run_record(storage, run_id):
        raise InvalidPreset("resume", f"no run {run_id!r} under {storage.url('runs')}")
    return RunRecord(**json.loads(storage.read(key)))


def write_stored_preset(storage: Storage, run_id: str, preset_yaml: bytes) -> None:
    storage.write(RunLayout(run_id).preset, preset_yaml)


def read_stored_preset(storage: Storage, run_id: str) -> dict[str, Any]:
    return yaml.safe_load(storage.read(RunLayout(run_id).preset))
