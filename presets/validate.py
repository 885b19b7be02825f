"""Everything checked before a run starts: the preset, its overrides, the env against the agent."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from gymnasium import spaces

from gymflow.agents.algorithms import ALGORITHMS, Algorithm, algorithm_of
from gymflow.envs.ale_backend import ale_game
from gymflow.envs.envpool_backend import envpool_installed, pool_task
from gymflow.envs.make import EnvSpecError, Preprocessing, check_env, is_image, is_multi_agent, reads_pixels
from gymflow.envs.parts import image_parts
from gymflow.errors import InvalidPreset
from gymflow.outage import store_call_bound_s
from gymflow.presets.load import load_preset
from gymflow.presets.model import DistributionConfig, Preset


def _check_rollout_timeout(config: Preset) -> None:
    """A job waiting on an S3 store that stopped answering must see the store lost (its outage budget
    and the try under way) before it is taken as wedged and its worker restarted."""
    if _is_local_folder(config.storage.root) or config.distribution.mode == "single":
        return
    least = config.storage.outage_budget_s + store_call_bound_s(config.storage.outage_budget_s)
    if config.distribution.rollout_timeout_s <= least:
        raise InvalidPreset("distribution.rollout_timeout_s", f"{config.distribution.rollout_timeout_s:g} s would "
                            f"restart a worker as wedged while it waits on a store that stopped answering, within "
                            f"storage.outage_budget_s ({config.storage.outage_budget_s:g} s) and the try under way; "
                            f"allowed: more than {least:g} s, or a shorter storage.outage_budget_s")


def _is_local_folder(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


@dataclass(frozen=True)
class Experiment:
    """A validated preset with what validating it found out."""

    preset: Preset
    algorithm: Algorithm
    observation_space: spaces.Box
    action_space: spaces.Space
    # the preset it was made from as the user named it (a built-in's name, a file's path); None where it was
    # rebuilt from what a run stored
    source: str | None = None


def _check_images(config: Preset, observation_space: spaces.Box) -> None:
    """What only image observations take, and what they don't."""
    env = config.env
    if env.frame_stack > 1 and not is_image(observation_space):
        raise InvalidPreset("env.frame_stack", f"stacks image frames; {env.id!r} observes vectors "
                                               f"{observation_space.shape}: allowed: 1")
    if is_image(observation_space) and getattr(config.agent, "normalize_observations", False):
        raise InvalidPreset("agent.normalize_observations", "images are scaled to [0, 1] in the CNN; allowed: false")
    if is_image(observation_space) and getattr(config.agent, "replay", "uniform") != "uniform":
        raise InvalidPreset("agent.replay", "image observations are replayed from a memory of frames, sampled "
                                            "uniformly (not yet prioritized); allowed: uniform")
    if reads_pixels(observation_space) and getattr(config.agent, "recurrent", None) is not None:
        shape = observation_space.shape
        seen = "images among its Dict's parts" if image_parts(observation_space) else f"images {shape}"
        raise InvalidPreset("agent.recurrent", f"reads vector observations (not yet images); {env.id!r} observes "
                                               f"{seen}: allowed: null")


def resolve_experiment(preset: str, overrides: Mapping[str, Any] | None = None) -> Experiment:
    """Load, override and validate; raises InvalidPreset (one line: field and what is allowed)."""
    return replace(experiment_from(load_preset(preset, overrides)), source=preset)


def experiment_from(config: Preset) -> Experiment:
    """Check a loaded preset's env against its agent and its parts against each other."""
    algorithm = algorithm_of(config.agent)
    if config.env.atari and not config.env.id.startswith("ALE/"):
        raise InvalidPreset("env.atari", f"is Atari's preprocessing, for ALE/... ids; {config.env.id!r} is not one")
    try:
        observation_space, action_space = check_env(
            config.env.id, config.env.kwargs, algorithm.action_spaces, algorithm.name,
            config.env.preprocessing(), images=algorithm.reads_images,
        )
    except EnvSpecError as error:
        raise InvalidPreset(error.field, error.problem) from None
    _check_images(config, observation_space)
    _check_agents(config, algorithm, observation_space)
    _check_backend(config)
    _check_env_threads(config)
    if config.remote_cluster and _is_local_folder(config.storage.root) and not config.storage.shared:
        raise InvalidPreset(
            "storage.root",
            f"the local folder {config.storage.root!r} is not reachable from a remote Dask cluster's "
            "workers; use an s3:// root, or set storage.shared=true if every worker mounts it at this path",
        )
    for path in config.distribution.ship_paths:
        if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".py"))):
            raise InvalidPreset("distribution.ship_paths", f"{path!r} is not a .py file or a folder here; "
                                "allowed: paths (relative to the working folder) of modules and packages")
    if config.distribution.mode == "single" and config.remote_cluster:
        raise InvalidPreset("distribution.mode", "single runs the jobs in the flow's process; a scheduler_address, "
                                                 "cluster_class or slurm asks for a cluster: use sync or async")
    if config.distribution.mode not in algorithm.modes:
        raise InvalidPreset("distribution.mode", _mode_refused(algorithm, config.distribution.mode))
    _check_vtrace(config)
    _check_rollout_timeout(config)
    _check_inference(config, algorithm)
    _check_adaptive(config.distribution)
    _check_slurm(config.distribution)
    tls, address = config.distribution.tls, config.distribution.scheduler_address
    if tls is not None and not (address or "").startswith("tls://"):
        raise InvalidPreset("distribution.tls", f"needs a tls:// distribution.scheduler_address, not {address!r}")
    _check_learner_devices(config, observation_space)
    _check_learners(config, algorithm)
    if algorithm.on_policy and config.schedule.heatup_env_steps:
        raise InvalidPreset("schedule.heatup_env_steps", f"must be 0 for the on-policy {algorithm.name}")
    _check_dataset(config, algorithm)
    _check_evaluation_on_decisions(config, action_space)
    return Experiment(config, algorithm, observation_space, action_space)


def _check_evaluation_on_decisions(config: Preset, action_space: Any) -> None:
    """schedule.evaluate_on decisions: an offline run on a decision log with decisions held out, of
    discrete actions (a greedy continuous action has no weight against logged densities)."""
    if config.schedule.evaluate_on != "decisions":
        return
    field = "schedule.evaluate_on"
    if config.dataset is None or config.dataset.decisions is None or not config.offline:
        raise InvalidPreset(field, "decisions scores an offline run on its decision log: needs dataset.decisions "
                                   "and schedule.total_env_steps 0; allowed: env")
    if config.dataset.holdout <= 0:
        raise InvalidPreset("dataset.holdout", "must be above 0 with schedule.evaluate_on decisions: the held-out "
                                               "decisions are what each version is scored on")
    if not hasattr(action_space, "n"):
        raise InvalidPreset(field, "decisions weighs discrete actions; this env's are continuous: allowed: env")


def rollout_backend(config: Preset) -> Literal["gymnasium", "envpool", "ale"]:
    """What steps the rollout workers' envs: env.backend, with `auto` resolved: for async runs, envpool
    where it has the task; for sync and single runs, the ALE's vector env for Atari games (its envs
    replay exactly, as a sync run's resume needs), unless the learner computes the workers' outputs;
    else gymnasium."""
    if config.env.backend != "auto":
        return config.env.backend
    if is_multi_agent(config.env.id):
        return "gymnasium"
    if config.distribution.mode == "async":
        return "envpool" if envpool_installed() and _fits(pool_task, config) else "gymnasium"
    return "ale" if config.distribution.inference != "learner" and _fits(ale_game, config) else "gymnasium"


def _fits(backend_task: Callable[[str, dict, Preprocessing], object], config: Preset) -> bool:
    try:
        backend_task(config.env.id, config.env.kwargs, config.env.preprocessing())
    except EnvSpecError:
        return False
    return True


def _check_backend(config: Preset) -> None:
    """env.backend envpool: a task EnvPool has, in a run whose resume does not replay its envs; ale: a
    game the ALE's vector env has, its workers acting on their CPU."""
    backend, mode = config.env.backend, config.distribution.mode
    if backend == "envpool" and mode != "async":
        raise InvalidPreset("env.backend", f"envpool cannot replay its envs from an env cursor, which a {mode} run's "
                                           "exact resume needs (docs/fault-tolerance.md); allowed with "
                                           f"distribution.mode {mode}: ale (Atari), gymnasium, auto")
    if backend == "ale" and config.distribution.inference == "learner":
        raise InvalidPreset("env.backend", "ale steps a worker's whole batch a call, and distribution.inference "
                                           "learner steps half of it at a time; allowed with it: envpool, gymnasium, "
                                           "auto")
    if backend not in ("envpool", "ale"):
        return
    try:
        (pool_task if backend == "envpool" else ale_game)(config.env.id, config.env.kwargs, config.env.preprocessing())
    except EnvSpecError as error:
        raise InvalidPreset(error.field, error.problem) from None


def _check_env_threads(config: Preset) -> None:
    threads = config.distribution.env_threads
    if threads > 1 and rollout_backend(config) == "gymnasium":
        raise InvalidPreset("distribution.env_threads", f"{threads} threads step a C++ backend's envs, and this run's "
                                                        "step on gymnasium; allowed: 1, or env.backend envpool or ale")
    if threads > config.distribution.envs_per_worker:
        raise InvalidPreset("distribution.env_threads", f"{threads} threads for {config.distribution.envs_per_worker} "
                                                        "envs a worker; allowed: 1 to distribution.envs_per_worker")


def _mode_refused(algorithm: Algorithm, mode: str) -> str:
    """Why `algorithm` cannot learn in distribution.mode `mode`, and what it can."""
    allowed = " or ".join(algorithm.modes)
    if mode == "async":
        return (f"async needs an agent that learns from its workers' lagging experience ({_asynchronous()}); "
                f"{algorithm.name} learns only from its current policy's rollouts: allowed: {allowed} (appo is "
                "PPO's asynchronous form)")
    return (f"{algorithm.name} learns from batches as the rollout workers' chunks land, under the lag bound "
            f"distribution.max_policy_lag: allowed: {allowed} (ppo is its synchronous form)")


def _check_vtrace(config: Preset) -> None:
    agent = config.agent
    if hasattr(agent, "vtrace_c_bar") and agent.vtrace_c_bar > agent.vtrace_rho_bar:
        raise InvalidPreset("agent.vtrace_c_bar", f"{agent.vtrace_c_bar} exceeds agent.vtrace_rho_bar "
                                                  f"{agent.vtrace_rho_bar}: allowed: <= vtrace_rho_bar")


def _check_opponent_pool(config: Preset, observation_space: spaces.Box) -> None:
    """A pool of past versions plays one side of two-player games whose sides share one policy."""
    if config.schedule.opponent_pool is None:
        return
    players = len(observation_space.groups)
    if players != 2:
        raise InvalidPreset("schedule.opponent_pool", f"is for two-player games; {config.env.id!r} has {players} "
                                                      "agents: allowed: null")
    if getattr(config.agent, "policies", {}):
        raise InvalidPreset("schedule.opponent_pool", "plays past versions of the one policy both sides share; "
                                                      "with agent.policies allowed: null")


def _check_agents(config: Preset, algorithm: Algorithm, observation_space: spaces.Box) -> None:
    """What a PettingZoo env's agents, as rows of the vector env (envs/agents.py), can learn with."""
    env, policies = config.env, getattr(config.agent, "policies", {})
    if not is_multi_agent(env.id):
        if env.global_state:
            raise InvalidPreset("env.global_state", f"is a PettingZoo env's state for a centralised critic; "
                                                    f"{env.id!r} is a Gymnasium env: allowed: false")
        if config.schedule.evaluation_opponent != "itself":
            raise InvalidPreset("schedule.evaluation_opponent", f"is for two-player PettingZoo games; {env.id!r} is "
                                                                "a Gymnasium env: allowed: itself")
        if policies:
            raise InvalidPreset("agent.policies", f"maps a PettingZoo env's agent groups to policies; {env.id!r} is "
                                                  "a Gymnasium env: allowed: {}")
        if config.schedule.opponent_pool is not None:
            raise InvalidPreset("schedule.opponent_pool", f"is for two-player PettingZoo games; {env.id!r} is a "
                                                          "Gymnasium env: allowed: null")
        return
    if config.schedule.evaluation_opponent == "random" and len(observation_space.groups) != 2:
        raise InvalidPreset("schedule.evaluation_opponent", f"random is for two-player games; {env.id!r} has "
                                                            f"{len(observation_space.groups)} agents: allowed: itself")
    _check_opponent_pool(config, observation_space)
    groups = dict.fromkeys(observation_space.groups)
    if unknown := [group for group in policies if group not in groups]:
        raise InvalidPreset("agent.policies", f"{env.id!r} has no agent group {unknown[0]!r}; its groups: "
                                              f"{', '.join(groups)}")
    if algorithm.name != "ppo" or getattr(config.agent, "recurrent", None) is not None:
        raise InvalidPreset("agent.algo", f"{config.env.id!r} is a PettingZoo env: its agents learn with ppo (IPPO, "
                                          "one policy they share), not yet recurrent; allowed: ppo")
    if config.dataset is not None:
        raise InvalidPreset("dataset", f"{config.env.id!r} is a PettingZoo env: datasets are of one agent's steps")


def _check_dataset(config: Preset, algorithm: Algorithm) -> None:
    """A run's schedule against where its experience comes from: collected, a dataset, or both
    (the dataset itself is checked when the run is prepared: tasks/lake/source.py)."""
    schedule = config.schedule
    if config.dataset is None and algorithm.offline_only:
        raise InvalidPreset("dataset.id", f"{algorithm.name} learns from a dataset alone: name one, with "
                                          "schedule.total_env_steps 0")
    if config.dataset is None and schedule.total_env_steps == 0:
        raise InvalidPreset("schedule.total_env_steps", "must be > 0, or 0 with a dataset (dataset.id, "
                                                        "dataset.runs or dataset.decisions) to learn from offline")
    if config.dataset is not None and algorithm.on_policy:
        raise InvalidPreset("dataset", f"{algorithm.name} learns only from its current policy's rollouts; a dataset "
                                       f"needs an off-policy agent ({_off_policy()})")
    if config.offline and config.distribution.mode == "async":
        raise InvalidPreset("distribution.mode", "an offline run collects nothing to stream: allowed: sync or single")
    if algorithm.offline_only and not config.offline:
        raise InvalidPreset("schedule.total_env_steps", f"{algorithm.name} learns from its dataset alone: allowed: 0")
    if config.offline:
        _check_offline_schedule(config)
        return
    if config.collect_only:
        _check_collect_only(config)
    for name in ("rollout_steps_per_env", "evaluate_every_env_steps"):
        if getattr(schedule, name) is None:
            raise InvalidPreset(f"schedule.{name}", "a run that collects needs it: allowed: an integer > 0")


def _check_offline_schedule(config: Preset) -> None:
    schedule = config.schedule
    for name in ("total_train_steps", "evaluate_every_train_steps"):
        if not getattr(schedule, name):
            raise InvalidPreset(f"schedule.{name}", "an offline run (total_env_steps 0) counts gradient steps: "
                                                    "allowed: an integer > 0")
    if schedule.heatup_env_steps:
        raise InvalidPreset("schedule.heatup_env_steps", "an offline run collects nothing: allowed: 0")
    if config.storage.checkpoint_every_env_steps is not None:
        raise InvalidPreset("storage.checkpoint_every_env_steps", "an offline run collects no env steps: use "
                            "checkpoint_every_seconds, or neither (a checkpoint at each evaluation)")


def _check_collect_only(config: Preset) -> None:
    if config.dataset is not None:
        raise InvalidPreset("dataset", "a collect-only run (schedule.total_train_steps 0) learns nothing from a "
                                       "dataset: allowed: none")
    if config.distribution.mode == "async":
        raise InvalidPreset("distribution.mode", "a collect-only run (schedule.total_train_steps 0) is sync or single")


def _check_learner_devices(config: Preset, observation_space: spaces.Space) -> None:
    """A CUDA device for the learner where one is asked for, and one for each rank: asked for, or
    chosen by auto because the networks read images."""
    wanted, learners = config.distribution.learner_device, config.distribution.learners
    if wanted.startswith("cuda"):
        _check_cuda(wanted, learners)
    elif learners > 1 and learner_device(config, observation_space).startswith("cuda"):
        _check_cuda("cuda", learners, or_else="; or learner_device: cpu for ranks on the CPU")


def _check_cuda(device: str, learners: int = 1, or_else: str = "") -> None:
    import torch

    if not torch.cuda.is_available():
        raise InvalidPreset("distribution.learner_device", f"{device} asked for, but torch {torch.__version__} sees "
                            "no CUDA device on this machine; use auto or cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise InvalidPreset("distribution.learner_device",
                            f"{device} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if index + learners > torch.cuda.device_count():
        raise InvalidPreset("distribution.learners", f"{learners} ranks from {device} need a GPU each; this machine "
                            f"has {torch.cuda.device_count()} CUDA device(s): allowed: up to "
                            f"{torch.cuda.device_count() - index}{or_else}")


# the algorithms whose learners share their minibatches out over ranks (agents/data_parallel.py)
SHARED_OUT = ("ppo", "appo", "impala", "dqn", "sac", "td3")


def _check_learners(config: Preset, algorithm: Algorithm) -> None:
    """What several learning ranks need: an algorithm that shares its batches out, and a row of
    each minibatch for every rank."""
    learners, agent = config.distribution.learners, config.agent
    if learners == 1:
        return
    if algorithm.name not in SHARED_OUT:
        raise InvalidPreset("distribution.learners", f"{algorithm.name} learns in one process for now; allowed: 1 "
                            f"(several ranks learn {', '.join(SHARED_OUT)})")
    if getattr(agent, "recurrent", None) is not None:
        raise InvalidPreset("distribution.learners", "a recurrent policy's sequences are not shared out over ranks "
                            "yet; allowed: 1 with agent.recurrent")
    rows = getattr(agent, "minibatch_size", None) or getattr(agent, "batch_size", None)
    if rows is not None and rows < learners:
        field = "minibatch_size" if hasattr(agent, "minibatch_size") else "batch_size"
        raise InvalidPreset("distribution.learners", f"each of {learners} ranks takes a share of agent.{field}'s "
                            f"{rows} rows; allowed: at most {rows}")


def learner_device(config: Preset, observation_space: spaces.Space) -> str:
    """The torch device the learner runs on. auto: cuda where torch sees a GPU and the networks read
    images (a CNN: an update measured 2-10x faster on an H100), else cpu (an MLP's update is bound by
    launching kernels: MuJoCo PPO's measured 2x slower there; docs/benchmarks.md)."""
    wanted = config.distribution.learner_device
    if wanted == "auto":
        import torch

        return "cuda" if reads_pixels(observation_space) and torch.cuda.is_available() else "cpu"
    return wanted


def rank_devices(config: Preset, observation_space: spaces.Space) -> list[str]:
    """The device of each learning rank (distribution.learners), the flow's first: on a GPU, rank r
    on the r-th after the learner's."""
    first, learners = learner_device(config, observation_space), config.distribution.learners
    if not first.startswith("cuda"):
        return [first] * learners
    index = int(first.partition(":")[2] or 0)
    return [f"cuda:{index + rank}" for rank in range(learners)] if learners > 1 else [first]


def inference_beside_learner(config: Preset, device: str) -> bool:
    """Whether the run's rollout workers get their network's outputs from a server beside the
    learner (distribution.inference; `device`: the learner's)."""
    wanted, mode = config.distribution.inference, config.distribution.mode
    if wanted == "worker" or mode == "single" or config.collect_only or config.offline:
        return False
    return wanted == "learner" or (mode == "async" and device.startswith("cuda") and _acts_from_outputs(config))


def _acts_from_outputs(config: Preset) -> bool:
    """A policy that acts on one network's outputs for single-agent envs: what a server can compute."""
    algorithm = algorithm_of(config.agent)
    return algorithm.acts_from_outputs and not getattr(config.agent, "recurrent", None) \
        and not is_multi_agent(config.env.id)


def _check_inference(config: Preset, algorithm: Algorithm) -> None:
    if config.distribution.inference != "learner":
        return
    if config.distribution.mode == "single":
        raise InvalidPreset("distribution.inference", "learner serves Dask rollout workers; single mode has none: "
                                                      "allowed: auto or worker (or distribution.mode sync or async)")
    if not _acts_from_outputs(config):
        raise InvalidPreset("distribution.inference", f"learner computes the outputs of ppo, appo, impala and dqn "
                            f"policies for single-agent envs, not recurrent ones; {algorithm.name} on "
                            f"{config.env.id!r} acts on its workers: allowed: auto or worker")


def _off_policy() -> str:
    return ", ".join(name for name, algorithm in ALGORITHMS.items() if not algorithm.on_policy)


def _asynchronous() -> str:
    return ", ".join(name for name, algorithm in ALGORITHMS.items()
                     if "async" in algorithm.modes and not algorithm.offline_only)


def _check_adaptive(distribution: DistributionConfig) -> None:
    adaptive = distribution.adaptive
    if adaptive is None:
        return
    if not (distribution.cluster_class or distribution.slurm):
        raise InvalidPreset("distribution.adaptive", "adapts a cluster the run starts: needs a "
                                                     "distribution.cluster_class or distribution.slurm")
    if adaptive.maximum < adaptive.minimum:
        raise InvalidPreset("distribution.adaptive.maximum",
                            f"{adaptive.maximum} is below minimum {adaptive.minimum}; allowed: >= {adaptive.minimum}")


# the shortest walltime a SLURM job may have beyond the margins its workers leave before it
SHORTEST_WORK_S = 30


def _check_slurm(distribution: DistributionConfig) -> None:
    slurm = distribution.slurm
    if slurm is None:
        return
    if distribution.scheduler_address or distribution.cluster_class:
        raise InvalidPreset("distribution.slurm", "starts a cluster of its own: leave distribution.scheduler_address "
                                                  "and distribution.cluster_class unset")
    if importlib.util.find_spec("dask_jobqueue") is None:
        raise InvalidPreset("distribution.slurm", "needs dask-jobqueue, which is not installed: pip install "
                                                  "'gymflow[slurm]'")
    if slurm.processes > slurm.cores:
        raise InvalidPreset("distribution.slurm.processes", f"{slurm.processes} workers on {slurm.cores} cores; "
                                                            f"allowed: at most cores ({slurm.cores})")
    walltime = slurm.walltime_s
    if walltime < 2 * slurm.lifetime_margin_s + SHORTEST_WORK_S:
        raise InvalidPreset("distribution.slurm.lifetime_margin_s",
                            f"{slurm.lifetime_margin_s:g} s leaves a {slurm.walltime} job too little time (its "
                            f"workers leave between 2 and 1 margins before the walltime); allowed: at most "
                            f"{(walltime - SHORTEST_WORK_S) / 2:g} s, or a longer walltime")
