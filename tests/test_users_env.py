"""A user's own env treated as theirs: the run named after it, its target from its spec (or none),
its observations checked against its declared space before any work, and near names suggested."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gymflow.errors import InvalidPreset
from gymflow.presets.load import load_preset
from gymflow.presets.validate import resolve_experiment
from tests.conftest import local_overrides, written_files

USERS_ENVS = '''
import gymnasium as gym
import numpy as np
from gymnasium import spaces


class MyEnv(gym.Env):
    """Observes 3 numbers and says so."""

    def __init__(self, size=3):
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(size,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 1.0, True, False, {}


class Misdeclared(MyEnv):
    """Observes 3 numbers and declares 1."""

    def __init__(self):
        super().__init__(size=1)


class TwoNumbers(gym.Env):
    """Declares Box(-1, 1) of 2 numbers and counts its steps."""

    def __init__(self):
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}


class BreaksMidRun(TwoNumbers):
    """Observes 2 numbers, until its 40th step, which returns 5."""

    def step(self, action):
        self.steps += 1
        return np.zeros(5 if self.steps >= 40 else 2, np.float32), 1.0, False, self.steps % 8 == 0, {}


class Drifts(TwoNumbers):
    """Drifts out of its Box: its first entry grows by 0.5 a step."""

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.steps += 1
        return np.array([0.5 * self.steps, 0.0], np.float32), 1.0, False, self.steps >= 120, {}


class Raising(MyEnv):
    def reset(self, *, seed=None, options=None):
        raise RuntimeError("no level file")
'''


@pytest.fixture
def users_folder(tmp_path, monkeypatch):
    (tmp_path / "my_own_envs.py").write_text(USERS_ENVS)
    monkeypatch.delitem(sys.modules, "my_own_envs", raising=False)  # another test's, or an earlier copy
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_run_on_another_env_is_named_after_it_and_takes_its_spec_s_target(users_folder):
    mine = load_preset("cartpole-ppo", {"env.id": "my_own_envs:MyEnv"})
    assert mine.name == "myenv-ppo" and mine.schedule.target_return is None  # an entry point's spec gives none
    acrobot = load_preset("cartpole-ppo", {"env.id": "Acrobot-v1"})
    assert acrobot.name == "acrobot-ppo" and acrobot.schedule.target_return == -100.0  # Gymnasium's reward_threshold
    assert load_preset("cartpole-dqn", {"env.id": "Acrobot-v1", "agent.algo": "ppo"}).name == "acrobot-ppo"
    kept = load_preset("cartpole-ppo", {"env.id": "my_own_envs:MyEnv", "name": "mine", "schedule.target_return": 0.5})
    assert kept.name == "mine" and kept.schedule.target_return == 0.5  # what the user set stays
    assert load_preset("cartpole-ppo", {"env.id": "CartPole-v1"}).schedule.target_return == 475  # the preset's own
    assert load_preset("hallway-ppo", {"env.id": "my_own_envs:MyEnv"}).env.kwargs == {}  # the other env's kwargs dropped


def test_an_env_whose_observations_do_not_fit_its_space_is_refused_before_anything_is_written(
        users_folder, prefect_api):
    from gymflow.flows.improve import improve

    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("cartpole-ppo", {"env.id": "my_own_envs:Misdeclared"})
    said = str(refused.value)
    assert said.startswith("env.id: 'my_own_envs:Misdeclared' returned an observation of shape (3,) from reset")
    assert "holds shape (1,)" in said and "\n" not in said
    before = written_files(users_folder)
    state = improve("cartpole-ppo", {"env.id": "my_own_envs:Misdeclared", **local_overrides(users_folder)},
                    return_state=True)
    assert state.is_failed() and state.message.count("returned an observation of shape (3,)") == 1
    assert written_files(users_folder) == before  # no MLflow store, no storage folder


def test_an_env_that_raises_as_it_is_checked_is_refused_in_one_line(users_folder):
    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("cartpole-ppo", {"env.id": "my_own_envs:Raising"})
    assert str(refused.value) == ("env.id: 'my_own_envs:Raising' raised RuntimeError: no level file as it was reset "
                                  "(seed 0) and stepped once, before the run")


@pytest.mark.parametrize(("preset", "overrides", "says"), [
    ("cartpole-ppo", {"env.id": "my_own_envs:MyEnvv"}, "env.id: 'my_own_envs' has no 'MyEnvv'; did you mean 'MyEnv'?"),
    ("cartpole-ppp", {}, "preset: unknown preset 'cartpole-ppp'; did you mean 'cartpole-ppo'?"),
    ("cartpole-ppo", {"agent.lrr": 0.1}, "agent.lrr: unknown setting; did you mean 'lr'?"),
    ("cartpole-ppo", {"schedule.total_env_step": 10}, "schedule.total_env_step: unknown setting; did you mean "
                                                      "'total_env_steps'?"),
])
def test_a_near_name_is_suggested(users_folder, preset, overrides, says):
    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment(preset, overrides)
    assert str(refused.value).startswith(says)


def test_the_commands_gymflow_prints_run_from_where_the_user_is(tmp_path, monkeypatch):
    """After `make train` the command is .venv/bin/gymflow, not on PATH: printed so; on PATH, `gymflow`."""
    import os
    from pathlib import Path

    from gymflow.commands import gymflow_command

    venv_bin = Path(sys.executable).parent
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                if Path(p).resolve() != venv_bin.resolve()))
    monkeypatch.chdir(venv_bin.parent.parent)  # the checkout, beside its .venv
    assert gymflow_command() == os.path.relpath(venv_bin / "gymflow")
    monkeypatch.chdir(tmp_path)
    assert gymflow_command() == str(venv_bin / "gymflow")
    monkeypatch.setenv("PATH", os.pathsep.join((str(venv_bin), os.environ["PATH"])))
    assert gymflow_command() == "gymflow"


# default tier: the first of its capability (a run that fails mid-way keeps its log, says what failed)
def _run_on(users_folder, env_class: str, settings: dict, *flags: str) -> subprocess.CompletedProcess:
    """`gymflow run cartpole-ppo` on one of USERS_ENVS from the user's folder (1 worker of 2 envs, no
    target), its own temporary Prefect API."""
    settings = {"env.id": f"my_own_envs:{env_class}", "distribution.rollout_workers": 1,
                "distribution.envs_per_worker": 2, "schedule.target_return": "null", **settings}
    args = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_") or key == "PREFECT_HOME"}
    return subprocess.run([sys.executable, "-m", "gymflow.flows.cli", "run", "cartpole-ppo", *flags, *args],
                          cwd=users_folder, env={**env, "PYTHONPATH": str(users_folder)}, capture_output=True,
                          text=True, timeout=300)


def test_a_users_env_failing_in_step_mid_run_keeps_the_run_s_log_and_names_what_it_returned(users_folder):
    """An env whose `step` returns shape (5,) against its (2,) space, long after the check before the
    run: the run used to remove its own log and say numpy's `could not broadcast` error. Its log stays,
    with the traceback, and its line names the env, `step`, what it returned and what its space holds."""
    done = _run_on(users_folder, "BreaksMidRun", {"schedule.rollout_steps_per_env": 16,
                                                  "schedule.total_env_steps": 640}, "--quiet")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("gymflow: error: rollout job ") and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "env.id: 'my_own_envs:BreaksMidRun' returned an observation of shape (5,) from step; its " \
           "observation_space Box(-1.0, 1.0, (2,), float32) holds shape (2,)" in last, last
    (log,) = (users_folder / "gymflow-logs").glob("breaksmidrun-ppo-*.log")
    assert f"the whole log is in gymflow-logs/{log.name}" in done.stderr
    kept = log.read_text()
    assert "Traceback" in kept and "returned an observation of shape (5,) from step" in kept
    assert (users_folder / "data" if (users_folder / "data").exists() else users_folder / "gymflow-data").is_dir()


def test_observations_outside_the_declared_space_are_said_once_a_run_and_the_run_is_tagged_with_its_preset_and_env(
        users_folder):
    """An env that declares Box(-1, 1) and returns 60: training goes on, and one line names the env,
    its space, the entry and how far outside (checked on a sample of each shard's steps). The MLflow
    run says which preset it came from (one `gymflow run` takes: not the run's name `drifts-ppo`) and
    which env it learned."""
    done = _run_on(users_folder, "Drifts", {"schedule.rollout_steps_per_env": 64, "schedule.total_env_steps": 512})
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "outside the bounds it declares" in line]
    assert len(said) == 1, done.stderr[-3000:]  # 4 rounds, each shard outside: said once
    assert "env.id: 'my_own_envs:Drifts' (observation_space Box(-1.0, 1.0, (2,), float32)) returned observations " \
           "outside the bounds it declares: entry 0 reached " in said[0] and "above its high 1" in said[0], said
    from mlflow.tracking import MlflowClient

    (run,) = MlflowClient(f"sqlite:///{users_folder / 'mlflow.db'}").search_runs(["1"])
    assert run.info.run_name.startswith("drifts-ppo-")
    assert (run.data.tags["gymflow.preset"], run.data.tags["gymflow.env"]) == ("cartpole-ppo", "my_own_envs:Drifts")


def test_the_bounds_check_names_the_entry_furthest_outside_and_lets_rounding_images_and_open_bounds_be():
    import numpy as np
    from gymnasium import spaces

    from gymflow.envs.steps import observations_outside

    box = spaces.Box(np.array([-1.0, 0.0]), np.array([1.0, 10.0]), dtype=np.float32)
    obs = np.zeros((8, 3, 2), np.float32)
    assert observations_outside(box, obs) is None
    obs[4, 1] = [1.0000001, 10.00001]  # float32's rounding of the bounds: inside
    assert observations_outside(box, obs) is None
    obs[0, 2] = [-3.0, 12.0]  # 2 below, 2 above: the first found of the furthest
    obs[4, 0, 1] = 30.0
    assert observations_outside(box, obs) == "entry 1 reached 30, above its high 10"
    assert observations_outside(spaces.Box(-np.inf, np.inf, (2,)), obs * 1e6) is None
    assert observations_outside(spaces.Box(0, 255, (2, 2), np.uint8), np.full((4, 1, 2, 2), 255, np.uint8)) is None
