"""A policy as an ONNX graph (agents/export.py): for each family gymflow trains, ONNX Runtime's
actions on 1,000 observations against the policy's own greedy ones (what the pyfunc model answers):
discrete identical, continuous within 1e-5; observation normalisation folded in; what cannot be a
graph yet refused in one line. A finished run's ONNX model in MLflow: tests/test_what_users_see.py."""

from __future__ import annotations

import concurrent.futures
import functools
import types

import numpy as np
import onnxruntime
import pytest
import torch
from safetensors.torch import save

from gymflow.agents.export import CannotExport, onnx_policy
from gymflow.agents.normalization import RunningMeanVar
from gymflow.envs.parts import flatten_parts, observation_parts, unflatten_parts
from gymflow.presets.validate import resolve_experiment

PICTURE = "gymflow.envs.picture_corridor:PictureCorridor"

FAMILIES = [
    ("cartpole-ppo", {"agent.normalize_observations": True}),  # MLP, discrete, normalised observations
    ("breakout-ppo", {}),  # the Nature CNN over uint8 frame stacks
    ("halfcheetah-ppo", {"agent.normalize_observations": True}),  # a Gaussian's mean
    ("cartpole-appo", {"agent.normalize_observations": True}),  # APPO's actor, V-trace's critic beside it
    ("catch-appo", {}),  # APPO's CNN
    ("cartpole-appo", {"agent.algo": "impala"}),  # IMPALA's
    ("cartpole-dqn", {}),  # Q-values' argmax
    ("catch-dqn", {}),  # a CNN's Q-values
    ("pendulum-sac", {}),  # the squashed Gaussian's mean, in the env's bounds
    ("hopper-td3", {"agent.normalize_observations": True}),
    ("hopper-iql", {}),
    ("cartpole-bc", {}),
    # Dict observations, one input a part: a CNN for the picture beside the normalised clock
    ("picture-corridor-ppo", {"agent.normalize_observations": True}),
    ("pendulum-sac", {"env.id": PICTURE, "env.kwargs": {"continuous": True}, "agent.normalize_observations": True}),
    ("catch-dqn", {"env.id": PICTURE, "env.frame_stack": 1}),
    ("cartpole-ppo", {"env.id": "gymflow.testing.envs:PartsCorridor", "agent.normalize_observations": True}),  # vectors alone
]


def _trained_like(network: torch.nn.Module) -> torch.nn.Module:
    """Weights and normalisation statistics away from their initial values, as a run leaves them."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
        for module in network.modules():
            if isinstance(module, RunningMeanVar):
                module.mean.normal_(0.0, 1.0, generator=generator)
                module.var.uniform_(0.2, 4.0, generator=generator)
    return network.eval()


def _observations(space, count: int = 1000) -> np.ndarray:
    """Samples of the space; frames each dimmed by its own factor, so that they differ in more than noise.
    A Dict observation's: samples of its parts, flattened as the env gives them."""
    parts = observation_parts(space)
    if parts:
        return flatten_parts(parts, {part.key: _observations(space.dict_space[part.key], count) for part in parts})
    space.seed(0)
    samples = np.stack([space.sample() for _ in range(count)])
    if space.dtype != np.uint8:
        return samples.astype(np.float32)
    brightness = np.random.default_rng(0).uniform(0.0, 1.0, size=(count,) + (1,) * (samples.ndim - 1))
    return (samples * brightness).astype(np.uint8)


def _feeds(space, observations: np.ndarray) -> dict[str, np.ndarray]:
    """The graph's inputs: the observations, or a Dict observation's parts by name (as the pyfunc takes them)."""
    parts = observation_parts(space)
    return unflatten_parts(parts, observations) if parts else {"observations": observations}


def _evaluated(actions: np.ndarray, action_space) -> np.ndarray:
    """The actions as gymflow's evaluation steps the env with them (agents/rollout.py): a Box's clipped."""
    return np.clip(actions, action_space.low, action_space.high).astype(actions.dtype) \
        if hasattr(action_space, "low") else actions


def _network_of_varied_actions(experiment, observations: np.ndarray) -> tuple[torch.nn.Module, np.ndarray]:
    """The first of a few seeded weight draws whose greedy actions on the observations are not all one
    action (a constant policy would pass any comparison), with those actions."""
    algorithm, config = experiment.algorithm, experiment.preset.agent
    for seed in range(10):
        torch.manual_seed(seed)
        network = _trained_like(algorithm.network(config, experiment.observation_space, experiment.action_space))
        expected, _ = algorithm.policy(network, config, 0.0, 0).act(observations, explore=False)
        if expected.dtype != np.int64 or len(np.unique(expected)) > 1:
            return network, _evaluated(expected, experiment.action_space)
    raise AssertionError("no weights of ten seeds reach more than one action on these observations")


@pytest.mark.parametrize(("preset", "overrides"), FAMILIES, ids=[preset for preset, _ in FAMILIES])
def test_the_onnx_graph_acts_as_the_policy_on_a_thousand_observations(preset, overrides):
    experiment = resolve_experiment(preset, overrides)
    algorithm, config = experiment.algorithm, experiment.preset.agent
    observations = _observations(experiment.observation_space)
    network, expected = _network_of_varied_actions(experiment, observations)
    graph = onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space,
                        save(network.state_dict()))
    session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
    (actions,) = session.run(["actions"], _feeds(experiment.observation_space, observations))
    assert actions.dtype == expected.dtype and actions.shape == expected.shape
    if actions.dtype == np.int64:
        np.testing.assert_array_equal(actions, expected)
    else:
        assert np.abs(actions - expected).max() <= 1e-5


def test_exports_in_threads_at_once_each_give_the_graph_one_export_gives():
    """A sweep's runs deliver in Prefect's task threads; torch.onnx keeps its exporter's state in globals,
    and of two exports at once one failed ("GLOBALS.in_onnx_export must be False")."""
    experiment = resolve_experiment("cartpole-ppo", {})
    algorithm, config = experiment.algorithm, experiment.preset.agent
    torch.manual_seed(0)
    weights = save(_trained_like(algorithm.network(config, experiment.observation_space,
                                                   experiment.action_space)).state_dict())
    export = functools.partial(onnx_policy, algorithm, config, experiment.observation_space, experiment.action_space)
    alone = export(weights)
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        graphs = list(threads.map(lambda _: export(weights), range(8)))
    assert graphs == [alone] * 8


GROUPS = {"env.id": "pettingzoo:gymflow.testing.agents:Exits", "env.kwargs": {}, "agent.policies": {"guide": "guides"}}


def test_each_agent_group_s_separate_policy_is_a_graph_of_its_own_that_acts_as_it_does():
    experiment = resolve_experiment("spread-ippo", GROUPS)
    algorithm, config = experiment.algorithm, experiment.preset.agent
    observations = _observations(experiment.observation_space)
    torch.manual_seed(0)
    network = _trained_like(algorithm.network(config, experiment.observation_space, experiment.action_space))
    assert len(network.policies) == 2
    answered = {}
    for name, policy_network in network.policies.items():
        expected, _ = algorithm.policy(policy_network, config, 0.0, 0).act(observations, explore=False)
        graph = onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space,
                            save(network.state_dict()), name)
        session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
        (answered[name],) = session.run(["actions"], {"observations": observations})
        assert answered[name].dtype == expected.dtype and answered[name].shape == expected.shape
        if expected.dtype == np.int64:
            np.testing.assert_array_equal(answered[name], expected)
        else:
            assert np.abs(answered[name] - expected).max() <= 1e-5
    first, second = answered.values()
    assert not np.array_equal(first, second)  # two policies, two graphs: not one answered twice
    with pytest.raises(CannotExport, match="there is no policy 'nobody'"):
        onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space,
                    save(network.state_dict()), "nobody")


@pytest.mark.parametrize(("preset", "overrides", "says"), [
    ("spread-ippo", GROUPS, "agent groups acting with separate policies (agent.policies) are exported one graph a "
                            "policy"),
])
def test_what_cannot_be_a_graph_yet_is_said_in_one_line(preset, overrides, says):
    experiment = resolve_experiment(preset, overrides)
    algorithm, config = experiment.algorithm, experiment.preset.agent
    network = algorithm.network(config, experiment.observation_space, experiment.action_space)
    with pytest.raises(CannotExport) as refused:
        onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space, save(network.state_dict()))
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


@pytest.mark.parametrize("preset", ["cartpole-po-ppo", "pendulum-po-ppo"])
def test_a_recurrent_policy_s_graph_takes_and_gives_its_memory_as_the_policy_carries_it(preset):
    """Steps of an episode: the graph fed its own memory back gives the policy's actions and memories
    (discrete identical, continuous and memories within 1e-5), from an episode's zero memory on."""
    experiment = resolve_experiment(preset, {"agent.normalize_observations": True})
    algorithm, config = experiment.algorithm, experiment.preset.agent
    steps = _observations(experiment.observation_space).reshape(10, 100, -1)  # 10 steps of 100 envs
    for seed in range(10):
        torch.manual_seed(seed)
        network = _trained_like(algorithm.network(config, experiment.observation_space, experiment.action_space))
        policy = algorithm.policy(network, config, 0.0, 0)
        expected = [(policy.act(obs, explore=False)[0], policy.memory.copy()) for obs in steps]
        if expected[0][0].dtype != np.int64 or len(np.unique(np.concatenate([a for a, _ in expected]))) > 1:
            break
    else:
        raise AssertionError("no weights of ten seeds reach more than one action on these observations")
    graph = onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space,
                        save(network.state_dict()))
    session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
    memory = np.zeros((2, steps.shape[1], config.recurrent), np.float32)
    for obs, (actions_expected, memory_expected) in zip(steps, expected, strict=True):
        actions, memory = session.run(["actions", "next_memory"], {"observations": obs, "memory": memory})
        assert actions.dtype == actions_expected.dtype and actions.shape == actions_expected.shape
        if actions.dtype == np.int64:
            np.testing.assert_array_equal(actions, actions_expected)
        else:
            assert np.abs(actions - actions_expected).max() <= 1e-5
        assert np.abs(memory - memory_expected).max() <= 1e-5


GAUSSIANS = [("halfcheetah-ppo", {}), ("halfcheetah-ppo", {"agent.algo": "appo", "distribution.mode": "async"}),
             ("halfcheetah-ppo", {"agent.algo": "impala", "distribution.mode": "async"})]


@pytest.mark.parametrize(("preset", "overrides"), GAUSSIANS, ids=["ppo", "appo", "impala"])
def test_a_gaussian_policy_s_graph_and_pyfunc_serve_the_actions_its_evaluation_takes(preset, overrides, tmp_path):
    """The served policy is the evaluated one: with its mean pushed out of the env's bounds (the actor's
    bias at 5 against +-1), the graph used to answer 5; gymflow's evaluation clips, and now so do the
    ONNX graph and the pyfunc model."""
    import yaml

    from gymflow.tasks.tracking.policy_model import GymflowPolicy

    experiment = resolve_experiment(preset, overrides)
    algorithm, config, space = experiment.algorithm, experiment.preset.agent, experiment.action_space
    network = _trained_like(algorithm.network(config, experiment.observation_space, space))
    actor_bias = [name for name, parameter in network.named_parameters()
                  if name.endswith("bias") and parameter.shape == (space.shape[0],) and "std" not in name][-1]
    with torch.no_grad():
        network.get_parameter(actor_bias).fill_(5.0)
    observations = _observations(experiment.observation_space, 200)
    raw, _ = algorithm.policy(network, config, 0.0, 0).act(observations, explore=False)
    assert (np.abs(raw) > 1.0).any(), "the mean lies within the bounds: the check would prove nothing"
    evaluated = _evaluated(raw, space)
    graph = onnx_policy(algorithm, config, experiment.observation_space, space, save(network.state_dict()))
    session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
    (served,) = session.run(["actions"], {"observations": observations})
    assert served.min() >= space.low.min() and served.max() <= space.high.max()
    np.testing.assert_allclose(served, evaluated, atol=1e-5)
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(experiment.preset.model_dump(mode="json")))
    (tmp_path / "policy.safetensors").write_bytes(save(network.state_dict()))
    pyfunc = GymflowPolicy()
    pyfunc.load_context(types.SimpleNamespace(artifacts={"preset": str(tmp_path / "preset.yaml"),
                                                         "policy": str(tmp_path / "policy.safetensors")}))
    np.testing.assert_array_equal(pyfunc.predict(None, observations), evaluated)
