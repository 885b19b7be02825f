"""Dict observations: a Gymnasium Dict of an image part and a vector part, flattened at the env's
boundary with each part's place kept; each part read by its own encoder; PPO and DQN trained on it
end to end under a real Prefect API and Dask workers; the logged model taking the parts by name."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
import requests
import torch
from gymnasium import spaces

from gymflow.agents.configs import PPOConfig
from gymflow.agents.networks import PartsEncoder, PixelEncoder
from gymflow.agents.rollout import RandomPolicy, collect, evaluate
from gymflow.envs.make import make_env
from gymflow.envs.parts import PartsBox, flatten_parts, is_packed, lay_out, unflatten_parts
from gymflow.envs.vector import SeededVectorEnv
from gymflow.errors import InvalidPreset
from gymflow.flows.improve import improve
from gymflow.presets.validate import resolve_experiment
from tests.conftest import local_overrides
from tests.serving import served

PICTURE = "gymflow.envs.picture_corridor:PictureCorridor"
ON_PICTURES = {"env.id": PICTURE, "env.frame_stack": 1, "agent.normalize_observations": True,
               "schedule.target_return": 0.9}  # the presets' own (catch's), which another env does not keep


def test_a_dict_observation_is_one_flat_array_of_bytes_that_keeps_where_each_part_lies():
    env = make_env(PICTURE, {})
    obs, _ = env.reset(seed=3)
    raw = env.unwrapped._observe()
    clock, view = parts = env.observation_space.parts  # in key order
    assert (clock.key, clock.image, clock.start, clock.stop) == ("clock", False, 0, 4)  # a float32's four bytes
    assert (view.key, view.image, view.channels_last, view.frames_shape) == ("view", True, True, (1, 5, 9))
    assert obs.dtype == np.uint8 and obs.shape == (4 + 45,)  # the picture's pixels kept as uint8
    np.testing.assert_array_equal(obs[view.start : view.stop].reshape(view.shape), raw["view"])
    assert obs[clock.start : clock.stop].view(np.float32)[0] == raw["clock"][0]
    unflattened = unflatten_parts(parts, obs[None])
    assert unflattened["view"].dtype == np.uint8 and unflattened["clock"].dtype == np.float32
    np.testing.assert_array_equal(flatten_parts(parts, unflattened), obs[None])


def test_a_dict_of_vectors_alone_stays_a_float32_vector():
    vectors = lay_out([("a", (2,), False), ("b", (3,), False)])
    assert [(p.start, p.stop) for p in vectors] == [(0, 2), (2, 5)]
    kept = spaces.Dict({"a": spaces.Box(-1, 1, (2,), np.float32), "b": spaces.Box(0, 2, (3,), np.float32)})
    box = PartsBox(vectors, kept)
    assert box.dtype == np.float32 and list(box.low) == [-1, -1, 0, 0, 0] and list(box.high) == [1, 1, 2, 2, 2]
    packed = lay_out([("a", (2,), False), ("b", (6, 6), True)])
    assert [(p.start, p.stop) for p in packed] == [(0, 8), (8, 44)]
    assert is_packed(packed) and not is_packed(vectors)


def test_each_part_is_read_by_its_own_encoder_and_only_the_vector_entries_are_normalised():
    experiment = resolve_experiment("catch-ppo", ON_PICTURES)
    encoder = PartsEncoder(PPOConfig(normalize_observations=True), experiment.observation_space)
    (pixels,) = encoder.pixels
    assert isinstance(pixels, PixelEncoder) and encoder.features == pixels.features + 1
    env = SeededVectorEnv(PICTURE, {}, 4, seed=0)
    env.reset()
    obs = torch.from_numpy(env.obs)
    frames = encoder._frames(obs, encoder.images[0])  # channels first, as the CNN reads them
    views = np.stack([env.envs[i].unwrapped._observe()["view"] for i in range(4)])
    np.testing.assert_array_equal(frames.numpy(), views.transpose(0, 3, 1, 2))
    parts = experiment.observation_space.parts
    later = unflatten_parts(parts, env.obs)
    later["clock"] += 1
    encoder.obs_norm.observe([env.obs, flatten_parts(parts, later)])  # the clock's entries alone: 0, then 1
    assert encoder.obs_norm.mean.shape == (1,) and encoder.obs_norm.mean.item() == pytest.approx(0.5, rel=1e-3)
    torch.testing.assert_close(encoder(obs)[:, :-1], pixels(frames))  # the picture's features, then the clock


@pytest.mark.parametrize(("preset", "overrides", "says"), [
    ("cartpole-bc", {"env.id": PICTURE}, f"agent.algo: bc reads vector observations; '{PICTURE}' observes images "
                                         "among its parts (view): use ppo, dqn, sac or td3"),
    ("catch-ppo", {"env.id": PICTURE}, "env.frame_stack: 'gymflow.envs.picture_corridor:PictureCorridor' observes a Dict; "
                                       "allowed: 1"),
    ("catch-ppo", {**ON_PICTURES, "agent.recurrent": 16}, "agent.recurrent: reads vector observations (not yet "
                                                          "images); 'gymflow.envs.picture_corridor:PictureCorridor' observes "
                                                          "images among its Dict's parts"),
    ("catch-ppo", {**ON_PICTURES, "env.kwargs": {"length": 3}}, "env.id: 'gymflow.envs.picture_corridor:PictureCorridor': its "
                                                                "Dict observation's image part 'view' is (5, 3, 1); "
                                                                "allowed: images of at least 5 x 5 pixels"),
])
def test_what_a_dict_observation_cannot_take_is_refused_in_one_line(preset, overrides, says):
    with pytest.raises(InvalidPreset, match="^" + says.replace("(", r"\(").replace(")", r"\)")) as refused:
        resolve_experiment(preset, overrides)
    assert "\n" not in str(refused.value)


def test_a_policy_that_does_not_read_the_picture_wins_half_the_time():
    env = SeededVectorEnv(PICTURE, {}, 50, seed=1)
    env.reset()
    returns = evaluate(RandomPolicy(env.action_space, seed=0), env).returns
    assert returns.mean() < 0.6


@pytest.mark.e2e
@pytest.mark.parametrize(("preset", "mode"), [
    # long tier: PPO (SYNC) learns from pixels in tests/test_pixels.py; a Dict's parts by name stay in with DQN
    pytest.param("picture-corridor-ppo", "sync", marks=pytest.mark.slow),
    ("catch-dqn", "async"),
])
def test_ppo_and_dqn_learn_from_a_picture_and_a_clock_and_their_model_takes_the_parts_by_name(
        preset, mode, prefect_api, workspace):
    overrides = {**ON_PICTURES, "distribution.mode": mode, **local_overrides(workspace)}
    summary = improve(preset, overrides)
    assert summary.solved and summary.final_return >= 0.9, summary
    assert len(summary.rollout_processes) == 2
    mlflow.set_tracking_uri(local_overrides(workspace)["tracking.tracking_uri"])
    model = mlflow.pyfunc.load_model(summary.model_uri)
    assert model.metadata.get_input_schema().input_names() == ["clock", "view"]
    if mode == "async":  # the replay memory keeps the picture as its uint8 bytes (float32 would be 2 x 184 bytes)
        client = mlflow.MlflowClient()
        assert client.get_metric_history(summary.mlflow_run_id, "train/replay_bytes_per_transition")[-1].value < 2 * 49 + 32
    env = SeededVectorEnv(PICTURE, {}, 6, seed=7)
    env.reset()
    parts = [env.envs[i].unwrapped._observe() for i in range(6)]
    by_name = {key: np.stack([part[key] for part in parts]) for key in ("view", "clock")}
    goals_right = by_name["view"][:, 0, -1, 0] == 128  # the goal's column is grey
    np.testing.assert_array_equal(model.predict(by_name), goals_right.astype(np.int64))  # walk toward it
    onnx_uri = mlflow.MlflowClient().get_run(summary.mlflow_run_id).data.tags["gymflow.onnx_model"]
    graph = mlflow.pyfunc.load_model(onnx_uri)  # its ONNX graph: one input a part, by the same names
    assert graph.metadata.get_input_schema().input_names() == ["clock", "view"]
    np.testing.assert_array_equal(graph.predict(by_name)["actions"], goals_right.astype(np.int64))
    if mode == "sync":  # retraining scores a registered policy on flat observations, split back into the parts
        from gymflow.presets.model import EnvConfig
        from gymflow.tasks.tracking.models import register_challenger, score_policy

        tracking_uri = local_overrides(workspace)["tracking.tracking_uri"]
        registered = register_challenger(tracking_uri, "on-pictures", summary.mlflow_run_id, summary.model_uri)
        assert min(score_policy(tracking_uri, registered, EnvConfig(id=PICTURE), 8, 0)) > 0.9
        with served(registered.uri, tracking_uri, workspace) as invocations:  # `mlflow models serve`, over HTTP
            answer = requests.post(invocations, json={"inputs": {key: value.tolist() for key, value in by_name.items()}},
                                   timeout=30)
        assert answer.ok, answer.text
        np.testing.assert_array_equal(answer.json()["predictions"], goals_right.astype(np.int64))


CONTINUOUS = {"env.id": PICTURE, "env.kwargs": {"continuous": True}, "agent.normalize_observations": True,
              "agent.hidden_sizes": [64, 64], "agent.batch_size": 64, "agent.train_steps_per_iteration": 32,
              "agent.replay_capacity": 20000, "schedule.heatup_env_steps": 500, "schedule.rollout_steps_per_env": 32,
              "schedule.evaluate_every_env_steps": 1024, "schedule.evaluation_episodes": 20,
              "schedule.target_return": 0.9, "distribution.mode": "sync", "distribution.envs_per_worker": 2}


@pytest.mark.parametrize("preset", ["pendulum-sac", "hopper-td3"])
def test_sac_and_td3_read_each_image_part_with_a_cnn_in_their_actor_and_in_each_critic(preset):
    experiment = resolve_experiment(preset, CONTINUOUS)
    learner = experiment.algorithm.learner(experiment.preset.agent, experiment.observation_space,
                                           experiment.action_space, 0)
    readers = [learner.actor.obs_norm, learner.critic.obs_norm, learner.target_critic.obs_norm]
    assert all(isinstance(reader, PartsEncoder) and len(reader.pixels) == 1 for reader in readers)
    assert learner.normalizer is readers[0].obs_norm is readers[1].obs_norm  # one set of the clock's statistics
    env = SeededVectorEnv(PICTURE, {"continuous": True}, 2, seed=0)
    env.reset()
    rollout, _ = collect(RandomPolicy(env.action_space, seed=0), env, 300)
    metrics = learner.learn([rollout], 0.0)
    assert np.isfinite(metrics["critic_loss"]) and learner.train_steps == 32


# long tier: SAC and TD3 learning from a picture (three CNNs: 112 s at half the CPU). The default run has SAC
# learning end to end on vectors (tests/test_sac.py), TD3's learner on the continuous corridor (tests/test_td3.py)
# and each image part read by a CNN in both (the test above)
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(("preset", "changes"), [
    ("pendulum-sac", {"agent.entropy_coef": 0.01, "schedule.total_env_steps": 8000}),
    # TD3's one learning test end to end (53 s)
    ("hopper-td3", {"agent.lr": 3e-4, "schedule.total_env_steps": 16000}),
])
def test_sac_and_td3_learn_to_walk_toward_a_goal_seen_in_a_picture(preset, changes, prefect_api, workspace):
    summary = improve(preset, {**CONTINUOUS, **changes, **local_overrides(workspace)})
    assert summary.solved and summary.final_return >= 0.9, summary
    mlflow.set_tracking_uri(local_overrides(workspace)["tracking.tracking_uri"])
    model = mlflow.pyfunc.load_model(summary.model_uri)
    env = SeededVectorEnv(PICTURE, {"continuous": True}, 6, seed=7)
    env.reset()
    parts = [env.envs[i].unwrapped._observe() for i in range(6)]
    by_name = {key: np.stack([part[key] for part in parts]) for key in ("view", "clock")}
    goals_right = by_name["view"][:, 0, -1, 0] == 128
    np.testing.assert_array_equal(np.asarray(model.predict(by_name))[:, 0] > 0, goals_right)  # walk toward it
