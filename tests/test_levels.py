"""Coach's levels: a trained policy wrapped as the environment of the level above (agents/levels.py),
on Hallway (envs/hallway.py), trained by the same improve loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from safetensors.torch import save_file

from gymflow.agents.algorithms import algorithm_of
from gymflow.agents.levels import Level
from gymflow.envs.hallway import Hallway
from gymflow.envs.make import make_env
from gymflow.flows.improve import improve
from gymflow.presets import InvalidPreset
from gymflow.presets.load import load_preset
from gymflow.presets.validate import resolve_experiment
from tests.conftest import local_overrides

LEVEL = "gymflow.agents.levels:Level"


def _lower_weights(folder: Path, always: int | None = None, preset_name: str = "hallway-walk-ppo") -> str:
    """A lower preset's network, untrained: what a Level needs to be made; `always`: its output
    layer made to choose that action whatever it observes (a one-way walker)."""
    preset = load_preset(preset_name)
    env = make_env(preset.env.id, preset.env.kwargs)
    network = algorithm_of(preset.agent).network(preset.agent, env.observation_space, env.action_space)
    weights = {name: tensor.contiguous() for name, tensor in network.state_dict().items()}
    if always is not None:
        output = max(name for name in weights if name.startswith("actor.") and name.endswith(".weight"))
        weights[output] = torch.zeros_like(weights[output])
        weights[output.replace("weight", "bias")] = torch.tensor([10.0 if a == always else -10.0 for a in range(2)])
    path = folder / f"{preset_name}-{always}.safetensors"
    save_file(weights, str(path))
    return str(path)


def test_the_hallway_pays_its_option_s_way_when_walking_and_the_right_end_on_the_exit_task():
    walk = Hallway(task="walk", length=9)
    obs, _ = walk.reset(seed=3)
    option = int(np.argmax(obs[1:]))
    assert walk.step(option)[1] == 1.0 and walk.step(1 - option)[1] == -1.0  # action 1 steps right: option 1's way
    exit_task = Hallway(task="exit", length=5)
    obs, _ = exit_task.reset(seed=0)
    toward, away = (1, 0) if obs[-1] == 1.0 else (0, 1)  # the exit's end, shown
    assert exit_task.step(toward)[1:3] == (0.0, False) and exit_task.step(toward)[1:3] == (1.0, True)
    exit_task.reset(seed=0)
    assert exit_task.step(away)[1:3] == (0.0, False) and exit_task.step(away)[1:3] == (0.0, True)  # the wrong end
    for env in (Hallway(task="walk"), Hallway(task="exit")):
        check_env(env, skip_render_check=True)


def test_a_one_skill_walker_walks_its_option_every_game_and_is_not_shown_it():
    walker = Hallway(task="walk", length=9, option=0)
    for seed in range(4):
        obs, _ = walker.reset(seed=seed)
        assert not obs[1:3].any() and walker.step(0)[1] == 1.0  # walking left pays, whatever the draw
    with pytest.raises(TypeError, match="option is the walk task's fixed option"):
        Hallway(task="exit", option=1)
    check_env(Hallway(task="walk", option=1), skip_render_check=True)


def test_a_level_over_a_group_of_policies_chooses_which_policy_acts(tmp_path):
    left, right = _lower_weights(tmp_path, always=0), _lower_weights(tmp_path, always=1)
    level = Level("hallway-walk-ppo", [left, right], every=3, env_kwargs={"task": "exit"})
    check_env(level, skip_render_check=True)
    assert level.action_space.n == 2
    obs, _ = level.reset(seed=1)
    middle = level.lower.unwrapped._position
    obs, *_ = level.step(1)
    assert level.lower.unwrapped._position == middle + 3 and not obs[1:3].any()  # the right walker; no option shown
    level.step(0)
    level.step(0)
    assert level.lower.unwrapped._position == middle - 3
    pushers = [_lower_weights(tmp_path, always, "cartpole-ppo") for always in (0, 1)]
    level = Level("cartpole-ppo", pushers, every=2)  # a lower env without options: the policies are the options
    check_env(level, skip_render_check=True)
    assert level.action_space.n == 2


def test_a_level_is_an_env_whose_step_chooses_an_option_the_lower_policy_walks_for_every_steps(tmp_path):
    level = Level("hallway-walk-ppo", _lower_weights(tmp_path), every=4, env_kwargs={"task": "exit"})
    check_env(level, skip_render_check=True)
    assert level.action_space.n == 2 and level.observation_space == Hallway().observation_space
    obs, _ = level.reset(seed=1)
    obs, reward, terminated, truncated, _ = level.step(1)
    assert level.lower.unwrapped._steps == 4 and obs[2] == 1.0  # four hallway steps, option 1 shown
    experiment = resolve_experiment("hallway-ppo", {
        "env.id": LEVEL, "env.kwargs": {"lower_preset": "hallway-walk-ppo", "policy": _lower_weights(tmp_path)},
    })  # gymflow's own checks of an env, on the level
    assert experiment.observation_space.shape == (4,) and experiment.action_space.n == 2


def test_a_level_that_cannot_be_made_is_refused_in_one_line(tmp_path):
    def refused(kwargs: dict) -> str:
        with pytest.raises(InvalidPreset) as error:
            resolve_experiment("hallway-ppo", {"env.id": LEVEL, "env.kwargs": kwargs})
        return str(error.value)

    weights = _lower_weights(tmp_path)
    assert refused({"lower_preset": "hallway-walk-ppo", "policy": str(tmp_path / "none.safetensors")}).startswith(
        "env.kwargs: policy: cannot load the lower level's weights from")
    assert refused({"lower_preset": "cartpole-ppo", "policy": weights}) == (
        "env.kwargs: 'CartPole-v1' offers no options (an `options` count and a `choose(option)` method) for a "
        "level above to choose; or give `policy` a list of policies to choose between")
    assert refused({"lower_preset": "hallway-walk-ppo", "policy": weights, "every": 0}).startswith(
        "env.kwargs: every: 0; allowed: an integer >= 1")
    assert refused({"lower_preset": "hallway-walk-ppo", "policy": []}).startswith(
        "env.kwargs: policy: []; allowed: a policy.safetensors path, or a list of them")
    assert refused({"lower_preset": "hallway-walk-ppo", "policy": [weights, "missing.safetensors"]}).startswith(
        "env.kwargs: policy: cannot load the lower level's weights from 'missing.safetensors'")


# default tier (one of its 25 slowest): hierarchical levels' one test
@pytest.mark.e2e
def test_two_levels_trained_by_the_improve_loop_solve_what_a_flat_policy_does_not_at_a_small_budget(
        prefect_api, workspace):
    run = {**local_overrides(workspace), "distribution.mode": "single", "tracking.video": "off"}
    skills = improve("hallway-walk-ppo", run)
    assert skills.solved  # walks whichever way it is told (its target: 19 of 20 steps its way)
    policy = workspace / "data" / "runs" / skills.run_id / "policies" / f"v{skills.delivered_version:06d}"
    level = improve("hallway-ppo", {**run, "env.id": LEVEL, "schedule.total_env_steps": 4096,
                                    "schedule.target_return": 0.95,  # hallway-ppo's, which another env does not keep
                                    "env.kwargs": {"lower_preset": "hallway-walk-ppo",
                                                   "policy": str(policy / "policy.safetensors"), "every": 5}})
    assert level.solved and level.final_return >= 0.95
    flat = improve("hallway-ppo", {**run, "schedule.total_env_steps": skills.env_steps + 5 * level.env_steps})
    assert not flat.solved
