"""The C++ backends behind gymflow's vector env (EnvPool's, envs/envpool_backend.py; the ALE's,
envs/ale_backend.py, whose replay tests/test_ale_backend.py holds): the same task as the Gymnasium
path (MuJoCo's dynamics step for step from the same state; Atari's games alike over episodes),
gymflow's episode semantics (same-step autoreset, a lost life terminal for learning, the cursor a
shard keeps), the presets that choose them and what they refuse, and runs on them end to end."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from gymflow.agents.rollout import collect, collect_in_halves
from gymflow.envs.batched import ActionLog
from gymflow.envs.envpool_backend import EnvPoolVectorEnv, pool_task
from gymflow.envs.make import Preprocessing, make_env
from gymflow.envs.vector import SeededVectorEnv, make_vector_env
from gymflow.errors import InvalidPreset
from gymflow.flows.improve import improve
from gymflow.presets.load import load_preset
from gymflow.presets.validate import experiment_from, rollout_backend
from tests.conftest import TINY_MUJOCO, local_overrides

pytest.importorskip("envpool")
ATARI = Preprocessing(frame_stack=4, atari=True)


@pytest.mark.parametrize("env_id", ["Hopper-v5", "HalfCheetah-v5"])
def test_a_mujoco_task_steps_as_gymnasiums_from_the_same_state(env_id):
    """From EnvPool's first state (as gymflow keeps it, in float32), set in Gymnasium's env, the same
    actions give the same observations and rewards, to that rounding (which the dynamics amplify
    step by step: HalfCheetah's drift past 1e-4 after ~40 steps)."""
    pool = EnvPoolVectorEnv(pool_task(env_id, {}, Preprocessing()), 1, seed=0)
    first = pool.reset()[0].astype(np.float64)
    env = make_env(env_id)
    env.reset(seed=0)
    model = env.unwrapped.model
    hidden = model.nq + model.nv - len(first)  # positions the observation leaves out (x; x and y)
    env.unwrapped.set_state(np.concatenate([np.zeros(hidden), first[: model.nq - hidden]]), first[model.nq - hidden:])
    assert pool.observation_space.shape == env.observation_space.shape and pool.action_space == env.action_space
    actions = np.random.default_rng(0).uniform(-1, 1, size=(10, *env.action_space.shape)).astype(np.float32)
    for t, action in enumerate(actions):
        step = pool.step(action[None])
        obs, reward, terminated, truncated, _ = env.step(action)
        assert np.allclose(step.obs[0], obs, atol=1e-4) and abs(step.rewards[0] - reward) < 1e-4, t
        assert bool(step.terminated[0]) == terminated and step.done_envs == ([0] if terminated else []), t
    pool.close()


@pytest.mark.parametrize("backend", ["envpool", "ale"])
def test_an_atari_game_plays_as_on_gymnasium_over_episodes(backend):
    """Breakout under gymflow's Atari preprocessing: the same spaces and score scale; a random
    policy's whole games alike on both (the C++ backends draw their no-op starts apart)."""
    cpp = make_vector_env("ALE/Breakout-v5", {"repeat_action_probability": 0.25}, 4, 0, ATARI.evaluation(), backend)
    python = SeededVectorEnv("ALE/Breakout-v5", {"repeat_action_probability": 0.25}, 4, 0, ATARI.evaluation())
    assert cpp.observation_space == python.observation_space and cpp.action_space == python.action_space
    returns = {}
    for name, env in ((backend, cpp), ("gymnasium", python)):
        env.reset()
        rng, played = np.random.default_rng(1), []
        while len(played) < 12:
            played += env.step(rng.integers(0, 4, size=4)).episode_returns
        returns[name] = np.mean(played)
        env.close()
    assert 0.5 < returns[backend] < 3.5 and 0.5 < returns["gymnasium"] < 3.5, returns  # random play: ~1.5
    assert abs(returns[backend] - returns["gymnasium"]) < 1.0, returns


def _games_never_pressing_fire(env, games: int) -> list[tuple[int, float]]:
    env.reset()
    played = []
    for _ in range(2000):  # served games end within 400 steps
        step = env.step(np.zeros(env.num_envs, dtype=np.int64))  # NOOP, always
        played += list(zip(step.episode_lengths, step.episode_returns))
    env.close()
    assert len(played) >= games, played
    return played[:games]


@pytest.mark.parametrize("backend", ["envpool", "ale"])
def test_every_ball_is_served_on_the_cpp_backends_as_on_gymnasium_for_a_policy_that_never_presses_fire(backend):
    """FIRE at a game's start and after each of Breakout's 5 lost lives: a policy that stands still
    plays Gymnasium's games (its two kinds, by the no-op start) on every backend, as long (the
    presses replace the env's next two actions, where Gymnasium's are inside a step, and are no
    steps of the policy's); unserved, a game would run to the 27,000-step cap."""
    kwargs = {"repeat_action_probability": 0.0}
    python = _games_never_pressing_fire(SeededVectorEnv("ALE/Breakout-v5", kwargs, 4, 0, ATARI.evaluation()), 8)
    cpp = _games_never_pressing_fire(make_vector_env("ALE/Breakout-v5", kwargs, 4, 0, ATARI.evaluation(), backend), 8)
    assert set(cpp) <= set(python), (cpp, python)


class _StandingStill:
    """A policy that always sends NOOP, acting from outputs another process computed (or its own)."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(len(obs), np.int64), np.full(len(obs), -0.5, np.float32)

    def act_on(self, obs: np.ndarray, outputs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return self.act(obs, explore)


class _Outputs:
    """Outputs for `collect_in_halves`, handed back in the order asked for."""

    def __init__(self):
        self.asked: list[int] = []

    def request(self, obs: np.ndarray) -> None:
        self.asked.append(len(obs))

    def receive(self) -> np.ndarray:
        return np.zeros((self.asked.pop(0), 4), np.float32)


@pytest.mark.parametrize(("backend", "halves"), [("envpool", False), ("ale", False), ("envpool", True)])
def test_the_steps_a_cpp_backend_sends_fire_in_are_recorded_as_sent_and_as_no_samples_of_the_policy(backend, halves):
    """A policy that stands still, on Breakout: at each game's start and after each lost life the
    backend sends FIRE, then action 2; the rollout holds those actions, and those rows alone are not
    alive (what the learners leave out of their losses); the episodes' lengths leave them out."""
    env = make_vector_env("ALE/Breakout-v5", {"repeat_action_probability": 0.0}, 4, 0, ATARI, backend)
    env.reset()
    rollout, episodes = (collect_in_halves(_StandingStill(), env, 600, _Outputs()) if halves
                         else collect(_StandingStill(), env, 600))
    env.close()
    sent, alive = rollout.actions, rollout.alive
    assert alive is not None and np.array_equal(alive, sent == 0)
    assert np.array_equal(sent[:2], np.tile([[1], [2]], (1, 4)))  # every game's start served
    presses = [1 if t == 0 or rollout.terminated[t - 1, env_index] else 2 if sent[t - 1, env_index] == 1 else 0
               for t in range(len(sent)) for env_index in range(4)]
    assert np.array_equal(sent.flatten(), presses)  # after each lost life (terminal for learning), two presses
    assert (~alive).sum() >= 2 * 4 * 3 and len(episodes.lengths) >= 1
    first_ends = {}  # each env's first game, from the rollout's first step: its length, the step it ended at
    for length, flat in zip(episodes.lengths, rollout.done_index):
        first_ends.setdefault(int(flat) % 4, (int(length), int(flat) // 4))
    assert first_ends and all(length == alive[:t + 1, i].sum() for i, (length, t) in first_ends.items())


def test_the_ales_stacks_repeat_a_game_s_first_frame_as_gymnasium_s_do():
    env = make_vector_env("ALE/Breakout-v5", {"repeat_action_probability": 0.25}, 2, 1, ATARI, "ale")
    stacks = [env.reset().copy()] + [env.step(np.full(2, 1)).obs.copy() for _ in range(3)]
    for age, obs in enumerate(stacks):  # the slots before the game's first frame hold that frame
        first = 3 - age
        assert all(np.array_equal(obs[:, slot], obs[:, first]) for slot in range(first)), age
        assert obs[:, first].any(), age
    env.close()


@pytest.mark.parametrize("backend", ["envpool", "ale"])
def test_the_cpp_backends_envs_reset_on_the_step_that_ends_an_episode_and_a_lost_life_ends_it_for_learning(backend):
    env = make_vector_env("ALE/Breakout-v5", {"repeat_action_probability": 0.0}, 2, 3, ATARI, backend)
    env.reset()
    lives_lost, ended = 0, None
    for _ in range(2000):
        step = env.step(np.ones(2, dtype=np.int64))  # FIRE and nothing else: the ball served and lost, life by life
        lives_lost += int(step.terminated.sum()) - len(step.done_envs)
        if step.done_envs:
            ended = step
            break
    assert ended is not None and lives_lost >= 4  # every life but the last ended learning, not the game
    i = ended.done_envs[0]
    assert not np.array_equal(ended.done_obs[0], ended.obs[i])  # the game's last frame apart; obs: a new game
    assert ended.episode_lengths[0] > 0 and ended.rewards.dtype == np.float32
    cursor, presses = env.cursor(), 2 * 5  # FIRE's two presses at the start and after each of 4 lost lives
    for j in range(2):  # a game that ended has just begun its next; one that goes on holds its actions
        assert (cursor.episode_index[j], cursor.action_counts[j] == 0) == (1, True) if j in ended.done_envs else \
            (cursor.episode_index[j], len(cursor.actions_of(j))) == (0, ended.episode_lengths[0] + presses)
    env.close()


def test_envpool_continues_from_a_cursor_with_new_episodes():
    """EnvPool seeds a pool once: a cursor's episodes cannot be replayed; the envs start the next
    ones, from a seed the cursor draws (the same cursor: the same new episodes)."""
    task = pool_task("Hopper-v5", {}, Preprocessing())
    env = EnvPoolVectorEnv(task, 2, seed=0)
    env.reset()
    for _ in range(5):
        env.step(np.zeros((2, 3), dtype=np.float32))
    cursor = env.cursor()
    again, other = EnvPoolVectorEnv(task, 2, seed=0), EnvPoolVectorEnv(task, 2, seed=0)
    assert np.array_equal(again.reset(cursor), other.reset(cursor))
    assert list(again.cursor().episode_index) == [1, 1] and not again.cursor().action_counts.any()
    for vector in (env, again, other):
        vector.close()


def test_an_envpool_episode_s_length_counts_the_steps_its_env_took_when_envs_step_in_halves():
    """Episode lengths as the steps each env took, where some steps step half the envs (a rollout
    whose actions come from an inference server) and the rest stand."""
    env, rng = EnvPoolVectorEnv(pool_task("Hopper-v5", {}, Preprocessing()), 4, seed=0), np.random.default_rng(0)
    env.reset()
    taken, lengths, said = np.zeros(4, dtype=np.int64), [], []
    for step in range(600):
        rows = [slice(0, 4), slice(0, 2), slice(2, 4), slice(1, 3)][step % 4]
        actions = rng.uniform(-1, 1, (rows.stop - rows.start, 3)).astype(np.float32)
        ended = env.step(actions) if rows == slice(0, 4) else env.step_rows(rows, actions)
        taken[rows] += 1
        for env_index, length in zip(ended.done_envs, ended.episode_lengths, strict=True):
            lengths.append(int(taken[env_index]))
            said.append(length)
            taken[env_index] = 0
    env.close()
    assert len(said) > 10 and said == lengths


@pytest.mark.parametrize("partial_every", [0, 7])
def test_the_action_log_gives_each_env_its_actions_since_its_episode_began_and_those_kept_before(partial_every):
    """ActionLog (the C++ backends' cursors) against each env's own list, over steps of every env and of
    some (`partial_every`), episodes begun with earlier actions kept or not, and steps let go."""
    rng, envs = np.random.default_rng(3), 5
    log, current, earlier = ActionLog(envs), [[] for _ in range(envs)], [[] for _ in range(envs)]
    for step in range(2_000):
        first, stop = (0, envs) if not partial_every or step % partial_every else sorted(rng.choice(envs + 1, 2, False))
        actions = rng.integers(0, 100, stop - first)
        log.add(int(first), actions)
        for env in range(first, stop):
            current[env].append(actions[env - first])
        ended = np.flatnonzero(rng.random(envs) < 0.01)
        if len(ended):
            keep = rng.random(len(ended)) < 0.5
            log.began(ended, keep)
            for env, kept in zip(ended, keep):
                earlier[env], current[env] = (earlier[env] + current[env] if kept else []), []
        if step % 97 == 0:
            assert [list(np.asarray(a)) for a in log.current()] == current
            assert [list(np.asarray(a)) for a in log.earlier()] == earlier


def test_the_backend_is_envpool_where_a_run_is_async_and_envpool_has_the_task():
    assert rollout_backend(load_preset("breakout-appo")) == "envpool"
    assert rollout_backend(load_preset("halfcheetah-sac", {"distribution.mode": "async"})) == "envpool"
    assert rollout_backend(load_preset("breakout-ppo")) == "ale"  # sync: its resume replays envs (tests/test_ale_backend.py)
    assert rollout_backend(load_preset("halfcheetah-sac")) == "gymnasium"  # sync, and envpool's cannot be replayed
    assert rollout_backend(load_preset("cartpole-dqn-async")) == "gymnasium"  # a task envpool does not have
    assert rollout_backend(load_preset("halfcheetah-sac", {"distribution.mode": "async", "env.backend": "gymnasium"})
                           ) == "gymnasium"


@pytest.mark.parametrize(("preset", "overrides", "says"), [
    ("breakout-ppo", {"env.backend": "envpool"}, "env.backend: envpool cannot replay its envs from an env cursor, "
                                                 "which a sync run's exact resume needs"),
    ("cartpole-dqn-async", {"env.backend": "envpool"}, "env.backend: envpool has no task that is 'CartPole-v1'"),
    ("halfcheetah-sac", {"env.backend": "envpool", "distribution.mode": "async", "env.kwargs": {"width": 64}},
     "env.backend: envpool's HalfCheetah-v5 does not take env.kwargs ['width']"),
    ("halfcheetah-sac", {"env.backend": "envpool", "distribution.mode": "async", "env.hide": [0]},
     "env.backend: envpool observes whole vectors"),
    ("cartpole-ppo", {"env.backend": "ale"}, "env.backend: ale steps ALE/... ids with env.atari, not 'CartPole-v1'"),
    ("breakout-ppo", {"env.backend": "ale", "env.kwargs": {"repeat_action_probability": 0.0, "mode": 0}},
     "env.backend: ale's vector env does not take env.kwargs ['mode']"),
    ("breakout-ppo", {"env.backend": "ale", "distribution.inference": "learner"},
     "env.backend: ale steps a worker's whole batch a call"),
    ("cartpole-ppo", {"distribution.env_threads": 2}, "distribution.env_threads: 2 threads step a C++ backend's envs, "
                                                      "and this run's step on gymnasium; allowed: 1"),
    ("breakout-ppo", {"distribution.env_threads": 8}, "distribution.env_threads: 8 threads for 4 envs a worker; "
                                                      "allowed: 1 to distribution.envs_per_worker"),
])
def test_a_cpp_backend_is_refused_in_one_line_where_it_would_not_be_the_task_or_keep_the_promise(preset, overrides, says):
    with pytest.raises(InvalidPreset) as refused:
        experiment_from(load_preset(preset, overrides))
    assert str(refused.value).startswith(says), refused.value
    assert "\n" not in str(refused.value)


def _cpp_backend_run(preset: str, overrides: dict, workspace, backend: str = "envpool") -> None:
    """A tiny run of `preset` whose rollouts step on a C++ backend (auto: EnvPool where async): the
    checks the Gymnasium path's end-to-end tests make (its steps, its evaluations in MLflow, an
    evaluation's film)."""
    summary = improve(preset, {**TINY_MUJOCO, **overrides, **local_overrides(workspace)})
    assert summary.env_steps >= 1024
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.tags["gymflow.env_backend"] == backend
    assert run.info.status == "FINISHED" and "eval/return_mean" in run.data.metrics
    (film,) = client.list_artifacts(summary.mlflow_run_id, "videos")  # evaluation: on Gymnasium
    assert film.path.endswith(".mp4") and film.file_size > 1000


OFF_POLICY = {"distribution.mode": "async", "schedule.heatup_env_steps": 256, "agent.batch_size": 32,
              "agent.train_steps_per_iteration": 8}


# default tier: the first of its capability (rollouts on a C++ backend); Hopper's early falls keep its
# evaluations and film short
@pytest.mark.e2e
def test_an_async_hopper_td3_run_collects_on_envpool_end_to_end(prefect_api, workspace):
    _cpp_backend_run("hopper-td3", {**OFF_POLICY, "distribution.learner_threads": 1}, workspace)


@pytest.mark.e2e
@pytest.mark.slow  # long tier: the second of its capability (146 s here: HalfCheetah's 1,000-step evaluations)
def test_an_async_halfcheetah_sac_run_collects_on_envpool_end_to_end(prefect_api, workspace):
    _cpp_backend_run("halfcheetah-sac", OFF_POLICY, workspace)


@pytest.mark.e2e
@pytest.mark.slow  # long tier: a third of its capability
def test_a_breakout_appo_run_collects_on_envpool_end_to_end(prefect_api, workspace):
    _cpp_backend_run("breakout-appo", {"agent.hidden_sizes": [64], "agent.minibatch_size": 64}, workspace)


@pytest.mark.e2e
@pytest.mark.slow  # long tier: SYNC Breakout PPO on the ALE's vector env (auto), 2 workers x 2 envs x 32 steps a round
def test_a_sync_breakout_ppo_run_collects_on_the_ales_vector_env_end_to_end(prefect_api, workspace):
    _cpp_backend_run("breakout-ppo", {"schedule.rollout_steps_per_env": 32, "schedule.evaluate_every_env_steps": 100_000,
                                  "schedule.evaluation_episodes": 1, "agent.minibatch_size": 64, "agent.epochs": 1,
                                  "schedule.target_return": None}, workspace, backend="ale")
