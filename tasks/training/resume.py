"""Resuming a run whose flow process died: where it stood, from storage alone.

The learner's state and the loop's state come from the newest checkpoint that verifies. The
replay memory of an off-policy agent comes from the same checkpoint where it was stored
(storage.checkpoint_replay), else it is rebuilt by inserting the run's shards again in their
original order (heatup's, then SYNC rounds by version or the ASYNC ledger's order), which gives
the same transitions the learner had; prioritized replay then restarts its priorities at the
largest one.
"""

from __future__ import annotations

from dataclasses import dataclass

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.presets.load import validate_preset_data
from gymflow.presets.model import Preset
from gymflow.presets.validate import Experiment, experiment_from
from gymflow.tasks.storage.checkpoints import LEARNER_TENSORS, LEARNER_TREE, REPLAY_BLOB, read_newest_valid_checkpoint
from gymflow.tasks.storage.codec import decode_arrays, decode_state
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.records import read_stored_preset
from gymflow.tasks.storage.shards import read_shard_at
from gymflow.tasks.training.collection import SyncRounds
from gymflow.tasks.training.state import STATE_BLOB, LoopState
from gymflow.tasks.training.stream import AsyncStream


@dataclass(frozen=True)
class Restored:
    state: LoopState
    refused: tuple[str, ...]  # newer versions that could not be loaded, with why


def stored_experiment(storage: Storage, run_id: str, caller: Experiment) -> Experiment:
    """The run's own preset, with the caller's storage settings (where the run was found, with
    credentials the stored copy has redacted)."""
    data = read_stored_preset(storage, run_id)
    data["storage"] = caller.preset.storage.model_dump(mode="json")
    return experiment_from(validate_preset_data(data))


def restore(storage: Storage, run_id: str, learner: Learner, preset: Preset) -> Restored:
    """Load the newest valid checkpoint of `run_id` into `learner`; returns the loop's state."""
    layout = RunLayout(run_id)
    loaded = read_newest_valid_checkpoint(storage, layout)
    learner.load_state_dict(decode_state(loaded.blobs[LEARNER_TENSORS], loaded.blobs[LEARNER_TREE]))
    state = LoopState.from_json(loaded.blobs[STATE_BLOB])
    if isinstance(learner, ReplayLearner) and REPLAY_BLOB in loaded.blobs:
        learner.replay.load_state_dict(decode_arrays(loaded.blobs[REPLAY_BLOB]))
    elif isinstance(learner, ReplayLearner):
        for key in inserted_shards(storage, layout, state, preset):
            learner.remember([read_shard_at(storage, key)])
    return Restored(state, loaded.refused)


def inserted_shards(storage: Storage, layout: RunLayout, state: LoopState, preset: Preset) -> list[str]:
    """The shards a replay learner had inserted by `state`, in the order it inserted them."""
    workers = preset.distribution.rollout_workers
    heatup = [layout.shard(None, w) for w in range(workers) if storage.exists(layout.shard(None, w))]
    collection = AsyncStream if preset.distribution.mode == "async" else SyncRounds
    return heatup + collection.inserted_shards(state, layout, workers)
