"""Resuming a run whose flow process died: where it stood, from storage alone.

A run's storage holds its preset (`preset.yaml`), its record (`run.json`: the MLflow run to log
into), and its checkpoints, each with `counters.json`: the version, the env-step count, when the
next evaluation is due and which shards the next round continues from. The learner's state
comes from the newest checkpoint that verifies. The replay memory of an off-policy agent comes
from the checkpoint where it was stored (storage.checkpoint_replay), else it is rebuilt by
inserting the run's shards again in their original order (SYNC: by version; ASYNC: the ledger's
order), which gives the same transitions the learner had; prioritized replay then restarts its
priorities at the largest one.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from agents.core import Learner
from presets.errors import InvalidPreset
from presets.load import validate_preset_data
from presets.validate import Experiment, experiment_from
from tasks.checkpoints import decode_arrays, decode_state, read_newest_valid_checkpoint
from tasks.shards import read_shard_at
from tasks.storage import RunLayout, Storage
from tasks.stream import Ledger

RUN_RECORD = "run.json"


def write_run_record(storage: Storage, run_id: str, record: dict[str, Any]) -> None:
    storage.write(f"{RunLayout(run_id).prefix}/{RUN_RECORD}", json.dumps(record, indent=1).encode())


def read_run_record(storage: Storage, run_id: str) -> dict[str, Any]:
    key = f"{RunLayout(run_id).prefix}/{RUN_RECORD}"
    if not storage.exists(key):
        raise InvalidPreset("resume", f"no run {run_id!r} under {storage.url('runs')}")
    return json.loads(storage.read(key))


def stored_preset(storage: Storage, run_id: str) -> dict[str, Any]:
    return yaml.safe_load(storage.read(RunLayout(run_id).preset))


def resolve_stored_experiment(storage: Storage, run_id: str, caller: Experiment) -> Experiment:
    """The run's own preset, with the caller's storage settings (where the run was found, with
    credentials the stored copy has redacted)."""
    data = stored_preset(storage, run_id)
    data["storage"] = caller.preset.storage.model_dump(mode="json")
    return experiment_from(validate_preset_data(data))


def restore_learner(storage: Storage, run_id: str, learner: Learner, rollout_workers: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Load the newest valid checkpoint into `learner`; returns its counters and the versions
    refused on the way (with why)."""
    layout = RunLayout(run_id)
    loaded = read_newest_valid_checkpoint(storage, layout)
    learner.load_state_dict(decode_state(loaded.blobs["learner.safetensors"], loaded.blobs["learner.json"]))
    counters = json.loads(loaded.blobs["counters.json"])
    replay = getattr(learner, "replay", None)
    if replay is not None and "replay.npz" in loaded.blobs:  # stored with storage.checkpoint_replay
        replay.load_state_dict(decode_arrays(loaded.blobs["replay.npz"]))
    elif replay is not None:
        keys = [layout.shard(None, w) for w in range(rollout_workers) if storage.exists(layout.shard(None, w))]
        if "ledger" in counters:  # async: the shards inserted, in the order they were
            keys += Ledger.from_dict(counters["ledger"]).inserted
        else:
            keys += [layout.shard(v, w) for v in range(counters["version"]) for w in range(rollout_workers)]
        for key in keys:
            learner.remember([read_shard_at(storage, key)])  # type: ignore[attr-defined]
    return counters, loaded.refused
