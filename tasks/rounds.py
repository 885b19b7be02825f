"""Planning a round: the typed specs each worker gets, with every seed derived from the run's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from envs.seeding import derive_seed
from presets.model import Preset
from tasks.jobs import EvaluationResult, EvaluationSpec, RolloutSpec
from tasks.shards import ShardRef
from tasks.storage import StorageLocation


def storage_location(preset: Preset) -> StorageLocation:
    return StorageLocation(preset.storage.root, dict(preset.storage.options))


def rollout_round(
    preset: Preset,
    run_id: str,
    version: int | None,
    exploration: float,
    resume_from: Sequence[str | None],
    steps_per_env: int | None = None,
) -> list[RolloutSpec]:
    """One spec per rollout worker; `version=None` plans heatup with a random policy."""
    return [
        RolloutSpec(
            storage=storage_location(preset),
            run_id=run_id,
            env_id=preset.env.id,
            env_kwargs=dict(preset.env.kwargs),
            agent=preset.agent,
            policy_version=version,
            worker=worker,
            num_envs=preset.distribution.envs_per_worker,
            steps_per_env=steps_per_env or preset.schedule.rollout_steps_per_env,
            env_seed=derive_seed(preset.seed, "envs", worker),
            policy_seed=derive_seed(preset.seed, "policy", "heatup" if version is None else version, worker),
            exploration=exploration,
            resume_from=resume_from[worker],
        )
        for worker in range(preset.distribution.rollout_workers)
    ]


def heatup_steps_per_env(preset: Preset) -> int:
    return math.ceil(preset.schedule.heatup_env_steps / preset.envs_in_total)


def evaluation_round(preset: Preset, run_id: str, version: int) -> list[EvaluationSpec]:
    """The evaluation episodes split across workers; the same seeds at every evaluation."""
    shares = np.array_split(np.arange(preset.schedule.evaluation_episodes), preset.distribution.rollout_workers)
    return [
        EvaluationSpec(
            storage=storage_location(preset),
            run_id=run_id,
            env_id=preset.env.id,
            env_kwargs=dict(preset.env.kwargs),
            agent=preset.agent,
            policy_version=version,
            episodes=len(share),
            seed=derive_seed(preset.seed, "evaluation", part),
        )
        for part, share in enumerate(shares)
        if len(share)
    ]


def round_metrics(
    shards: Sequence[ShardRef],
    learner_metrics: dict[str, float],
    learn_seconds: float,
    exploration: float,
    env_steps: int,
    version: int,
    round_seconds: float,
) -> dict[str, float]:
    """The namespaced metrics of one round, logged with env_steps as the step."""
    returns = [r for shard in shards for r in shard.episode_returns]
    lengths = [n for shard in shards for n in shard.episode_lengths]
    metrics = {"rollout/episodes": float(len(returns))}
    if returns:
        metrics["rollout/episode_return_mean"] = float(np.mean(returns))
        metrics["rollout/episode_length_mean"] = float(np.mean(lengths))
    if exploration:
        metrics["rollout/exploration"] = exploration
    metrics["rollout/shard_megabytes"] = sum(shard.size for shard in shards) / 1e6
    metrics |= {f"train/{key}": value for key, value in learner_metrics.items()}
    round_steps = sum(shard.env_steps for shard in shards)
    return metrics | {
        "time/env_steps": float(env_steps),
        "time/policy_version": float(version),
        "time/env_steps_per_second": round_steps / round_seconds,
        "time/round_seconds": round_seconds,
        "time/collect_seconds": max(shard.collect_seconds for shard in shards),
        "time/learn_seconds": learn_seconds,
    }


def stream_metrics(landed: Sequence[ShardRef], env_steps: int, version: int, seconds: float) -> dict[str, float]:
    """async: what the shards that landed during one commit period say, logged with env_steps."""
    returns = [r for shard in landed for r in shard.episode_returns]
    lengths = [n for shard in landed for n in shard.episode_lengths]
    metrics = {"rollout/episodes": float(len(returns)), "rollout/shards": float(len(landed))}
    if returns:
        metrics["rollout/episode_return_mean"] = float(np.mean(returns))
        metrics["rollout/episode_length_mean"] = float(np.mean(lengths))
    return metrics | {
        "time/env_steps": float(env_steps),
        "time/policy_version": float(version),
        "time/env_steps_per_second": sum(shard.env_steps for shard in landed) / seconds,
        "time/round_seconds": seconds,
    }


def evaluation_metrics(evaluation: EvaluationResult) -> dict[str, float]:
    returns = np.asarray(evaluation.returns)
    return {
        "eval/return_mean": float(returns.mean()),
        "eval/return_std": float(returns.std()),
        "eval/return_min": float(returns.min()),
        "eval/return_max": float(returns.max()),
        "eval/episode_length_mean": float(np.mean(evaluation.lengths)),
        "eval/policy_version": float(evaluation.version),
    }
