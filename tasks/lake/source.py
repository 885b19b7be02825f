"""Experience a run did not collect: a Minari dataset (`gymflow export` writes one from a run),
read as rollouts that go into a replay learner's memory the way collected ones do.

`open_dataset` checks the dataset before any work: that it is there and readable, and that its
spaces are the env's. A dataset under an s3:// root is copied to a local folder first (Minari
reads local files); HDF5 and Arrow are read by Minari's own readers, nothing is unpickled.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from gymflow.agents.batches import Rollout
from gymflow.errors import InvalidPreset
from gymflow.presets.model import DatasetConfig
from gymflow.tasks.storage.objects import StorageLocation, open_storage

STEPS_PER_ROLLOUT = 50_000  # episodes are handed to the memory in rollouts of about this many steps


@dataclass
class ExperienceDataset:
    """A dataset found and checked: where it is, what it holds, and its episodes as rollouts."""

    dataset_id: str
    url: str
    episodes: int
    steps: int
    minari_dataset: Any
    observation_dtype: Any  # what the env's observations are kept as (float32 vectors)
    _local_copy: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # an s3:// root's

    def rollouts(self) -> Iterator[Rollout]:
        """Every episode in the dataset's order, batched into rollouts of one env (N = 1)."""
        batch: list[Any] = []
        for episode in self.minari_dataset.iterate_episodes():
            batch.append(episode)
            if sum(len(e.rewards) for e in batch) >= STEPS_PER_ROLLOUT:
                yield episodes_rollout(batch, self.observation_dtype)
                batch = []
        if batch:
            yield episodes_rollout(batch, self.observation_dtype)


def episodes_rollout(episodes: list[Any], observation_dtype: Any) -> Rollout:
    """Whole episodes one after another as a rollout of one env: each ends where it terminated
    or was truncated (an episode that says neither counts as truncated: it is bootstrapped from)."""
    obs = np.concatenate([np.asarray(e.observations[:-1], observation_dtype) for e in episodes])
    ends = np.cumsum([len(e.rewards) for e in episodes]) - 1
    terminated = np.zeros(len(obs), bool)
    terminated[ends] = [bool(e.terminations[-1]) for e in episodes]
    truncated = np.zeros(len(obs), bool)
    truncated[ends] = ~terminated[ends]
    final = np.stack([np.asarray(e.observations[-1], observation_dtype) for e in episodes])
    actions = np.concatenate([np.asarray(e.actions) for e in episodes])
    return Rollout(obs=obs[:, None], actions=actions[:, None], rewards=np.concatenate(
        [np.asarray(e.rewards, np.float32) for e in episodes])[:, None], terminated=terminated[:, None],
        truncated=truncated[:, None], done_index=ends.astype(np.int64), done_obs=final, last_obs=final[-1:],
        log_probs=np.zeros((len(obs), 1), np.float32))


def default_datasets_root() -> str:
    """Minari's own root: MINARI_DATASETS_PATH, else ~/.minari/datasets."""
    return os.environ.get("MINARI_DATASETS_PATH") or str(Path.home() / ".minari" / "datasets")


def open_dataset(config: DatasetConfig, observation_space: spaces.Space, action_space: spaces.Space
                 ) -> ExperienceDataset:
    """The dataset `config` names, checked against the env's spaces; raises InvalidPreset (one
    line, naming the field) where it is missing, unreadable or of other spaces."""
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
    _check_spaces(config.id, dataset, observation_space, action_space)
    dtype = np.uint8 if observation_space.dtype == np.uint8 else np.float32
    return ExperienceDataset(config.id, storage.url(config.id), episodes, steps, dataset, dtype, local_copy)


def _check_spaces(dataset_id: str, dataset: Any, observation_space: spaces.Space, action_space: spaces.Space) -> None:
    for what, theirs, ours in (("observation", dataset.observation_space, observation_space),
                               ("action", dataset.action_space, action_space)):
        if not same_shape(theirs, ours):
            raise InvalidPreset("dataset.id", f"{dataset_id!r} has {what}s {_described(theirs)}, the env's are "
                                              f"{_described(ours)}: allowed: a dataset of this env")


def same_shape(theirs: spaces.Space, ours: spaces.Space) -> bool:
    """Spaces whose values can be used as each other's: discrete of the same n, boxes of the same
    shape (their dtypes and bounds may differ: a dataset may keep float64 observations)."""
    if isinstance(ours, spaces.Discrete):
        return isinstance(theirs, spaces.Discrete) and theirs.n == ours.n
    return isinstance(theirs, spaces.Box) and isinstance(ours, spaces.Box) and theirs.shape == ours.shape


def _described(space: spaces.Space) -> str:
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
