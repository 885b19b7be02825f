"""Presets: built-ins, overrides by dotted key, and one-line errors before any work starts."""

from __future__ import annotations

import json

import pytest
import torch

from gymflow.flows.cli import main
from gymflow.presets import InvalidPreset, builtin_presets, load_preset, parse_assignments
from gymflow.presets.validate import learner_device, resolve_experiment
from tests.conftest import written_files


def test_builtin_presets_load_and_validate():
    assert {"cartpole-ppo", "cartpole-dqn"} <= set(builtin_presets())
    for name in builtin_presets():
        experiment = resolve_experiment(name)
        assert experiment.preset.name == name
        assert experiment.preset.env.id in ("CartPole-v1", "Pendulum-v1", "LunarLander-v3", "Hopper-v5", "HalfCheetah-v5",
                                            "gymflow.envs.catch:Catch", "ALE/Breakout-v5", "ALE/Pong-v5",
                                            "gymflow.envs.picture_corridor:PictureCorridor", "pettingzoo:mpe2.simple_spread_v3",
                                            "pettingzoo:gymflow.envs.race", "gymflow.envs.hallway:Hallway")


def test_overrides_reach_nested_fields_with_types():
    preset = load_preset("cartpole-ppo", parse_assignments(["agent.lr=3e-4", "distribution.rollout_workers=3", "agent.hidden_sizes=[32, 32]"]))
    assert preset.agent.lr == pytest.approx(3e-4)
    assert preset.distribution.rollout_workers == 3
    assert preset.agent.hidden_sizes == [32, 32]
    assert preset.env_steps_per_iteration == 3 * 8 * 128


def test_a_flow_parameter_may_change_one_field_of_an_optional_section():
    from gymflow.flows.improve import improve
    from gymflow.presets.overrides import PresetOverrides

    overrides = PresetOverrides.model_validate({"dataset.root": "datasets"})  # the dataset's id stays the preset's
    assert overrides.dotted() == {"dataset.root": "datasets"}
    assert load_preset("cartpole-bc", overrides.dotted()).dataset.id == "gymflow/cartpole-v0"
    assert PresetOverrides.model_validate({"dataset": None}).dotted() == {"dataset": None}
    assert "DatasetConfigOverrides" in json.dumps(improve.parameters.model_dump())  # a section of the form


def test_what_prefects_form_sends_empty_changes_nothing_and_a_dotted_null_still_sets_null():
    from gymflow.presets.overrides import PresetOverrides

    # Prefect's custom-run form sends every field it shows: the ones left empty as null, sections as objects
    sent = {"name": None, "seed": None, "env": {"id": None, "kwargs": None, "atari": None},
            "agent": {"lr": 0.001, "algo": None}, "distribution": {"tls": None, "adaptive": {"minimum": None}},
            "dataset": {"id": None}}
    assert PresetOverrides.model_validate(sent).dotted() == {"agent.lr": 0.001}
    meant = PresetOverrides.model_validate({"schedule.target_return": None, "agent.recurrent": None})
    assert meant.dotted() == {"schedule.target_return": None, "agent.recurrent": None}
    assert load_preset("cartpole-ppo", meant.dotted()).schedule.target_return is None
    schema = PresetOverrides.model_json_schema()
    assert schema["$defs"]["AgentOverrides"]["properties"]["algo"]["enum"][-1] is None  # a choice with an empty entry
    assert "anyOf" not in schema["$defs"]["AgentOverrides"]["properties"]["lr"]  # an empty input, no type to pick
    assert "anyOf" not in schema["properties"]["env"]  # a section open at once, not a "None" to switch


def test_on_and_off_on_the_command_line_are_words_that_boolean_fields_read_too():
    preset = load_preset("cartpole-ppo", parse_assignments(["tracking.video=off", "agent.normalize_observations=on",
                                                            "agent.anneal_lr=no", "agent.normalize_rewards=true"]))
    assert preset.tracking.video == "off"
    assert (preset.agent.normalize_observations, preset.agent.anneal_lr, preset.agent.normalize_rewards) == (
        True, False, True)


def test_switching_algorithm_by_override_validates_the_new_agent():
    preset = load_preset("cartpole-dqn", {"agent.algo": "ppo", "agent.lr": 0.0005})
    assert preset.agent.algo == "ppo" and preset.agent.lr == 0.0005
    assert not hasattr(preset.agent, "replay_capacity")  # the DQN settings it does not have are gone
    assert preset.agent.gamma == 0.99  # a setting both have is kept
    with pytest.raises(InvalidPreset, match="^agent.replay: ppo is on-policy"):
        load_preset("cartpole-dqn", {"agent.algo": "ppo", "agent.replay": "prioritized"})


def test_a_preset_file_path_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nenv: {id: 'gymflow.testing.envs:Corridor'}\nagent: {algo: ppo}\n"
                    "schedule: {total_env_steps: 100, rollout_steps_per_env: 4, evaluate_every_env_steps: 50}\n")
    experiment = resolve_experiment(str(path))
    assert experiment.preset.name == "mine"
    assert experiment.action_space.n == 2


def test_a_preset_lays_its_settings_over_its_base(tmp_path):
    from gymflow.presets.load import load_preset

    cheetah, base = load_preset("halfcheetah-ppo"), load_preset("mujoco-ppo")
    assert cheetah.name == "halfcheetah-ppo" and cheetah.env.id == "HalfCheetah-v5"
    assert cheetah.agent == base.agent and cheetah.schedule == base.schedule  # only the task differs
    path = tmp_path / "faster.yaml"
    path.write_text("base: hopper-ppo\nname: faster\nagent: {lr: 0.001}\nschedule: {total_env_steps: 5000}\n")
    mine = load_preset(str(path), {"agent.epochs": 3})
    assert (mine.name, mine.env.id, mine.agent.lr, mine.agent.epochs) == ("faster", "Hopper-v5", 0.001, 3)
    assert mine.agent.log_std_init == base.agent.log_std_init and mine.schedule.rollout_steps_per_env == 256


@pytest.mark.parametrize(("text", "says"), [
    ("base: no-such-preset\nname: x\n", "preset: unknown preset 'no-such-preset'"),
    ("base: [hopper-ppo]\nname: x\n", "base: expected a built-in preset name or a .yaml path"),
    ("base: {self}\nname: x\n", "base: "),
])
def test_a_bad_base_is_one_line_naming_it(tmp_path, text, says):
    from gymflow.presets.load import load_preset

    path = tmp_path / "self.yaml"
    path.write_text(text.replace("{self}", str(path)))
    with pytest.raises(InvalidPreset) as caught:
        load_preset(str(path))
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("preset", "overrides", "field", "says"),
    [
        ("nope", {}, "preset", "allowed: breakout-appo, breakout-dqn, breakout-ppo, cartpole-appo, cartpole-bc, "
                               "cartpole-dqn, cartpole-dqn-async, cartpole-po-ppo, cartpole-ppo, catch-appo, "
                               "catch-dqn, catch-ppo, halfcheetah-ppo, halfcheetah-sac, hallway-ppo, hallway-walk-ppo, "
                               "hopper-iql, hopper-ppo, hopper-td3, lunarlander-ppo, mujoco-ppo, pendulum-po-ppo, "
                               "pendulum-sac, picture-corridor-ppo, pong-appo, race-ppo, spread-ippo, spread-mappo"),
        ("cartpole-ppo", {"env.id": "NoSuchEnv-v0"}, "env.id", "not a registered Gymnasium id"),
        ("cartpole-ppo", {"env.id": "gymflow.testing.envs:NoSuchClass"}, "env.id", "has no 'NoSuchClass'; its gymnasium.Env classes: "),
        ("cartpole-ppo", {"agent.learning_rate": 1}, "agent.learning_rate", "allowed here: activation, algo, anneal_clip_range, anneal_lr"),
        ("cartpole-ppo", {"nonsense": 1}, "nonsense", "allowed here: agent, dataset, distribution, env"),
        ("cartpole-ppo", {"agent.lr": "fast"}, "agent.lr", "valid number"),
        ("cartpole-ppo", {"agent.epochs": 2.5}, "agent.epochs", "valid integer"),
        ("cartpole-ppo", {"schedule.total_env_steps": 0}, "schedule.total_env_steps", "or 0 with a dataset"),
        ("cartpole-ppo", {"schedule.total_env_steps": -5}, "schedule.total_env_steps", "greater than or equal to 0"),
        ("cartpole-dqn", {"schedule.rollout_steps_per_env": None}, "schedule.rollout_steps_per_env", "that collects"),
        ("cartpole-bc", {"dataset": None}, "dataset.id", "bc learns from a dataset alone"),
        ("cartpole-bc", {"schedule.total_env_steps": 1000}, "schedule.total_env_steps", "allowed: 0"),
        ("cartpole-bc", {"schedule.total_train_steps": None}, "schedule.total_train_steps", "counts gradient steps"),
        ("cartpole-bc", {"schedule.heatup_env_steps": 10}, "schedule.heatup_env_steps", "collects nothing"),
        ("cartpole-ppo", {"dataset.id": "gymflow/cartpole-v0"}, "dataset", "needs an off-policy agent"),
        ("catch-ppo", {"agent.recurrent": 16}, "agent.recurrent", "reads vector observations (not yet images)"),
        ("cartpole-bc", {"distribution.mode": "async"}, "distribution.mode", "an offline run collects nothing to stream"),
        ("cartpole-ppo", {"distribution.rollout_workers": 0}, "distribution.rollout_workers", "greater than or equal to 1"),
        ("cartpole-ppo", {"distribution.mode": "turbo"}, "distribution.mode", "'sync' or 'async'"),
        ("cartpole-ppo", {"distribution.mode": "async"}, "distribution.mode", "appo is PPO's asynchronous form"),
        ("cartpole-ppo", {"agent.replay": "prioritized"}, "agent.replay", "ppo is on-policy and keeps no replay memory"),
        ("cartpole-ppo", {"agent": {"algo": "ppo", "priority_alpha": 0.5}}, "agent.priority_alpha", "on-policy"),
        ("pendulum-sac", {"env.id": "CartPole-v1"}, "agent.algo", "sac supports Box action spaces"),
        ("cartpole-dqn-async", {"distribution.max_policy_lag": -1}, "distribution.max_policy_lag", "greater than or equal to 0"),
        ("cartpole-dqn", {"env.id": "Pendulum-v1"}, "agent.algo", "dqn supports Discrete action spaces"),
        ("cartpole-dqn", {"env.id": "gymflow.testing.envs:ContinuousCorridor"}, "agent.algo", "Discrete"),
        ("cartpole-ppo", {"schedule.heatup_env_steps": 100}, "schedule.heatup_env_steps", "on-policy"),
        ("cartpole-ppo", {"distribution.learner_device": "tpu"}, "distribution.learner_device", "should match pattern"),
        ("cartpole-ppo", {"distribution.learner_device": "cuda:99"}, "distribution.learner_device", "asked for, but"),
        *([] if torch.cuda.is_available() else [  # a machine without a GPU refuses cuda before any work
            ("cartpole-ppo", {"distribution.learner_device": "cuda"}, "distribution.learner_device",
             "sees no CUDA device on this machine; use auto or cpu")]),
    ],
)
def test_bad_input_is_one_line_naming_the_field(preset, overrides, field, says):
    with pytest.raises(InvalidPreset) as caught:
        resolve_experiment(preset, overrides)
    message = str(caught.value)
    assert caught.value.field == field
    assert message.startswith(f"{field}: ") and says in message
    assert "\n" not in message


def test_cli_lists_presets(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "cartpole-ppo" in out and "cartpole-dqn" in out


def test_cli_shows_a_preset_with_overrides(capsys):
    assert main(["show", "cartpole-ppo", "--set", "agent.lr=0.0005"]) == 0
    assert "lr: 0.0005" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["run", "no-such-preset"],
        ["run", "cartpole-ppo", "--set", "agent.lr=abc"],
        ["run", "cartpole-ppo", "--set", "agent.nope=1"],
        ["run", "cartpole-ppo", "--set", "schedule.total_env_steps=0"],
        ["run", "cartpole-ppo", "--set", "env.id=NoSuchEnv-v0"],
        ["run", "cartpole-dqn", "--set", "env.id=Pendulum-v1"],
        ["run", "cartpole-ppo", "--set", "missing-equals-sign"],
    ],
)
def test_cli_refuses_bad_input_with_one_line_and_writes_nothing(args, workspace, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gymflow: error: ") and "\n" not in err
    assert written_files(workspace) == []


def test_a_run_s_overrides_tag_names_each_changed_field_and_hides_credentials():
    from gymflow.tasks.training.run import run_tags

    tags = run_tags({"agent.lr": 0.001, "storage": {"options": {"secret": "s3cr3t", "endpoint_url": "http://x"}},
                     "seed": 3}, {"gymflow.sweep.id": "s1"})
    assert tags == {"gymflow.overrides": 'agent.lr=0.001 seed=3 storage.options.endpoint_url="http://x" '
                                         'storage.options.secret=***', "gymflow.sweep.id": "s1"}
    assert run_tags({}) == {"gymflow.overrides": "(none)"}


@pytest.mark.parametrize(("preset", "overrides", "with_a_gpu"), [
    ("breakout-dqn", {}, "cuda"),  # a CNN: the learner's update is several times faster on a GPU
    ("catch-ppo", {"env.id": "gymflow.envs.picture_corridor:PictureCorridor", "env.frame_stack": 1}, "cuda"),
    ("hopper-ppo", {}, "cpu"),  # an MLP: bound by launching kernels, slower on a GPU
    ("cartpole-dqn", {}, "cpu"),
])
def test_auto_puts_the_learner_on_a_gpu_only_where_its_networks_read_images(preset, overrides, with_a_gpu,
                                                                          monkeypatch):
    experiment = resolve_experiment(preset, overrides)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, which this one may not be
    assert learner_device(experiment.preset, experiment.observation_space) == with_a_gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert learner_device(experiment.preset, experiment.observation_space) == "cpu"


def test_a_dotted_key_into_a_mapping_setting_changes_that_key_alone_as_a_flow_parameter_too():
    from gymflow.presets.overrides import PresetOverrides

    # `--set env.kwargs.option=1` is checked by the command line and then run by the flow: both must mean one key
    overrides = PresetOverrides.model_validate({"env.kwargs.option": 1, "env.id": "gymflow.envs.hallway:Hallway",
                                                "storage.options.anon": True, "agent.lr": 0.01})
    assert overrides.dotted() == {"env.id": "gymflow.envs.hallway:Hallway", "agent.lr": 0.01,
                                  "env.kwargs.option": 1, "storage.options.anon": True}
    assert load_preset("hallway-walk-ppo", overrides.dotted()).env.kwargs == {"task": "walk", "max_steps": 20,
                                                                               "option": 1}
    assert PresetOverrides.model_validate({"agent.policies.adversary": "adversaries"}).dotted() == {
        "agent.policies.adversary": "adversaries"}  # the agent's mapping too
    whole_then_one = PresetOverrides.model_validate({"env.kwargs": {"task": "exit"}, "env.kwargs.length": 9})
    assert load_preset("hallway-walk-ppo", whole_then_one.dotted()).env.kwargs == {"task": "exit", "length": 9}


def test_a_mapping_setting_is_replaced_whole_by_an_override_and_by_a_preset_over_its_base(tmp_path):
    from gymflow.presets.overrides import PresetOverrides

    # another env's kwargs are that env's own: none of the base env's may leak into them
    overrides = PresetOverrides.model_validate({"env.kwargs": {"max_cycles": 25}, "distribution.tls": {"ca_file": "ca"}})
    assert overrides.dotted() == {"env.kwargs": {"max_cycles": 25}, "distribution.tls.ca_file": "ca"}  # a section
    assert load_preset("spread-ippo", {"env.kwargs": {"max_cycles": 25}}).env.kwargs == {"max_cycles": 25}
    own = tmp_path / "adversary.yaml"
    own.write_text("base: spread-ippo\nname: adversary-ippo\nenv:\n  id: 'pettingzoo:mpe2.simple_adversary_v3'\n"
                   "  kwargs: {max_cycles: 25}\nagent: {lr: 0.001}\n")
    preset = load_preset(str(own))
    assert preset.env.kwargs == {"max_cycles": 25} and preset.agent.lr == 0.001
    assert preset.agent.entropy_coef == load_preset("spread-ippo").agent.entropy_coef  # sections still merge


def test_gymflow_presets_describes_each_preset_in_one_whole_sentence():
    from gymflow.presets import builtin_presets

    for name, description in builtin_presets().items():
        assert description.endswith("."), (name, description)  # not cut at the end of a comment line
        assert description.count("(") == description.count(")") and description.count("`") % 2 == 0, name
        assert "\n" not in description and len(description) < 400, name


def test_a_rollout_timeout_within_the_stores_outage_budget_is_refused():
    """A job waiting on a store that stopped answering was restarted as wedged before the store was
    lost (rollout_timeout_s below storage.outage_budget_s and the try under way)."""
    from gymflow.outage import store_call_bound_s
    from gymflow.presets.validate import resolve_experiment

    least = 300 + store_call_bound_s(300)
    with pytest.raises(InvalidPreset, match=rf"^distribution.rollout_timeout_s: 300 s would restart a worker as "
                                            rf"wedged .* allowed: more than {least:g} s, or a shorter "
                                            r"storage.outage_budget_s$"):
        resolve_experiment("cartpole-ppo", {"storage.root": "s3://bucket/x", "distribution.rollout_timeout_s": 300})
    resolve_experiment("cartpole-ppo", {"storage.root": "s3://bucket/x"})  # the defaults: 600 s against 375 s
    resolve_experiment("cartpole-ppo", {"distribution.rollout_timeout_s": 5})  # a local folder answers or fails
