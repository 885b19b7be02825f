"""The trained policy as an MLflow model (pyfunc, "models from code": loading it runs this file
and reads safetensors and YAML; nothing is unpickled).

    import mlflow
    policy = mlflow.pyfunc.load_model("models:/gymflow-cartpole-ppo@champion")  # or models:/<model id>
    actions = policy.predict(observations)      # [N, obs_dim] float32 -> [N] greedy actions

A Dict observation's policy takes its parts by name, each a batch: `policy.predict({"view": views,
"clock": clocks})`.

A recurrent policy (agent.recurrent) keeps no state between calls: its memory goes in and comes
out, named, and the caller carries it, zeroing an env's rows where its episode ends:

    memory = np.zeros((2, N, policy.metadata.get_input_schema().inputs[1].shape[-1]), np.float32)
    out = policy.predict({"observations": observations, "memory": memory})
    actions, memory = out["actions"], out["memory"]

Where it serves, a deployment may set exploration and log every decision (tasks/lake/serving_log.py:
GYMFLOW_EXPLORATION, GYMFLOW_DECISION_LOG); with a log it answers `{"actions": ..., "request_ids": ...}`.
"""

from __future__ import annotations

import mlflow
import numpy as np
import yaml
from mlflow.pyfunc import PythonModel
from safetensors.torch import load_file


class GymflowPolicy(PythonModel):
    """Greedy actions of a gymflow policy for a batch of observations."""

    def load_context(self, context) -> None:
        from gymflow.agents.algorithms import algorithm_of
        from gymflow.envs.make import env_spaces
        from gymflow.envs.parts import observation_parts
        from gymflow.presets.load import validate_preset_data
        from gymflow.tasks.lake.serving_log import serving_settings

        with open(context.artifacts["preset"]) as handle:
            preset = validate_preset_data(yaml.safe_load(handle))
        algorithm = algorithm_of(preset.agent)
        observation_space, action_space = env_spaces(preset.env.id, preset.env.kwargs,
                                                     preset.env.preprocessing().evaluation())
        network = algorithm.network(preset.agent, observation_space, action_space)
        self.observation_shape = observation_space.shape
        self.parts = observation_parts(observation_space)
        # as gymflow keeps them: images as uint8, vectors as float32
        self.observation_dtype = np.uint8 if observation_space.dtype == np.uint8 else np.float32
        network.load_state_dict(load_file(context.artifacts["policy"]))
        if "policy_name" in context.artifacts:  # one of an agent group's separate policies (agent.policies)
            with open(context.artifacts["policy_name"]) as handle:
                network = network.policies[handle.read()]
        network.eval()
        self.policy = algorithm.policy(network, preset.agent, 0.0, 0)
        # a Box's actions as gymflow's evaluation steps the env with them: clipped to its bounds (a
        # Gaussian's mean may lie outside)
        self.bounds = (action_space.low, action_space.high) if hasattr(action_space, "low") else None
        settings = serving_settings(getattr(context, "model_config", None))
        self.recorder = None
        if settings.decision_log or settings.exploration.kind != "greedy":
            if getattr(preset.agent, "recurrent", None):
                from gymflow.errors import GymflowError

                raise GymflowError(settings.exploration_field, "a recurrent policy serves greedily and logs "
                                                               "no decisions (its memory would be logged with each)")
            self.recorder = _recorder(settings, context, preset, action_space)

    def _served(self, actions: np.ndarray) -> np.ndarray:
        return actions if self.bounds is None else np.clip(actions, *self.bounds).astype(actions.dtype, copy=False)

    # model_input: a recurrent policy's is a dict of arrays; np.ndarray is the hint MLflow infers no
    # schema from (the logged signature describes the input)
    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        if isinstance(model_input, dict) and self.parts:  # a Dict observation's parts
            from gymflow.envs.parts import flatten_parts

            observations = flatten_parts(self.parts, model_input)
            actions, _ = self.policy.act(observations, explore=False)
            return self._decided(observations, actions)
        if isinstance(model_input, dict):  # a recurrent policy's observations and memory
            return self._predict_with_memory(model_input)
        obs = np.asarray(model_input, dtype=self.observation_dtype)
        obs = obs if obs.ndim == len(self.observation_shape) + 1 else obs[None]
        actions, _ = self.policy.act(obs, explore=False)
        return self._decided(obs, actions)

    def _decided(self, observations: np.ndarray, greedy: np.ndarray) -> np.ndarray | dict:
        """The greedy actions, or what the deployment's exploration serves instead, with the request ids
        of their logged decisions."""
        if self.recorder is None:
            return self._served(greedy)
        actions, request_ids = self.recorder.act(observations, greedy)
        return actions if request_ids is None else {"actions": actions, "request_ids": request_ids}

    def _predict_with_memory(self, model_input: dict) -> dict:
        obs = np.asarray(model_input["observations"], dtype=self.observation_dtype)
        self.policy.memory = np.array(model_input["memory"], dtype=np.float32)  # this call's, not the last one's
        actions, _ = self.policy.act(obs, explore=False)
        return {"actions": self._served(actions), "memory": self.policy.memory}


def _recorder(settings, context, preset, action_space):
    from gymflow.tasks.lake.serving_log import DecisionRecorder

    label = preset.name
    if "label" in context.artifacts:  # the preset's name and the policy's version: cartpole-ppo-v12
        with open(context.artifacts["label"]) as handle:
            label = handle.read().strip()
    return DecisionRecorder(settings, label, action_space)


mlflow.models.set_model(GymflowPolicy())
