"""Algorithms alone: no Prefect, no Dask, no storage."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gymnasium import spaces

from gymflow.agents.algorithms import ALGORITHMS, algorithm_of
from gymflow.agents.batches import Rollout
from gymflow.agents.bc import BCLearner
from gymflow.agents.configs import BCConfig, DQNConfig, IQLConfig, PPOConfig, SACConfig, TD3Config, epsilon_at
from gymflow.agents.dqn import DQNLearner
from gymflow.agents.iql import IQLLearner
from gymflow.agents.ppo import PPOLearner
from gymflow.agents.recurrent import RecurrentPPOLearner
from gymflow.agents.replay import MemorySpec, ReplayMemory
from gymflow.agents.rollout import collect, evaluate
from gymflow.agents.sac import SACLearner
from gymflow.agents.td3 import TD3Learner
from gymflow.envs.vector import SeededVectorEnv
from gymflow.tasks.storage.codec import decode_state, encode_state

OBS = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
ACTIONS = spaces.Discrete(2)
BOX_ACTIONS = spaces.Box(-2.0, 2.0, shape=(1,), dtype=np.float32)


def _rollout(rewards, terminated, truncated, obs=None, done_obs=None) -> Rollout:
    steps = len(rewards)
    obs = np.zeros((steps, 1, 2), np.float32) if obs is None else obs
    done = np.flatnonzero(np.asarray(terminated) | np.asarray(truncated))
    return Rollout(
        obs=obs,
        actions=np.zeros((steps, 1), np.int64),
        rewards=np.asarray(rewards, np.float32).reshape(steps, 1),
        terminated=np.asarray(terminated).reshape(steps, 1),
        truncated=np.asarray(truncated).reshape(steps, 1),
        done_index=done.astype(np.int64),
        done_obs=np.zeros((len(done), 2), np.float32) if done_obs is None else done_obs,
        last_obs=np.zeros((1, 2), np.float32),
        log_probs=np.zeros((steps, 1), np.float32),
    )


def _constant_critic(learner: PPOLearner, value: float) -> None:
    with torch.no_grad():
        for parameter in learner.network.critic.parameters():
            parameter.zero_()
        learner.network.critic[-1].bias.fill_(value)


def test_gae_bootstraps_from_the_value_on_truncation_and_from_zero_on_termination():
    learner = PPOLearner(PPOConfig(gamma=0.5, gae_lambda=1.0), OBS, ACTIONS, seed=0)
    _constant_critic(learner, 2.0)
    # Episode ends at step 1 by truncation; a new one runs steps 2-3 and terminates at step 3.
    rollout = _rollout([1, 1, 1, 1], [False, False, False, True], [False, True, False, False])
    returns = learner._flatten([rollout])["returns"].tolist()
    # truncated: G1 = 1 + 0.5 * V(final) = 2; G0 = 1 + 0.5 * G1 = 2
    # terminated: G3 = 1; G2 = 1 + 0.5 * 1 = 1.5
    assert returns == pytest.approx([2.0, 2.0, 1.5, 1.0])


def test_gae_bootstraps_the_unfinished_tail_from_the_last_observation():
    learner = PPOLearner(PPOConfig(gamma=0.5, gae_lambda=1.0), OBS, ACTIONS, seed=0)
    _constant_critic(learner, 4.0)
    returns = learner._flatten([_rollout([0, 0], [False, False], [False, False])])["returns"]
    assert returns.tolist() == pytest.approx([1.0, 2.0])


def test_ppo_learns_the_corridor_in_a_few_iterations():
    torch.set_num_threads(1)
    config = PPOConfig(lr=3e-3, epochs=4, minibatch_size=64, anneal_lr=False, hidden_sizes=[32])
    algorithm = algorithm_of(config)
    env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 8, "max_steps": 40}, 8, seed=0)
    env.reset()
    learner = algorithm.learner(config, env.observation_space, env.action_space, 0)
    for iteration in range(15):
        policy = algorithm.policy(learner.network, config, 0.0, iteration)
        rollout, _ = collect(policy, env, 32)
        learner.learn([rollout], progress=iteration / 15)
    evaluation_env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 8, "max_steps": 40}, 8, seed=99)
    evaluation_env.reset()
    returns = evaluate(algorithm.policy(learner.network, config, 0.0, 0), evaluation_env).returns
    assert returns.min() > 0.9  # reaches the end within a few steps every time


def test_dqn_learns_the_corridor():
    torch.set_num_threads(1)
    config = DQNConfig(lr=1e-3, hidden_sizes=[64], train_steps_per_iteration=32, target_update_every_train_steps=32,
                       epsilon_decay_env_steps=2000, batch_size=32)
    algorithm = algorithm_of(config)
    env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 6, "max_steps": 30}, 4, seed=0)
    env.reset()
    learner = algorithm.learner(config, env.observation_space, env.action_space, 0)
    steps = 0
    for _ in range(40):
        policy = algorithm.policy(learner.q_network, config, epsilon_at(config, steps), steps)
        rollout, _ = collect(policy, env, 16)
        steps += rollout.env_steps
        metrics = learner.learn([rollout], progress=0)
    assert metrics["replay_size"] == steps
    evaluation_env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 6, "max_steps": 30}, 6, seed=5)
    evaluation_env.reset()
    returns = evaluate(algorithm.policy(learner.q_network, config, 0.0, 0), evaluation_env).returns
    assert returns.min() > 0.9


@pytest.mark.parametrize("options", [
    {"double_q": True, "dueling": True, "n_step": 3},
    {"replay": "prioritized", "double_q": True},
])
def test_dqn_variants_learn_the_corridor(options):
    torch.set_num_threads(1)
    config = DQNConfig(lr=1e-3, hidden_sizes=[64, 64], train_steps_per_iteration=32, target_update_every_train_steps=32,
                       epsilon_decay_env_steps=2000, batch_size=32, **options)
    algorithm = algorithm_of(config)
    env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 6, "max_steps": 30}, 4, seed=0)
    env.reset()
    learner = algorithm.learner(config, env.observation_space, env.action_space, 0)
    steps = 0
    for _ in range(40):
        policy = algorithm.policy(learner.q_network, config, epsilon_at(config, steps), steps)
        rollout, _ = collect(policy, env, 16)
        steps += rollout.env_steps
        learner.learn([rollout], progress=steps / 2560)
    evaluation_env = SeededVectorEnv("gymflow.testing.envs:Corridor", {"length": 6, "max_steps": 30}, 6, seed=5)
    evaluation_env.reset()
    returns = evaluate(algorithm.policy(learner.q_network, config, 0.0, 0), evaluation_env).returns
    assert returns.min() > 0.9


def test_sac_learns_the_continuous_corridor():
    torch.set_num_threads(1)
    config = SACConfig(lr=3e-3, hidden_sizes=[32, 32], batch_size=64, train_steps_per_iteration=16)
    algorithm = algorithm_of(config)
    env = SeededVectorEnv("gymflow.testing.envs:ContinuousCorridor", {"length": 6, "max_steps": 30}, 2, seed=0)
    env.reset()
    learner = algorithm.learner(config, env.observation_space, env.action_space, 0)
    for iteration in range(60):
        rollout, _ = collect(algorithm.policy(learner.actor, config, 0.0, iteration), env, 16)
        learner.learn([rollout], progress=iteration / 60)
    evaluation_env = SeededVectorEnv("gymflow.testing.envs:ContinuousCorridor", {"length": 6, "max_steps": 30}, 6, seed=5)
    evaluation_env.reset()
    returns = evaluate(algorithm.policy(learner.actor, config, 0.0, 0), evaluation_env).returns
    assert returns.min() > 0.9


def test_epsilon_decays_linearly_then_holds():
    config = DQNConfig(epsilon_start=1.0, epsilon_end=0.1, epsilon_decay_env_steps=100)
    assert [epsilon_at(config, s) for s in (0, 50, 100, 1000)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_replay_memory_wraps_around_and_round_trips():
    memory = ReplayMemory(MemorySpec(5, (1,), np.float32, (), np.int64, gamma=0.9))
    for start in (0, 3, 6):
        values = np.arange(start, start + 3, dtype=np.float32)
        memory.add(Rollout(values[:, None, None], np.zeros((3, 1), np.int64), values[:, None], np.zeros((3, 1), bool),
                           np.zeros((3, 1), bool), np.zeros(0, np.int64), np.zeros((0, 1), np.float32),
                           values[-1:, None] + 1, np.zeros((3, 1), np.float32)))
    assert len(memory) == 5 and memory.inserted == 9
    assert sorted(memory.arrays["rewards"].tolist()) == [4, 5, 6, 7, 8]
    copy = ReplayMemory(memory.spec)
    copy.load_state_dict(memory.state_dict())
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(0)
    np.testing.assert_array_equal(memory.sample(10, rng_a).transitions.rewards, copy.sample(10, rng_b).transitions.rewards)


@pytest.mark.parametrize("make", [
    lambda: PPOLearner(PPOConfig(), OBS, ACTIONS, 1),
    lambda: PPOLearner(PPOConfig(normalize_observations=True, normalize_rewards=True), OBS, BOX_ACTIONS, 1),
    lambda: DQNLearner(DQNConfig(hidden_sizes=[8], normalize_observations=True), OBS, ACTIONS, 1),
    lambda: SACLearner(SACConfig(hidden_sizes=[8], batch_size=4, normalize_observations=True), OBS, BOX_ACTIONS, 1),
    lambda: DQNLearner(DQNConfig(hidden_sizes=[8]), OBS, ACTIONS, 1),
    lambda: DQNLearner(DQNConfig(hidden_sizes=[8, 8], replay="prioritized", double_q=True, dueling=True, n_step=3,
                                 batch_size=4), OBS, ACTIONS, 1),
    lambda: SACLearner(SACConfig(hidden_sizes=[8], replay="prioritized", batch_size=4), OBS, BOX_ACTIONS, 1),
    lambda: TD3Learner(TD3Config(hidden_sizes=[8], batch_size=4, train_steps_per_iteration=5,
                                 normalize_observations=True), OBS, BOX_ACTIONS, 1),
])
def test_learner_state_round_trips_through_a_checkpoint_into_a_fresh_learner(make):
    learner = make()
    rollout = _rollout(np.ones(8), [False] * 7 + [True], [False] * 8, obs=np.random.rand(8, 1, 2).astype(np.float32))
    if isinstance(learner, SACLearner | TD3Learner):
        rollout = rollout._replace(actions=np.random.uniform(-1, 1, (8, 1, 1)).astype(np.float32))
    learner.learn([rollout], 0.1)
    restored = make()
    restored.load_state_dict(decode_state(*encode_state(learner.state_dict())))
    if hasattr(learner, "replay"):  # the replay memory travels in its own checkpoint blob
        restored.replay.load_state_dict(learner.replay.state_dict())
    a, b = learner.learn([rollout], 0.2), restored.learn([rollout], 0.2)
    assert a == pytest.approx(b, nan_ok=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("make", [
    lambda device: PPOLearner(PPOConfig(normalize_observations=True, normalize_rewards=True), OBS, BOX_ACTIONS, 1,
                              device),
    lambda device: DQNLearner(DQNConfig(hidden_sizes=[8], replay="prioritized", batch_size=4,
                                        normalize_observations=True), OBS, ACTIONS, 1, device),
    lambda device: SACLearner(SACConfig(hidden_sizes=[8], batch_size=4, normalize_observations=True), OBS,
                              BOX_ACTIONS, 1, device),
    lambda device: TD3Learner(TD3Config(hidden_sizes=[8], batch_size=4, normalize_observations=True), OBS,
                              BOX_ACTIONS, 1, device),
    lambda device: RecurrentPPOLearner(PPOConfig(recurrent=4, minibatch_size=8, normalize_observations=True), OBS,
                                       BOX_ACTIONS, 1, device),
    lambda device: BCLearner(BCConfig(hidden_sizes=[8], batch_size=4, normalize_observations=True), OBS, ACTIONS, 1,
                             device),
    lambda device: IQLLearner(IQLConfig(hidden_sizes=[8], batch_size=4, normalize_observations=True), OBS,
                              BOX_ACTIONS, 1, device),
], ids=["ppo", "dqn", "sac", "td3", "recurrent-ppo", "bc", "iql"])
def test_a_gpu_learner_hands_out_cpu_weights_and_its_checkpoint_resumes_on_a_cpu(make):
    learner = make("cuda")
    rollout = _rollout(np.ones(8), [False] * 7 + [True], [False] * 8, obs=np.random.rand(8, 1, 2).astype(np.float32))
    if not isinstance(learner, DQNLearner | BCLearner):
        rollout = rollout._replace(actions=np.random.uniform(-1, 1, (8, 1, 1)).astype(np.float32))
    if isinstance(learner, RecurrentPPOLearner):  # the memory its policy began the rollout with
        rollout = rollout._replace(memory=np.random.rand(2, 1, 4).astype(np.float32))
    learner.learn([rollout], 0.1)
    assert all(tensor.device.type == "cpu" for tensor in learner.policy_weights().values())
    on_cpu = make("cpu")
    on_cpu.load_state_dict(decode_state(*encode_state(learner.state_dict())))  # what a CPU-only resume does
    if hasattr(learner, "replay"):
        on_cpu.replay.load_state_dict(learner.replay.state_dict())
    metrics = on_cpu.learn([rollout], 0.2)
    assert all(np.isfinite(value) for value in metrics.values())


# --- initial weights under threads: a sweep's trials build learners at once in one process --------

def _initial_weights(algo: str, seed: int) -> dict[str, torch.Tensor]:
    algorithm = ALGORITHMS[algo]
    config = algorithm.config()
    actions = BOX_ACTIONS if algo in ("sac", "td3") else ACTIONS
    learner = algorithm.learner(config, OBS, actions, seed)
    return {name: tensor.clone() for name, tensor in learner.policy_weights().items()}


def test_a_network_drawn_in_another_thread_waits_for_a_seeded_build_and_never_shifts_it():
    from torch import nn

    from gymflow.agents.networks import seeded_init

    with seeded_init(7):
        expected = [nn.Linear(16, 16).weight.clone() for _ in range(2)]
    with seeded_init(7):
        first = nn.Linear(16, 16).weight.clone()
        worker_network = threading.Thread(target=ALGORITHMS["ppo"].network, args=(PPOConfig(), OBS, ACTIONS))
        worker_network.start()
        worker_network.join(timeout=1.0)  # unlocked, it draws its weights from this seeded stream now
        assert worker_network.is_alive(), "a network was drawn inside another thread's seeded build"
        second = nn.Linear(16, 16).weight.clone()
    worker_network.join()
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])


def _build_at_once(algo: str, seed: int, start: threading.Barrier, built: dict) -> None:
    start.wait()
    built[seed] = _initial_weights(algo, seed)


@pytest.mark.parametrize("algo", ["ppo", "sac", "dqn"])
def test_learners_built_at_once_in_two_threads_start_from_their_own_seeds(algo):
    alone = {seed: _initial_weights(algo, seed) for seed in (1, 2)}
    for _ in range(5):
        built: dict[int, dict[str, torch.Tensor]] = {}
        start = threading.Barrier(2)

        threads = [threading.Thread(target=_build_at_once, args=(algo, seed, start, built)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for seed in (1, 2):
            assert all(torch.equal(built[seed][name], alone[seed][name]) for name in alone[seed]), (algo, seed)
