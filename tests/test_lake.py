"""`gymflow export`: a run's experience as a Minari dataset, read back with minari.load_dataset
and checked against the envs themselves: every exported episode replays, from the seed it records
and its actions, to the same observations, rewards and ending; and the dataset holds every episode
the run's shards saw end."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from mlflow import MlflowClient

from gymflow.envs.make import make_env
from gymflow.envs.parts import observation_parts, unflatten_parts
from gymflow.flows.cli import main
from gymflow.flows.improve import improve
from gymflow.presets.load import validate_preset_data
from gymflow.tasks.storage.codec import decode_arrays
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.storage.records import read_stored_preset
from tests.conftest import local_overrides, written_files
from tests.killing import kill_flow_midway

pytestmark = pytest.mark.e2e
minari = pytest.importorskip("minari")

OFF_POLICY = {"agent.train_steps_per_iteration": 8, "agent.hidden_sizes": [16], "agent.batch_size": 16,
              "schedule.heatup_env_steps": 128}
ASYNC = {"distribution.mode": "async", "distribution.samples_per_insert": 2, "distribution.commit_every_train_steps": 4}
PIXELS = {"env.id": "gymflow.envs.catch:Catch", "env.frame_stack": 2, "distribution.envs_per_worker": 2,
          "schedule.total_env_steps": 1024}
PICTURE = "gymflow.envs.picture_corridor:PictureCorridor"
DICT = {"env.id": PICTURE, "env.frame_stack": 1, "distribution.envs_per_worker": 2}  # a picture and a clock


@pytest.mark.parametrize(("preset", "extra"), [
    ("cartpole-dqn", OFF_POLICY),  # heatup's shards, then a round's
    ("cartpole-dqn", {**OFF_POLICY, **ASYNC}),  # each worker's stream of chunks
    ("catch-dqn", {**OFF_POLICY, **PIXELS}),  # frame stacks: the dataset keeps each step's newest frame
    ("catch-dqn", {**OFF_POLICY, **DICT}),  # a Dict observation: the dataset keeps its Dict of parts
], ids=["sync", "async", "pixels", "dict"])
def test_an_exported_run_replays_episode_by_episode(preset, extra, prefect_api, workspace, tiny_budget, monkeypatch):
    run = improve(preset, {**tiny_budget, **extra, "storage.keep_shards": "all", **local_overrides(workspace)})
    datasets = workspace / "datasets"
    assert main(["export", run.run_id, "--root", str(workspace / "data"), "--to", str(datasets),
                 "--id", "gymflow/test-v0"]) == 0

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(datasets))
    dataset = minari.load_dataset("gymflow/test-v0")
    storage = Storage(StorageLocation(str(workspace / "data")))
    ended = _episode_returns_in_shards(storage, run.run_id)
    assert dataset.total_episodes == len(ended) > 0  # every episode that ended, once
    assert sorted(float(sum(e.rewards)) for e in dataset) == pytest.approx(sorted(ended))
    preset_data = validate_preset_data(read_stored_preset(storage, run.run_id))
    seeds = [m["seed"] for m in dataset.storage.get_episode_metadata(range(dataset.total_episodes))]
    for episode, seed in zip(dataset, seeds, strict=True):
        _replay(episode, seed, preset_data.env, newest_frame=extra.get("env.frame_stack") == 2)
    metadata = dataset.storage.metadata
    assert metadata["gymflow_run_id"] == run.run_id and metadata["total_steps"] == sum(len(e) for e in dataset)
    versions = np.concatenate([e.infos["policy_version"] for e in dataset])
    assert versions.min() == -1 and versions.max() >= 1  # heatup's random policy, then trained versions
    if extra is DICT:  # the Dict dataset, read back into an offline run's memory as the env's flat arrays
        _learn_offline_from(preset, datasets, dataset.total_steps, workspace)


def _learn_offline_from(preset: str, datasets, steps: int, workspace) -> None:
    learned = improve(preset, {**OFF_POLICY, **DICT, "dataset.root": str(datasets), "dataset.id": "gymflow/test-v0",
                               "schedule.total_env_steps": 0, "schedule.heatup_env_steps": 0, "agent.cql_alpha": 1.0,
                               "schedule.total_train_steps": 16, **local_overrides(workspace)})
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    assert learned.env_steps == 0 and client.get_metric_history(learned.mlflow_run_id, "train/replay_size")[-1].value \
        == steps


def _episode_returns_in_shards(storage: Storage, run_id: str) -> list[float]:
    """The returns of the episodes every stored shard of the run saw end."""
    keys = [key for key in storage.list(RunLayout(run_id).shards) if key.endswith(".npz")]
    return [float(r) for key in keys for r in decode_arrays(storage.read(key))["episode_returns"]]


def _replay(episode, seed: int, env_config, newest_frame: bool) -> None:
    """The env, reset with the episode's seed and stepped with its actions, observes what it holds."""
    env = make_env(env_config.id, env_config.kwargs, preprocessing=env_config.preprocessing())
    parts = observation_parts(env.observation_space)

    def observed(obs) -> np.ndarray | dict:
        obs = np.asarray(obs)
        if parts:  # the env's flat array, as the Dict of parts the dataset keeps
            return {key: value[0] for key, value in unflatten_parts(parts, obs[None]).items()}
        return obs[-1] if newest_frame else obs.astype(np.float32)

    def kept(t: int) -> np.ndarray | dict:
        return {key: value[t] for key, value in episode.observations.items()} if parts else episode.observations[t]

    obs, _ = env.reset(seed=seed)
    np.testing.assert_equal(observed(obs), kept(0))
    for t, action in enumerate(episode.actions):
        obs, reward, terminated, truncated, _ = env.step(int(action) if np.ndim(action) == 0 else action)
        np.testing.assert_equal(observed(obs), kept(t + 1))
        assert np.float32(reward) == episode.rewards[t]
        assert (terminated, truncated) == (bool(episode.terminations[t]), bool(episode.truncations[t]))
    assert terminated or truncated
    env.close()


def test_a_run_whose_first_shards_were_retired_exports_whole_episodes_after_them(prefect_api, workspace, tiny_budget,
                                                                                    capsys, monkeypatch):
    run = improve("cartpole-ppo", {**tiny_budget, "schedule.total_env_steps": 1280, **local_overrides(workspace)})
    storage = Storage(StorageLocation(str(workspace / "data")))
    assert not storage.exists(f"{RunLayout(run.run_id).shards}/v000000/w000.npz")  # retired (keep_shards: needed)
    datasets = workspace / "datasets"
    assert main(["export", run.run_id, "--root", str(workspace / "data"), "--to", str(datasets)]) == 0
    assert "the first shards were retired (storage.keep_shards: needed); exportable: worker 0 from v0" \
        in capsys.readouterr().out

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(datasets))
    dataset = minari.load_dataset(f"gymflow/{run.run_id}-v0")
    env = validate_preset_data(read_stored_preset(storage, run.run_id)).env
    seeds = [m["seed"] for m in dataset.storage.get_episode_metadata(range(dataset.total_episodes))]
    assert dataset.total_episodes > 0
    for episode, seed in zip(dataset, seeds, strict=True):
        _replay(episode, seed, env, newest_frame=False)


def test_an_export_that_cannot_be_made_is_refused_in_one_line_with_nothing_written(prefect_api, workspace,
                                                                                     tiny_budget, capsys):
    root, datasets = str(workspace / "data"), workspace / "datasets"
    assert main(["export", "no-such-run", "--root", root, "--to", str(datasets)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gymflow: error: run_id: no run 'no-such-run' under file://{root} (its preset.yaml is missing)"]
    run = improve("cartpole-dqn", {**tiny_budget, **OFF_POLICY, **local_overrides(workspace)})
    capsys.readouterr()  # the run's own output
    assert main(["export", run.run_id, "--root", root, "--to", str(datasets), "--id", "no version"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "gymflow: error: --id: 'no version' is not a Minari dataset id; allowed: [namespace/]name-vN, "
        "e.g. gymflow/cartpole-v0"]
    assert not datasets.exists()
    assert main(["export", run.run_id, "--root", root, "--to", str(datasets), "--id", "gymflow/once-v0"]) == 0
    before = written_files(datasets)
    assert main(["export", run.run_id, "--root", root, "--to", str(datasets), "--id", "gymflow/once-v0"]) == 2
    assert "--id: a dataset 'gymflow/once-v0' exists already" in capsys.readouterr().err
    assert written_files(datasets) == before


def test_a_run_in_object_storage_exports_to_object_storage(prefect_api, workspace, tiny_budget, s3_server, monkeypatch):
    options = s3_server.options()
    root, datasets = f"s3://{s3_server.bucket}/lake-runs", f"s3://{s3_server.bucket}/lake-datasets"
    run = improve("cartpole-dqn", {**tiny_budget, **OFF_POLICY, **local_overrides(workspace), "storage.root": root,
                                   "storage.options": options, "storage.keep_shards": "all"})
    as_options = [f"{key}={value}" for key, value in options.items()]
    assert main(["export", run.run_id, "--root", root, *[f"--option={o}" for o in as_options], "--to", datasets,
                 *[f"--to-option={o}" for o in as_options], "--id", "gymflow/s3-v0", "--format", "arrow"]) == 0

    Storage(StorageLocation(datasets, options)).download("gymflow/s3-v0", str(workspace / "local" / "gymflow" / "s3-v0"))
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(workspace / "local"))
    dataset = minari.load_dataset("gymflow/s3-v0")
    assert dataset.storage.metadata["data_format"] == "arrow"
    assert dataset.total_episodes == len(_episode_returns_in_shards(Storage(StorageLocation(root, options)),
                                                                    run.run_id)) > 0


@pytest.mark.slow  # long tier: exports stay in (each kind of observation); killed runs resumed in tests/test_resume.py
def test_an_async_run_killed_and_resumed_exports_whole_consistent_streams(prefect_api, workspace, tiny_budget,
                                                                          monkeypatch):
    """The chunks a killed ASYNC run wrote after its last checkpoint are collected again by the
    resumed run: each worker's stream still continues shard to shard (the stitcher checks it)."""
    root = workspace / "data"
    run = {**tiny_budget, **OFF_POLICY, **ASYNC, "schedule.total_env_steps": 2560, "storage.keep_shards": "all",
           **local_overrides(workspace)}
    kill_flow_midway("cartpole-dqn", run, root, workspace / "killed-flow.log", kill_at=1)  # ASYNC may commit few
    (run_dir,) = (root / "runs").iterdir()
    assert main(["resume", run_dir.name, "--root", str(root), "--quiet"]) == 0
    datasets = workspace / "datasets"
    assert main(["export", run_dir.name, "--root", str(root), "--to", str(datasets), "--id", "gymflow/resumed-v0"]) == 0

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(datasets))
    dataset = minari.load_dataset("gymflow/resumed-v0")
    storage = Storage(StorageLocation(str(root)))
    env = validate_preset_data(read_stored_preset(storage, run_dir.name)).env
    seeds = [m["seed"] for m in dataset.storage.get_episode_metadata(range(dataset.total_episodes))]
    assert dataset.total_episodes == len(_episode_returns_in_shards(storage, run_dir.name)) > 0
    for episode, seed in zip(dataset, seeds, strict=True):
        _replay(episode, seed, env, newest_frame=False)


EXITS = "pettingzoo:gymflow.testing.agents:Exits"  # walkers that leave the game mid-episode, and a guide that stays


def test_a_pettingzoo_run_exports_each_agent_group_s_episodes_as_a_dataset_of_its_own(prefect_api, workspace,
                                                                                    tiny_budget, capsys, monkeypatch):
    kwargs = {"walkers": 2, "length": 6, "max_steps": 12}
    run = improve("spread-ippo", {**tiny_budget, "env.id": EXITS, "env.kwargs": kwargs, "agent.minibatch_size": 64,
                                  "agent.hidden_sizes": [16], "storage.keep_shards": "all", "tracking.video": "off",
                                  **local_overrides(workspace)})
    root, datasets = str(workspace / "data"), workspace / "datasets"
    export = ["export", run.run_id, "--root", root, "--to", str(datasets)]
    assert main(export) == 2
    assert capsys.readouterr().err.strip().endswith("agents are in groups walker, guide: a dataset holds one group's "
                                                    "episodes; name it with --group")
    assert main([*export, "--group", "guides"]) == 2
    assert "has no agent group 'guides'; allowed: walker, guide" in capsys.readouterr().err
    for group in ("walker", "guide"):
        assert main([*export, "--group", group]) == 0
    assert "exported" in capsys.readouterr().out and not list(datasets.rglob("*-guides-*"))

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(datasets))
    walkers, guides = (minari.load_dataset(f"gymflow/{run.run_id}-{group}-v0") for group in ("walker", "guide"))
    assert (walkers.observation_space.shape, guides.observation_space.shape) == ((2,), (3,))  # each its own
    storage = Storage(StorageLocation(root))
    exported = [float(sum(e.rewards)) for dataset in (walkers, guides) for e in dataset]
    assert sorted(exported) == pytest.approx(sorted(_episode_returns_in_shards(storage, run.run_id)))
    # a game's episode is one life of each agent (its seed): the guide leaves with the last walker, so only a game
    # still running when the run ended (one of the 2 workers x 4 games) holds a walker's life without the guide's
    walker_lives = Counter(_seeds(walkers))
    assert [walker_lives[seed] for seed in _seeds(guides)] == [2] * guides.total_episodes
    unfinished = set(walker_lives) - set(_seeds(guides))
    assert {walker_lives[seed] for seed in unfinished} <= {1} and len(unfinished) <= 2 * 4
    assert walkers.storage.metadata["gymflow_agents"] == ["walker_0", "walker_1"]
    _replay_walkers(walkers, kwargs)

    _retire(storage, run.run_id, ["v000000", "v000001"])  # as storage.keep_shards: needed does
    assert main([*export, "--group", "walker", "--id", "gymflow/retired-v0"]) == 0
    assert "exportable: worker 0 from v000002, worker 1 from v000002" in capsys.readouterr().out
    retired = minari.load_dataset("gymflow/retired-v0")
    assert 0 < retired.total_episodes < walkers.total_episodes
    _replay_walkers(retired, kwargs)


def _seeds(dataset) -> list[int]:
    return [m["seed"] for m in dataset.storage.get_episode_metadata(range(dataset.total_episodes))]


def _replay_walkers(dataset, kwargs: dict) -> None:
    """Each walker's episode, replayed in a new game from its seed (a walker observes its own
    corridor and the clock alone: the others may walk anywhere), observes what it holds."""
    from gymflow.testing.agents import Exits

    for episode, seed in zip(dataset, _seeds(dataset), strict=True):
        assert len(set(episode.infos["agent"])) == 1 and set(episode.infos["env"]) <= {0, 1, 2, 3}
        walker, game = f"walker_{episode.infos['agent'][0]}", Exits(**kwargs)
        observations, _ = game.reset(seed=seed)
        np.testing.assert_array_equal(observations[walker], episode.observations[0])
        for t, action in enumerate(episode.actions):
            observations, rewards, terminated, truncated, _ = game.step(
                {agent: int(action) if agent == walker else 1 for agent in game.agents})
            np.testing.assert_array_equal(observations[walker], episode.observations[t + 1])
            assert np.float32(rewards[walker]) == episode.rewards[t]
            assert (terminated[walker], truncated[walker]) == (episode.terminations[t], episode.truncations[t])
        assert walker not in game.agents  # its episode ended where it left the game


def _retire(storage: Storage, run_id: str, rounds: list[str]) -> None:
    storage.delete([key for key in storage.list(RunLayout(run_id).shards) if any(f"/{name}/" in key for name in rounds)])
