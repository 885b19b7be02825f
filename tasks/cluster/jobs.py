"""The jobs that run on Dask workers: check the worker, collect a rollout, evaluate a policy.

They are plain functions (no Prefect: a worker process never imports it). Each gets a small
typed spec, reaches the policy and the env cursor through storage, and hands back a small typed
result.

Each worker keeps its live envs between rounds (keyed by run and worker); when a round lands on
a worker that does not hold them — a retry, a replaced worker — the envs are rebuilt from the
cursor in the previous shard, so the trajectory is the same either way.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gymflow.agents.algorithms import ALGORITHMS, algorithm_of
from gymflow.agents.core import Policy
from gymflow.agents.match import Sides, first_rows, game_scores, play_games
from gymflow.agents.rollout import (
    RandomPolicy,
    acts_from_outputs,
    collect,
    collect_in_halves,
    collect_together,
    evaluate,
)
from gymflow.envs.ale_backend import ale_game
from gymflow.envs.envpool_backend import pool_task
from gymflow.envs.make import EnvSpecError, check_env, is_multi_agent
from gymflow.envs.seeding import derive_seed
from gymflow.envs.steps import Backend, observations_outside
from gymflow.envs.vector import AnyVectorEnv, make_vector_env
from gymflow.envs.video import CannotFilm, film_episode, film_game
from gymflow.errors import GymflowError
from gymflow.tasks.cluster.host_figures import sample_to_send
from gymflow.tasks.cluster.inference_client import RemoteOutputs, connect
from gymflow.tasks.cluster.messages import (
    EvaluationResult,
    EvaluationSpec,
    Film,
    RolloutSpec,
    WorkerCheck,
    WorkerCheckSpec,
)
from gymflow.tasks.storage.blob_cache import BlobCache
from gymflow.tasks.storage.checkpoints import POLICY_BLOB, CheckpointError, latest_policy_version, read_policy
from gymflow.tasks.storage.codec import decode_tensors
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, check_shared_root, open_storage
from gymflow.tasks.storage.shards import Collected, ShardRef, read_cursor, write_shard

if TYPE_CHECKING:
    from torch import nn

_LIVE_ENVS: OrderedDict[tuple[str, str, int], tuple[str, AnyVectorEnv]] = OrderedDict()
_NETWORKS: OrderedDict[tuple[str, str, int], nn.Module] = OrderedDict()
_CACHE_SIZE = 32
_NODE_BLOBS = BlobCache.for_this_machine()  # a policy blob is read from storage once a machine, not once a process
_RETIRED_ATTEMPTS = 5
BACKEND_TASKS = {"envpool": pool_task, "ale": ale_game}  # a C++ backend's check that it has the env


def import_job_machinery() -> None:
    """Import what jobs use (torch, every algorithm's networks and policy) now, as a host starts,
    rather than in its first job."""
    for algorithm in ALGORITHMS.values():
        algorithm.parts()


def _one_thread() -> None:
    """A job steps envs and small networks: one torch thread (the learner keeps its own)."""
    import torch  # here: the flow imports this module for its job functions without torch

    torch.set_num_threads(1)


def check_worker(spec: WorkerCheckSpec) -> WorkerCheck:
    """Make the env once, as rollouts will, and compare its spaces with the flow's; reach the
    storage root (a bucket with the worker's credentials, a shared folder at the flow's path).
    Runs on a Dask worker."""
    from distributed import get_worker  # here only: single mode's helper process runs jobs without Dask

    address = get_worker().address
    try:
        observation_space, action_space = check_env(spec.env_id, spec.env_kwargs, spec.action_spaces, spec.algo,
                                                    spec.preprocessing, spec.images)
        if spec.backend in BACKEND_TASKS:  # installed there, with the task
            BACKEND_TASKS[spec.backend](spec.env_id, spec.env_kwargs, spec.preprocessing)
    except EnvSpecError as error:
        return WorkerCheck(address, error.field, error.problem)
    if (observation_space, action_space) != (spec.observation_space, spec.action_space):
        return WorkerCheck(address, "env.id", f"{spec.env_id!r} observes {observation_space} and acts in "
                                              f"{action_space} there; the flow's process found "
                                              f"{spec.observation_space} and {spec.action_space}")
    try:
        check_shared_root(spec.storage)
    except GymflowError as error:
        return WorkerCheck(address, error.field, error.problem)
    return WorkerCheck(address)


def run_rollout(spec: RolloutSpec) -> ShardRef:
    """Collect one worker's share of a round and write its shard. Runs on a Dask worker."""
    _one_thread()
    storage, env, version, policy, learning = _ready_to_collect(spec)
    started = time.perf_counter()
    source = _remote_outputs(spec, version, policy, env, learning)
    if source is None:
        rollout, episodes = collect(policy, env, spec.steps_per_env, learning=learning)
    else:  # the envs step here, the network runs beside the learner
        with source:  # a rollout that raises mid-way leaves no reply owed on the thread's connection
            rollout, episodes = collect_in_halves(policy, env, spec.steps_per_env, source)
    seconds = time.perf_counter() - started
    return _land(spec, storage, version, env, Collected(rollout, episodes, env.cursor(), seconds))


def _remote_outputs(spec: RolloutSpec, version: int | None, policy: Policy, env: AnyVectorEnv,
                    learning: np.ndarray | None) -> RemoteOutputs | None:
    """The run's inference server as this rollout's source of network outputs, where there is one
    this worker reaches and the policy acts from one network's outputs (not a recurrent one, not
    facing an opponent, not random)."""
    if spec.inference is None or version is None or learning is not None or not acts_from_outputs(policy) \
            or not hasattr(env, "step_rows"):
        return None
    connection = connect(spec.inference)
    return None if connection is None else RemoteOutputs(connection, version, policy)


def run_rollouts(specs: Sequence[RolloutSpec]) -> list[ShardRef]:
    """Every worker's share of a round, collected in this process (single mode) with every
    worker's envs stepped together (`collect_together`: the policy's network run once a step for
    all of them); the shards are those `run_rollout` of each would write."""
    _one_thread()
    ready = [_ready_to_collect(spec) for spec in specs]
    if any(learning is not None for *_, learning in ready):  # self-play: each its own opponent
        return [run_rollout(spec) for spec in specs]
    started = time.perf_counter()
    collected = collect_together([policy for _, _, _, policy, _ in ready], [env for _, env, *_ in ready],
                                 specs[0].steps_per_env)
    seconds = (time.perf_counter() - started) / len(specs)  # each worker's share of the stepping
    return [_land(spec, storage, version, env, Collected(rollout, episodes, env.cursor(), seconds))
            for spec, (storage, env, version, _, _), (rollout, episodes) in zip(specs, ready, collected, strict=True)]


def _ready_to_collect(spec: RolloutSpec) -> tuple[Storage, AnyVectorEnv, int | None, Policy, np.ndarray | None]:
    """A rollout's storage, its live envs, the version it acts with, its policy (facing its
    opponent, in self-play), and the rows that learn (None: all)."""
    storage = open_storage(spec.storage)
    env = _take_live_envs(spec)
    version, policy = _acting_policy(spec, env)
    policy, learning = _facing_opponent(spec, env, policy)
    return storage, env, version, policy, learning


def _land(spec: RolloutSpec, storage: Storage, version: int | None, env: AnyVectorEnv, collected: Collected
          ) -> ShardRef:
    """Write a rollout's shard, and keep its envs live for the worker's next round."""
    ref = write_shard(storage, spec.shard_key, version, spec.worker, collected, spec.chunk)
    _keep(_LIVE_ENVS, (spec.storage.root, spec.run_id, spec.worker), (spec.shard_key, env))
    sample = sample_to_send()
    return replace(ref, host=() if sample is None else tuple(sample.metrics().items()),
                   observations_outside=observations_outside(env.observation_space, collected.rollout.obs))


def run_evaluation(spec: EvaluationSpec) -> EvaluationResult:
    """Run `episodes` greedy episodes of one policy version, one per env. Runs on a Dask worker."""
    _one_thread()
    if spec.held_out is not None:
        from gymflow.tasks.cluster.held_out import evaluate_on_decisions

        return evaluate_on_decisions(spec, lambda made: _policy(spec, spec.policy_version, made, 0.0, spec.seed))
    if spec.opponent == "random":
        return _evaluate_against_random(spec)
    started = time.perf_counter()
    env = make_vector_env(spec.env_id, spec.env_kwargs, spec.episodes, spec.seed, spec.preprocessing)
    env.reset()
    policy = _policy(spec, spec.policy_version, env, 0.0, spec.seed)
    episodes = evaluate(policy, env)
    env.close()
    film, no_film = _film(spec, policy, env) if spec.film else (None, "")
    return EvaluationResult(
        version=spec.policy_version,
        returns=tuple(float(x) for x in episodes.returns),
        lengths=tuple(int(x) for x in episodes.lengths),
        seconds=time.perf_counter() - started,
        film=film,
        no_film=no_film,
        groups=_row_groups(env),
    )


def _evaluate_against_random(spec: EvaluationSpec) -> EvaluationResult:
    """A two-player game's evaluation: the policy against a uniformly random player, `episodes`
    games with sides swapped; each game's return is the policy's score (1, 0.5 or 0)."""
    started = time.perf_counter()
    env = make_vector_env(spec.env_id, spec.env_kwargs, spec.episodes, spec.seed, spec.preprocessing)
    policy = _policy(spec, spec.policy_version, env, 0.0, spec.seed)
    opponent = RandomPolicy(env.action_space, derive_seed(spec.seed, "opponent"))
    margins, lengths = play_games(policy, opponent, env)
    env.close()
    film, no_film = _film(spec, policy, env) if spec.film else (None, "")
    return EvaluationResult(spec.policy_version, tuple(float(x) for x in game_scores(margins)),
                            tuple(int(x) for x in lengths), time.perf_counter() - started, film, no_film)


def _row_groups(env: AnyVectorEnv) -> tuple[str, ...]:
    """The agent group of each env's row: a PettingZoo env's games give one row to each agent."""
    if env.agents is None:
        return ()
    return tuple(env.table.groups[agent] for agent in env.agents)


def _film(spec: EvaluationSpec, policy: Policy, env: AnyVectorEnv) -> tuple[Film | None, str]:
    """The first evaluation episode played again, greedily, by a renderable env, as MP4 in storage."""
    def act_rows(obs: np.ndarray) -> np.ndarray:
        actions = policy.act(np.asarray(obs, dtype=env.obs.dtype), explore=False)[0]
        return actions if not env.action_space.shape else np.clip(actions, env.action_space.low, env.action_space.high)

    try:
        if is_multi_agent(spec.env_id):  # its game 0, every agent acting
            filmed = film_game(act_rows, spec.env_id, spec.env_kwargs, spec.seed, spec.preprocessing)
        else:
            filmed = film_episode(lambda obs: act_rows(obs[None])[0], spec.env_id, spec.env_kwargs,
                                  derive_seed(spec.seed, 0, 0), spec.preprocessing)
    except CannotFilm as reason:
        return None, str(reason)
    key = RunLayout(spec.run_id).video(spec.policy_version)
    open_storage(spec.storage).write(key, filmed.mp4)
    return Film(key, filmed.frames, filmed.episode_return), ""


def _acting_policy(spec: RolloutSpec, env: AnyVectorEnv) -> tuple[int | None, Policy]:
    """The spec's policy version and its policy. "newest" is the newest published when the job
    starts; a version retired between reading the pointer and loading it (the learner moved
    more than the lag bound ahead meanwhile) is passed over for the new newest."""
    if spec.policy_version != "newest":
        return spec.policy_version, _policy(spec, spec.policy_version, env, spec.exploration, spec.policy_seed)
    storage, layout = open_storage(spec.storage), RunLayout(spec.run_id)
    version = latest_policy_version(storage, layout)
    for _ in range(_RETIRED_ATTEMPTS - 1):
        try:
            return version, _policy(spec, version, env, spec.exploration, spec.policy_seed)
        except CheckpointError:
            newest = latest_policy_version(storage, layout)
            if newest == version:  # not retired: broken
                raise
            version = newest
    return version, _policy(spec, version, env, spec.exploration, spec.policy_seed)


def _facing_opponent(spec: RolloutSpec, env: AnyVectorEnv, policy: Policy) -> tuple[Policy, np.ndarray | None]:
    """Self-play against a past version (schedule.opponent_pool): the acting policy plays one side
    of each game, the spec's opponent version the other; returns what acts and the rows that learn
    (None: every row, the policy playing itself)."""
    if spec.opponent_version is None:
        return policy, None
    seed = derive_seed(spec.policy_seed, "opponent")
    opponent = _policy(spec, spec.opponent_version, env, spec.exploration, seed)
    firsts = first_rows(env.num_envs)
    learning = np.zeros(env.num_envs, dtype=bool)
    learning[firsts] = True
    return Sides(policy, opponent, firsts), learning


def _take_live_envs(spec: RolloutSpec) -> AnyVectorEnv:
    """The envs as the previous round of this worker left them: live if this process ran that
    round, else rebuilt from the cursor in its shard."""
    cached = _LIVE_ENVS.pop((spec.storage.root, spec.run_id, spec.worker), None)
    if cached is not None and cached[0] == spec.resume_from:
        return cached[1]
    if cached is not None:
        cached[1].close()
    env = make_vector_env(spec.env_id, spec.env_kwargs, spec.num_envs, spec.env_seed, spec.preprocessing,
                          Backend(spec.backend, spec.env_threads))
    cursor = read_cursor(open_storage(spec.storage), spec.resume_from) if spec.resume_from else None
    env.reset(cursor)
    return env


def _policy(
    spec: RolloutSpec | EvaluationSpec, version: int | None, env: AnyVectorEnv, exploration: float, seed: int
) -> Policy:
    """The policy of `version` of the spec's run (uniform random for None), its network cached."""
    if version is None:
        return RandomPolicy(env.action_space, seed)
    from gymflow.agents.networks import network_of_version  # torch: a flow's imports load none

    algorithm = algorithm_of(spec.agent)
    key = (spec.storage.root, spec.run_id, version)
    network = _NETWORKS.get(key)
    if network is None:
        blobs = read_policy(open_storage(spec.storage), RunLayout(spec.run_id), version, [POLICY_BLOB], _NODE_BLOBS)
        network = network_of_version(decode_tensors(blobs[POLICY_BLOB]), _cached_network_of(spec),
                                     lambda: algorithm.network(spec.agent, env.observation_space, env.action_space))
    _keep(_NETWORKS, key, network)
    return algorithm.policy(network, spec.agent, exploration, seed)


def _cached_network_of(spec: RolloutSpec | EvaluationSpec) -> nn.Module | None:
    """The newest cached network of the spec's run: a new version's is a copy of it."""
    for (root, run_id, _), network in reversed(_NETWORKS.items()):
        if (root, run_id) == (spec.storage.root, spec.run_id):
            return network
    return None


def _keep(cache: OrderedDict, key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _CACHE_SIZE:
        evicted = cache.popitem(last=False)[1]
        if isinstance(evicted, tuple):  # (shard key, live envs)
            evicted[1].close()
