"""Resuming a run whose flow process died: where it stood, from storage alone.

The learner's state and the loop's state come from the newest checkpoint that verifies. The
replay memory of an off-policy agent comes from the same checkpoint where it was stored
(storage.checkpoint_replay), else it is rebuilt from the newest shards it had inserted — read
newest first until they cover its capacity (SYNC rounds by version, then heatup's; ASYNC from the
ledger's segments; then the preset's dataset, read again), then inserted oldest first from the
slot the first of them had taken. That gives the same memory the learner had, slot for slot;
prioritized replay restarts its priorities at the largest one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from gymflow.agents.batches import Rollout
from gymflow.agents.core import Learner, ReplayLearner
from gymflow.errors import InvalidPreset, UnusableWarmStart
from gymflow.presets.load import with_settings
from gymflow.presets.model import Preset
from gymflow.presets.redaction import credentials_given_back, masked_password, with_password
from gymflow.presets.validate import Experiment, experiment_from
from gymflow.tasks.lake.source import ExperienceDataset
from gymflow.tasks.storage.checkpoints import (
    LEARNER_TENSORS,
    LEARNER_TREE,
    REPLAY_BLOB,
    REPLAY_POSITION,
    CheckpointError,
    read_checkpoint,
    read_newest_valid_checkpoint,
)
from gymflow.tasks.storage.codec import decode_arrays, decode_state
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.records import read_stored_preset
from gymflow.tasks.storage.shards import read_shard_at
from gymflow.tasks.training.ledger import records_newest_first
from gymflow.tasks.training.state import STATE_BLOB, LoopState


@dataclass(frozen=True)
class Restored:
    state: LoopState
    refused: tuple[str, ...]  # newer versions that could not be loaded, with why


def stored_experiment(storage: Storage, run_id: str, caller: Experiment,
                      settings: Mapping[str, Any] | None = None) -> Experiment:
    """The run's own preset, with the caller's storage location (where the run was found, with
    credentials the stored copy has redacted); its retention and checkpoint cadence stay its own,
    and so does `shared` (a folder every worker mounts) unless the caller says otherwise. The
    credentials the stored copy masked come back from the caller's preset where it holds them (a
    sweep's, a population's), the tracking URI's password from MLFLOW_TRACKING_PASSWORD. Its
    number of learning ranks is the caller's where the caller sets one (any number resumes a
    checkpoint). `settings`: dotted fields changed from here on (a population member's values)."""
    data = credentials_given_back(read_stored_preset(storage, run_id), caller.preset.model_dump(mode="json"))
    given = {"root", "options"} | ({"shared"} & caller.preset.storage.model_fields_set)
    location = caller.preset.storage.model_dump(mode="json", include=given)
    data["storage"] = {**data.get("storage", {}), **location}
    if "learners" in caller.preset.distribution.model_fields_set:
        data.setdefault("distribution", {})["learners"] = caller.preset.distribution.learners
    if uri := data.get("tracking", {}).get("tracking_uri"):
        data["tracking"]["tracking_uri"] = tracking_uri_logged_in(uri, run_id)
    return experiment_from(with_settings(data, settings or {}))


def stored_tracking_uri(storage: Storage, run_id: str) -> str:
    """The run's tracking URI, logged in (`tracking_uri_logged_in`): a resume's check before any work."""
    return tracking_uri_logged_in(read_stored_preset(storage, run_id).get("tracking", {}).get("tracking_uri", ""),
                                  run_id)


def tracking_uri_logged_in(uri: str, run_id: str) -> str:
    """The stored tracking URI, its masked password (never stored) given from MLFLOW_TRACKING_PASSWORD;
    refused in one line where the environment has none."""
    if not masked_password(uri):
        return uri
    if password := os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        return with_password(uri, password)
    raise InvalidPreset("tracking.tracking_uri", f"run {run_id} logged in to {uri} with a password, which runs do not "
                        "store; allowed: the password in MLFLOW_TRACKING_PASSWORD")


def restore(storage: Storage, run_id: str, learner: Learner, preset: Preset,
            dataset: ExperienceDataset | None = None) -> Restored:
    """Load the newest valid checkpoint of `run_id` into `learner`; returns the loop's state.
    `dataset`: the preset's, which went into the replay memory before anything collected."""
    layout = RunLayout(run_id)
    loaded = read_newest_valid_checkpoint(storage, layout)
    learner.load_state_dict(decode_state(loaded.blobs[LEARNER_TENSORS], loaded.blobs[LEARNER_TREE]))
    state = LoopState.from_json(loaded.blobs[STATE_BLOB])
    if isinstance(learner, ReplayLearner) and REPLAY_BLOB in loaded.blobs:
        learner.replay.load_state_dict(decode_arrays(loaded.blobs[REPLAY_BLOB]))
    elif isinstance(learner, ReplayLearner):
        position = json.loads(loaded.blobs[REPLAY_POSITION])
        try:
            rebuild_replay(learner, _newest_first(storage, layout, state, preset, dataset), position)
        except CheckpointError as error:
            raise CheckpointError(f"{error}: v{state.version}, shards {storage.url(layout.shards)}") from None
    return Restored(state, loaded.refused)


def rebuild_replay(learner: ReplayLearner, newest_first: Iterator[Callable[[], list[Rollout]]],
                   position: dict[str, int]) -> None:
    """Insert again the newest groups of rollouts that cover the memory's capacity, from the slot
    the first of them had, so the memory ends where the checkpoint says it stood (`position`).
    A group is read only if it is needed (older shards may be retired)."""
    tail: list[list[Rollout]] = []
    steps = 0
    for read_group in newest_first:
        if steps >= learner.replay.capacity:
            break
        rollouts = read_group()
        tail.append(rollouts)
        steps += sum(rollout.env_steps for rollout in rollouts)
    learner.replay.start_before(position, [rollout for rollouts in tail for rollout in rollouts])
    for rollout in (rollout for rollouts in reversed(tail) for rollout in rollouts):
        learner.replay.add(rollout)
    if learner.replay.position() != position:
        raise CheckpointError(f"rebuilding the replay memory ended at {learner.replay.position()}, not where the "
                              f"checkpoint stood ({position})")


def _newest_first(storage: Storage, layout: RunLayout, state: LoopState, preset: Preset,
                  dataset: ExperienceDataset | None) -> Iterator[Callable[[], list[Rollout]]]:
    """What went into the memory, newest first, as readers of each group: the shards, then the
    dataset."""
    for keys in inserted_newest_first(storage, layout, state, preset):
        yield partial(_read_shards, storage, keys)
    if dataset is not None:
        yield lambda: list(dataset.rollouts())


def _read_shards(storage: Storage, keys: list[str]) -> list[Rollout]:
    return [read_shard_at(storage, key) for key in keys]


def inserted_newest_first(storage: Storage, layout: RunLayout, state: LoopState, preset: Preset
                          ) -> Iterator[list[str]]:
    """The shards a replay learner had inserted by `state`, newest first, as the groups it
    inserted together: each SYNC round, each ASYNC chunk, then heatup's (an offline run: none; a
    collect-only run: heatup's alone)."""
    if preset.offline:
        return
    workers = preset.distribution.rollout_workers
    if preset.distribution.mode == "async":
        yield from ([record.key] for record, _ in records_newest_first(storage, layout, state.version)
                    if record.admitted)
    elif not preset.collect_only:  # a collect-only run's rounds went to storage alone
        yield from ([layout.shard(version, w) for w in range(workers)] for version in range(state.version - 1, -1, -1))
    heatup = [layout.shard(None, w) for w in range(workers) if storage.exists(layout.shard(None, w))]
    if heatup:
        yield heatup


LEARNER_WARM_START = "learner:"  # warm_start="learner:RUN_ID": a run's whole learner, from this storage
_FRESH = ("rng", "generator", "train_steps")  # what a warm-started learner keeps of its own


def warm_start_learner(learner: Learner, storage: Storage, source: str) -> None:
    """Start `learner` from a run's checkpoint in `storage` (`source`: RUN_ID, its newest valid one,
    or RUN_ID@vN): its networks, target networks, optimiser moments and observation statistics (an
    offline run's critics with its policy); its RNGs and counters stay the new run's, and so do
    its settings (learning rates, a fixed entropy coefficient: `load_copied_state`). Raises
    UnusableWarmStart where there is no such checkpoint or the learners differ."""
    run_id, version = learner_source(source)
    names = [LEARNER_TENSORS, LEARNER_TREE]
    try:
        blobs = read_newest_valid_checkpoint(storage, RunLayout(run_id), names).blobs if version is None \
            else read_checkpoint(storage, RunLayout(run_id), version, names)
        state = decode_state(blobs[LEARNER_TENSORS], blobs[LEARNER_TREE])
    except CheckpointError as error:
        raise UnusableWarmStart("warm_start", f"no learner of run {run_id!r} to start from: {error}") from None
    own = learner.state_dict()
    if set(state) != set(own):
        raise UnusableWarmStart("warm_start", f"run {run_id!r}'s learner holds {sorted(state)}, this preset's "
                                              f"{sorted(own)}: allowed: a run of the same agent")
    try:
        learner.load_copied_state({name: own[name] if name in _FRESH else value for name, value in state.items()})
    except (RuntimeError, ValueError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0]
        raise UnusableWarmStart("warm_start", f"run {run_id!r}'s learner does not fit this preset's "
                                              f"(agent.hidden_sizes?): {first_line}") from None


def copy_replay_memory(learner: ReplayLearner, storage: Storage, run_id: str, version: int) -> None:
    """A population member's copy of another's replay memory as that one checkpointed it at
    `version` (its sweep stores memories with checkpoints: storage.checkpoint_replay)."""
    try:
        blob = read_checkpoint(storage, RunLayout(run_id), version, [REPLAY_BLOB])[REPLAY_BLOB]
    except CheckpointError as error:
        raise CheckpointError(f"no replay memory of run {run_id!r} at v{version} to copy: {error}") from None
    learner.replay.load_state_dict(decode_arrays(blob))


def learner_source(source: str) -> tuple[str, int | None]:
    """`RUN_ID` or `RUN_ID@vN` (learner:... warm starts): the run, and the version (None: newest)."""
    run_id, at, version = source.partition("@")
    if not at:
        return run_id, None
    if not (version.startswith("v") and version[1:].isdigit()):
        raise UnusableWarmStart("warm_start", f"learner:{source}: the version after @ is vN (learner:{run_id}@v12); "
                                              "allowed: learner:RUN_ID or learner:RUN_ID@vN")
    return run_id, int(version[1:])
