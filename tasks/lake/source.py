"""Experience a run did not collect: a Minari dataset (`gymflow export` writes one from a run),
or gymflow runs' own shards, read as rollouts that go into a replay learner's memory the way
collected ones do.

`open_dataset` checks the source before any work: that it is there and readable, and that its
spaces are the env's. A dataset under an s3:// root is copied to a local folder first (Minari
reads local files); HDF5 and Arrow are read by Minari's own readers, shards by gymflow's own,
nothing is unpickled. Runs are read as `gymflow export` reads them: whole episodes, stitched
across shards by each env's cursor.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gymnasium import spaces

from gymflow.agents.batches import Rollout
from gymflow.envs.parts import Part, flatten_parts, observation_parts
from gymflow.errors import GymflowError, InvalidPreset
from gymflow.presets.model import DatasetConfig, StorageConfig
from gymflow.tasks.storage.objects import Storage, StorageLocation, open_storage, storage_location
from gymflow.tasks.storage.shards import ShardError

STEPS_PER_ROLLOUT = 50_000  # episodes are handed to the memory in rollouts of about this many steps


class EpisodeArrays(NamedTuple):
    """One whole episode, whatever kept it."""

    observations: np.ndarray  # [T + 1, *obs]
    actions: np.ndarray  # [T, *action]
    rewards: np.ndarray  # [T]
    terminated: bool  # its last step ended it (else it was cut: truncated)


@dataclass
class ExperienceDataset:
    """A source found and checked: what it is, where, what it holds, and its episodes as rollouts."""

    name: str  # the dataset id, or the runs
    url: str
    episodes: int
    steps: int
    read_episodes: Callable[[], Iterable[EpisodeArrays]] = field(repr=False)  # every episode, in order
    observation_dtype: Any  # what the env's observations are kept as (float32 vectors)
    _local_copy: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # an s3:// root's

    def rollouts(self) -> Iterator[Rollout]:
        """Every episode in the source's order, batched into rollouts of one env (N = 1)."""
        batch: list[EpisodeArrays] = []
        for episode in self.read_episodes():
            batch.append(episode)
            if sum(len(e.rewards) for e in batch) >= STEPS_PER_ROLLOUT:
                yield episodes_rollout(batch, self.observation_dtype)
                batch = []
        if batch:
            yield episodes_rollout(batch, self.observation_dtype)


def episodes_rollout(episodes: list[EpisodeArrays], observation_dtype: Any) -> Rollout:
    """Whole episodes one after another as a rollout of one env: each ends where it terminated
    or was truncated."""
    obs = np.concatenate([np.asarray(e.observations[:-1], observation_dtype) for e in episodes])
    ends = np.cumsum([len(e.rewards) for e in episodes]) - 1
    terminated = np.zeros(len(obs), bool)
    terminated[ends] = [e.terminated for e in episodes]
    truncated = np.zeros(len(obs), bool)
    truncated[ends] = ~terminated[ends]
    final = np.stack([np.asarray(e.observations[-1], observation_dtype) for e in episodes])
    actions = np.concatenate([np.asarray(e.actions) for e in episodes])
    return Rollout(obs=obs[:, None], actions=actions[:, None], rewards=np.concatenate(
        [np.asarray(e.rewards, np.float32) for e in episodes])[:, None], terminated=terminated[:, None],
        truncated=truncated[:, None], done_index=ends.astype(np.int64), done_obs=final, last_obs=final[-1:],
        log_probs=np.zeros((len(obs), 1), np.float32))


def open_dataset(config: DatasetConfig, storage: StorageConfig, observation_space: spaces.Space,
                 action_space: spaces.Space) -> ExperienceDataset:
    """The source `config` names (its runs under `storage` unless it names a root), checked
    against the env's spaces; raises InvalidPreset (one line, naming the field) where it is
    missing, unreadable or of other spaces."""
    dtype = np.uint8 if observation_space.dtype == np.uint8 else np.float32
    if config.runs:
        location = StorageLocation(config.root, config.options) if config.root else storage_location(storage)
        return open_runs(config.runs, open_storage(location), observation_space, action_space, dtype)
    if config.decisions is not None:
        return open_decisions(config, storage, observation_space, action_space, dtype)
    return open_minari_dataset(config, observation_space, action_space, dtype)


def default_datasets_root() -> str:
    """Minari's own root: MINARI_DATASETS_PATH, else ~/.minari/datasets."""
    return os.environ.get("MINARI_DATASETS_PATH") or str(Path.home() / ".minari" / "datasets")


def open_minari_dataset(config: DatasetConfig, observation_space: spaces.Space, action_space: spaces.Space,
                        dtype: Any) -> ExperienceDataset:
    minari = _minari()
    storage = open_storage(StorageLocation(config.root or default_datasets_root(), config.options))
    folder = f"{config.id}/data"
    if not storage.exists(f"{folder}/metadata.json"):
        raise InvalidPreset("dataset.id", f"no Minari dataset {config.id!r} under {storage.url()} "
                                          f"({storage.url(folder)}/metadata.json is missing)")
    local_copy, path = None, storage.path(folder)
    if not storage.local:  # object storage: Minari reads local files
        local_copy = tempfile.TemporaryDirectory(prefix="gymflow-dataset-")
        path = str(Path(local_copy.name, "data"))
        storage.download(folder, path)
    try:
        dataset = minari.MinariDataset(path)
        episodes, steps = dataset.total_episodes, dataset.total_steps
        for _ in dataset.iterate_episodes([0, episodes - 1]):  # opens the data file: a truncated one fails here
            pass
    except Exception as error:  # h5py's, pyarrow's or Minari's own: the dataset is damaged
        raise InvalidPreset("dataset.id", f"the dataset at {storage.url(folder)} cannot be read: "
                                          f"{type(error).__name__}: {error}".splitlines()[0]) from None
    _check_spaces("dataset.id", repr(config.id), (dataset.observation_space, dataset.action_space),
                  (observation_space, action_space))
    parts = observation_parts(observation_space)
    return ExperienceDataset(config.id, storage.url(config.id), episodes, steps,
                             lambda: (_minari_episode(e, parts) for e in dataset.iterate_episodes()), dtype, local_copy)


def _minari_episode(episode: Any, parts: tuple[Part, ...]) -> EpisodeArrays:
    """An episode that says neither terminated nor truncated counts as truncated: it is bootstrapped
    from. A Dict observation's parts are flattened as the env flattens them."""
    observations = flatten_parts(parts, episode.observations) if parts else episode.observations
    return EpisodeArrays(observations, episode.actions, episode.rewards, bool(episode.terminations[-1]))


def open_runs(run_ids: list[str], storage: Storage, observation_space: spaces.Space, action_space: spaces.Space,
              dtype: Any) -> ExperienceDataset:
    """Runs' stored experience as one source: each run's episodes, the runs in the order given.
    Every shard is read once here, so a damaged one stops the run before any work."""
    from gymflow.tasks.lake.export import find_run_experience  # the stitching `gymflow export` does

    experiences = []
    for run_id in run_ids:
        try:
            experience = find_run_experience(storage, run_id)
        except GymflowError as error:
            raise InvalidPreset("dataset.runs", error.problem) from None
        _check_spaces("dataset.runs", f"run {run_id!r}", (experience.observation_space, experience.action_space),
                      (observation_space, action_space))
        experiences.append(experience)

    def read_episodes() -> Iterator[EpisodeArrays]:
        for experience in experiences:
            for stitcher in experience.stitchers():
                for episode in stitcher.read(storage):
                    yield EpisodeArrays(episode.observations, episode.actions, episode.rewards, episode.terminated)

    episodes = steps = 0
    try:
        for episode in read_episodes():
            episodes, steps = episodes + 1, steps + len(episode.actions)
    except ShardError as error:
        raise InvalidPreset("dataset.runs", f"the runs' experience cannot be read: {error}") from None
    if not episodes:
        raise InvalidPreset("dataset.runs", f"runs {', '.join(run_ids)} hold no whole episode yet")
    return ExperienceDataset(f"runs {', '.join(run_ids)}", storage.url("runs"), episodes, steps, read_episodes, dtype)


def open_decisions(config: DatasetConfig, storage_config: StorageConfig, observation_space: spaces.Space,
                   action_space: spaces.Space, dtype: Any) -> ExperienceDataset:
    """A decision log as a source: each decision whose outcome arrived (and that `holdout` leaves to
    learning), a step of its own from its observation to the outcome's next one; a continuous action
    as the env received it, clipped to the bounds."""
    from gymflow.tasks.lake.decision_log import decision_log_location, held_out, logged_part, read_logged

    assert config.decisions is not None
    storage = open_storage(decision_log_location(config.decisions, config.options, storage_config))
    try:
        logged = read_logged(storage, "", config.logged_before)
    except GymflowError as error:
        raise InvalidPreset("dataset.decisions", error.problem) from None
    logged = logged_part(logged, ~held_out(logged.request_ids, config.holdout))
    if not len(logged.actions):
        raise InvalidPreset("dataset.decisions", f"{storage.url()} holds no decision with its outcome to learn from")
    their_observations = spaces.Box(-np.inf, np.inf, logged.observations.shape[1:])
    _check_spaces("dataset.decisions", f"the decision log at {storage.url()}", (their_observations, action_space),
                  (observation_space, action_space))
    actions = logged.actions if not isinstance(action_space, spaces.Box) else np.clip(
        logged.actions, action_space.low, action_space.high)

    def read_episodes() -> Iterator[EpisodeArrays]:
        for row in range(len(actions)):
            yield EpisodeArrays(np.stack([logged.observations[row], logged.next_observations[row]]),
                                actions[row:row + 1], logged.rewards[row:row + 1], bool(logged.terminal[row]))

    return ExperienceDataset(config.name, storage.url(), len(actions), len(actions), read_episodes, dtype)


def _check_spaces(field_name: str, what_it_is: str, theirs: tuple[spaces.Space, spaces.Space],
                  ours: tuple[spaces.Space, spaces.Space]) -> None:
    for what, their_space, our_space in zip(("observation", "action"), theirs, ours, strict=True):
        if not same_shape(their_space, our_space):
            raise InvalidPreset(field_name, f"{what_it_is} has {what}s {_described(their_space)}, the env's are "
                                            f"{_described(our_space)}: allowed: experience of this env")


def same_shape(theirs: spaces.Space, ours: spaces.Space) -> bool:
    """Spaces whose values can be used as each other's: discrete of the same n, boxes of the same
    shape (their dtypes and bounds may differ: a dataset may keep float64 observations), Dicts of
    the same keys, each of the same shape."""
    if parts := observation_parts(ours):  # a Dict observation, flattened at the env's boundary
        return isinstance(theirs, spaces.Dict) and \
            {key: part.shape for key, part in theirs.spaces.items()} == {part.key: part.shape for part in parts}
    if isinstance(ours, spaces.Discrete):
        return isinstance(theirs, spaces.Discrete) and theirs.n == ours.n
    return isinstance(theirs, spaces.Box) and isinstance(ours, spaces.Box) and theirs.shape == ours.shape


def _described(space: spaces.Space) -> str:
    if observation_parts(space):  # a Dict observation, flattened: described as the Dict it keeps
        space = space.dict_space
    if isinstance(space, spaces.Dict):
        return "Dict(" + ", ".join(f"{key}: {tuple(part.shape)}" for key, part in space.spaces.items()) + ")"
    if isinstance(space, spaces.Box):
        return f"Box{space.shape}"
    return str(space)


def _minari() -> Any:
    try:
        import minari
    except ImportError:
        raise InvalidPreset("dataset", "datasets are read with Minari, which gymflow's lake extra installs: "
                                       "pip install 'gymflow[lake]'") from None
    return minari
