"""`gymflow export`: a run's experience as a Minari dataset (Farama's format for offline RL,
which `minari.load_dataset` and d3rlpy read), in a local folder or object storage.

Episodes are stitched from the run's shards (tasks/lake/episodes.py). Each keeps the seed its
env was reset with and, in its infos, the policy version that chose each action; the dataset's
metadata names the run, its preset and its env wrappers. Observations are written exactly (no
JPEG), frame stacks as each step's newest frame, a Dict observation as its Dict of parts. The
dataset is built in a temporary folder and copied to its destination only when whole, its
metadata last.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from gymflow.envs.agents import AgentTable, make_parallel_env
from gymflow.envs.make import EnvSpecError, is_image, is_multi_agent, make_env
from gymflow.envs.parts import Part, observation_parts, unflatten_parts
from gymflow.envs.seeding import derive_seed
from gymflow.errors import GymflowError
from gymflow.presets.load import validate_preset_data
from gymflow.presets.model import Preset
from gymflow.tasks.lake.agent_episodes import AgentEpisodeStitcher
from gymflow.tasks.lake.episodes import Episode, EpisodeStitcher, WorkerStream, worker_streams
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.records import read_stored_preset
from gymflow.tasks.storage.shards import ShardError

DataFormat = Literal["hdf5", "arrow"]
STEPS_PER_WRITE = 100_000  # episodes are handed to Minari in batches of about this many steps
METADATA = "metadata.json"


class ExportRefused(GymflowError):
    """An export that cannot be made, found before anything is written."""


@dataclasses.dataclass(frozen=True)
class ExportReport:
    dataset_id: str
    url: str  # where the dataset's folder is
    episodes: int
    steps: int
    workers: int
    retired_before: dict[int, str]  # per worker whose first shards were retired, its first kept (v000003, chunk 12):
    # its envs are read from their first whole episode there
    group: str | None = None  # a PettingZoo run's agent group exported


@dataclasses.dataclass(frozen=True)
class AgentGroup:
    """The agents of a PettingZoo run's games whose episodes an export keeps: one group's."""

    name: str
    agents: tuple[str, ...]  # their names
    indices: tuple[int, ...]  # their places in a game (its rows)
    per_game: int
    observation_size: int  # each keeps its own observation, zero-padded to the group's longest


@dataclasses.dataclass(frozen=True)
class RunExperience:
    """What an export reads: the run's preset, its shards by worker, and the spaces of its data."""

    run_id: str
    preset: Preset
    streams: list[WorkerStream]
    observation_space: spaces.Space  # as the dataset keeps them: a Box, or a Dict observation's Dict of parts
    action_space: spaces.Space
    newest_frame: bool  # observations are frame stacks: each step keeps its newest frame
    parts: tuple[Part, ...] = ()  # a Dict observation's: the shards keep it flat (envs/parts.py)
    group: AgentGroup | None = None  # a PettingZoo run's: the agents exported

    def stitchers(self) -> list[EpisodeStitcher | AgentEpisodeStitcher]:
        env_seeds = [derive_seed(self.preset.seed, "envs", stream.worker) for stream in self.streams]  # as rounds.py
        if self.group is None:
            return [EpisodeStitcher(stream, seed, self.newest_frame) for stream, seed in zip(self.streams, env_seeds)]
        first_order = -1 if self.preset.schedule.heatup_env_steps else 0  # a worker's first shard: heatup's, or v0
        return [AgentEpisodeStitcher(stream, seed, self.group.per_game, frozenset(self.group.indices),
                                     self.group.observation_size, first_order)
                for stream, seed in zip(self.streams, env_seeds)]


def find_run_experience(storage: Storage, run_id: str) -> RunExperience:
    """A one-agent run's experience (a PettingZoo run's is exported a group at a time)."""
    preset, streams = _stored_run(storage, run_id)
    if is_multi_agent(preset.env.id):
        raise ExportRefused("run_id", f"run {run_id!r} is of a PettingZoo env ({preset.env.id}), whose experience is "
                                      "each agent group's: `gymflow export RUN_ID --group NAME` writes one group's "
                                      "episodes as a dataset")
    return _one_agent_experience(run_id, preset, streams)


def find_group_experience(storage: Storage, run_id: str, group: str | None) -> RunExperience:
    """A PettingZoo run's experience of one agent group: `group`, or the run's only one."""
    preset, streams = _stored_run(storage, run_id)
    if not is_multi_agent(preset.env.id):
        raise _no_groups(run_id, preset)
    return _group_experience(run_id, preset, streams, group)


def _no_groups(run_id: str, preset: Preset) -> ExportRefused:
    return ExportRefused("--group", f"run {run_id!r} is of one agent ({preset.env.id}): --group names an agent "
                                    "group of a PettingZoo run")


def _group_experience(run_id: str, preset: Preset, streams: list[WorkerStream], group: str | None) -> RunExperience:
    try:
        parallel_env = make_parallel_env(preset.env.id, preset.env.kwargs)
    except EnvSpecError as error:
        raise ExportRefused(error.field, error.problem) from None
    try:
        table = AgentTable.of(parallel_env, preset.env.id)
        agent_spaces = {agent: parallel_env.observation_space(agent) for agent in table.agents}
    except EnvSpecError as error:
        raise ExportRefused(error.field, error.problem) from None
    finally:
        parallel_env.close()
    names = tuple(dict.fromkeys(table.groups))
    if group is None and len(names) > 1:
        raise ExportRefused("--group", f"run {run_id!r}'s agents are in groups {', '.join(names)}: a dataset holds "
                                       "one group's episodes; name it with --group")
    group = group or names[0]
    if group not in names:
        raise ExportRefused("--group", f"run {run_id!r} has no agent group {group!r}; allowed: {', '.join(names)}")
    indices = tuple(k for k, name in enumerate(table.groups) if name == group)
    members = tuple(table.agents[k] for k in indices)
    observation_space = _group_observation_space([agent_spaces[agent] for agent in members])
    return RunExperience(run_id, preset, streams, observation_space, table.action_space, False,
                         group=AgentGroup(group, members, indices, len(table.agents), observation_space.shape[0]))


def _group_observation_space(agent_spaces: list[spaces.Box]) -> spaces.Box:
    """The agents' one observation space, as float32; zero-padded to the longest where they differ."""
    if all(space == agent_spaces[0] for space in agent_spaces):
        space = agent_spaces[0]
        return spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32)
    return spaces.Box(-np.inf, np.inf, (max(space.shape[0] for space in agent_spaces),), np.float32)


def _stored_run(storage: Storage, run_id: str) -> tuple[Preset, list[WorkerStream]]:
    layout = RunLayout(run_id)
    if not storage.exists(layout.preset):
        raise ExportRefused("run_id", f"no run {run_id!r} under {storage.url()} (its preset.yaml is missing)")
    preset = validate_preset_data(read_stored_preset(storage, run_id))
    streams = worker_streams(storage, layout)
    if not streams:
        raise ExportRefused("run_id", f"run {run_id!r} has no shards left under {storage.url(layout.shards)}")
    return preset, streams


def _one_agent_experience(run_id: str, preset: Preset, streams: list[WorkerStream]) -> RunExperience:
    try:
        env = make_env(preset.env.id, preset.env.kwargs, preprocessing=preset.env.preprocessing())
    except EnvSpecError as error:
        raise ExportRefused(error.field, error.problem) from None
    observation_space, action_space = env.observation_space, env.action_space
    env.close()
    newest_frame = is_image(observation_space) and (preset.env.frame_stack > 1 or observation_space.shape[0] == 1)
    if parts := observation_parts(observation_space):
        return RunExperience(run_id, preset, streams, observation_space.dict_space, action_space, False, parts)
    if newest_frame:
        observation_space = spaces.Box(0, 255, observation_space.shape[1:], np.uint8)
    elif observation_space.dtype != np.uint8:  # shards keep vectors as float32 (envs/vector.py)
        observation_space = spaces.Box(observation_space.low.astype(np.float32),
                                       observation_space.high.astype(np.float32), dtype=np.float32)
    return RunExperience(run_id, preset, streams, observation_space, action_space, newest_frame)


@dataclasses.dataclass(frozen=True)
class DatasetRequest:
    """The dataset an export writes: its Minari id and format, and for a PettingZoo run, whose
    episodes (an agent group; None: the run's only group)."""

    dataset_id: str
    data_format: DataFormat = "hdf5"
    group: str | None = None


def export_run(source: Storage, run_id: str, destination: Storage, request: DatasetRequest,
               progress: Callable[[int, int], None] | None = None) -> ExportReport:
    """Write run `run_id`'s experience (in `source`) as the dataset `request` asks for under
    `destination` (a Minari datasets root); `progress(episodes, steps)` after each batch."""
    minari, dataset_id = _minari(), request.dataset_id
    try:
        minari.dataset.minari_dataset.parse_dataset_id(dataset_id)
    except (ValueError, TypeError):  # TypeError: no version
        raise ExportRefused("--id", f"{dataset_id!r} is not a Minari dataset id; allowed: "
                                    "[namespace/]name-vN, e.g. gymflow/cartpole-v0") from None
    folder = dataset_folder(dataset_id)
    if destination.list(folder):
        raise ExportRefused("--id", f"a dataset {dataset_id!r} exists already at {destination.url(folder)}")
    experience = _find_experience(source, run_id, request.group)
    stitchers = experience.stitchers()
    with tempfile.TemporaryDirectory(prefix="gymflow-export-") as local_root:
        previous = os.environ.get("MINARI_DATASETS_PATH")
        os.environ["MINARI_DATASETS_PATH"] = local_root  # where minari builds it
        try:
            dataset, episodes, steps = None, 0, 0
            for batch in _batches(episode for stitcher in stitchers for episode in stitcher.read(source)):
                buffers = [_episode_buffer(episode, experience) for episode in batch]
                if dataset is None:
                    dataset = _create(minari, dataset_id, buffers, experience, request.data_format)
                else:
                    dataset.update_dataset_from_buffer(buffers)
                episodes, steps = episodes + len(batch), steps + sum(e.steps for e in batch)
                if progress is not None:
                    progress(episodes, steps)
        except ShardError as error:  # nothing has reached the destination
            raise ExportRefused("run_id", f"run {run_id!r} cannot be exported: {error}") from None
        finally:
            _restore_environment("MINARI_DATASETS_PATH", previous)
        if dataset is None:
            raise ExportRefused("run_id", f"run {run_id!r} holds no whole episode yet")
        _copy_folder(Path(local_root, folder), destination, folder)
    retired = {s.stream.worker: s.stream.first_kept for s in stitchers if not s.from_the_start}
    return ExportReport(dataset_id, destination.url(folder), episodes, steps, len(experience.streams), retired,
                        None if experience.group is None else experience.group.name)


def _find_experience(storage: Storage, run_id: str, group: str | None) -> RunExperience:
    """A one-agent run's experience, or a PettingZoo run's group's: the run read once."""
    preset, streams = _stored_run(storage, run_id)
    if is_multi_agent(preset.env.id):
        return _group_experience(run_id, preset, streams, group)
    if group is not None:
        raise _no_groups(run_id, preset)
    return _one_agent_experience(run_id, preset, streams)


def _minari() -> Any:
    try:
        import minari
    except ImportError:
        raise ExportRefused("--to", "exports need Minari, which gymflow's lake extra installs: "
                                    "pip install 'gymflow[lake]'") from None
    return minari


def dataset_folder(dataset_id: str) -> str:
    """Where Minari keeps a dataset under its datasets root."""
    return dataset_id


def _batches(episodes: Iterable[Episode]) -> Iterator[list[Episode]]:
    batch: list[Episode] = []
    for episode in episodes:
        batch.append(episode)
        if sum(e.steps for e in batch) >= STEPS_PER_WRITE:
            yield batch
            batch = []
    if batch:
        yield batch


def _episode_buffer(episode: Episode, experience: RunExperience) -> Any:
    """The episode as Minari takes it; a Dict observation's flat arrays split back into its parts."""
    from minari.data_collector import EpisodeBuffer

    # infos run alongside the observations (T + 1): entry t is about the action taken at observation t;
    # the final observation takes no action, and repeats the last entry
    ended = np.zeros(episode.steps, dtype=bool)
    ended[-1] = True
    same = np.ones(episode.steps + 1, dtype=np.int64)
    infos = {
        "policy_version": np.append(episode.policy_versions, episode.policy_versions[-1]),
        "life_lost": np.append(False, episode.life_lost),  # entry t + 1: step t lost a life
        "worker": same * episode.worker, "env": same * episode.env, "episode_index": same * episode.index,
    }
    observations, parts = episode.observations, experience.parts
    if episode.agent is not None:  # env is the game
        infos["agent"] = same * episode.agent
    elif parts:
        observations = unflatten_parts(parts, observations)
    return EpisodeBuffer(seed=episode.seed, observations=observations, actions=episode.actions,
                         rewards=episode.rewards.astype(np.float64), terminations=ended & episode.terminated,
                         truncations=ended & (not episode.terminated), infos=infos)


def _create(minari: Any, dataset_id: str, buffers: list, experience: RunExperience, data_format: DataFormat) -> Any:
    preset, group = experience.preset, experience.group
    whose = "" if group is None else f" by its agents {', '.join(group.agents)} (group {group.name}; infos name " \
        "each episode's game as env, its agent's index in the game as agent)"
    with warnings.catch_warnings():  # that no author_email and no eval_env were given (none is wanted)
        warnings.filterwarnings("ignore", category=UserWarning, module="minari")
        dataset = minari.create_dataset_from_buffers(
            dataset_id, buffers, env=None if group else _env_spec(preset), action_space=experience.action_space,
            observation_space=experience.observation_space, algorithm_name=f"gymflow {preset.agent.algo}",
            author="gymflow", description=(
                f"The experience gymflow run {experience.run_id} collected (preset {preset.name}){whose}. Rewards and "
                "observations as its learner saw them: the env spec is the bare env (none for a PettingZoo env); "
                "gymflow's env settings are in the metadata (gymflow_env)."),
            data_format=data_format, jpeg_encoding=False,
        )
    dataset.storage.update_metadata({
        "gymflow_run_id": experience.run_id, "gymflow_preset": preset.name,
        "gymflow_preset_yaml": _preset_yaml(preset), "gymflow_env": preset.env.model_dump_json(),
        "gymflow_frames": "each step's newest frame of its stack" if experience.newest_frame else "as observed",
        **({} if group is None else {"gymflow_group": group.name, "gymflow_agents": list(group.agents)}),
    })
    return dataset


def _env_spec(preset: Preset) -> gym.envs.registration.EnvSpec:
    env_id, kwargs = preset.env.id, dict(preset.env.kwargs)
    if ":" in env_id:  # a 'module:Class' entry point: a spec of its own, named after the class
        return gym.envs.registration.EnvSpec(id=f"{env_id.rpartition(':')[2]}-v0", entry_point=env_id, kwargs=kwargs)
    spec = gym.spec(env_id)
    return dataclasses.replace(spec, kwargs={**spec.kwargs, **kwargs})


def _preset_yaml(preset: Preset) -> str:
    import yaml

    from gymflow.presets.redaction import redacted

    return yaml.safe_dump(redacted(preset.model_dump(mode="json")), sort_keys=False)


def _copy_folder(local: Path, destination: Storage, prefix: str) -> None:
    """Every file of `local` to `prefix` in `destination`, the metadata last: a dataset Minari
    can load is a whole one."""
    files = sorted(path for path in local.rglob("*") if path.is_file())
    for path in sorted(files, key=lambda path: path.name == METADATA):
        destination.upload(f"{prefix}/{path.relative_to(local).as_posix()}", str(path))


def _restore_environment(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
