"""The minibatch update replayed as a CUDA graph (agents/graphed.py) learns what the eager one does.

The graphed tests need a CUDA device (benchmarks/gpu_session.sh runs them on the lent GPU
machine); the eager path is every other test's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from gymflow.agents.algorithms import ALGORITHMS
from gymflow.agents.graphed import MinibatchUpdate
from gymflow.tasks.storage.codec import decode_state, encode_state
from gymflow.testing.rollouts import random_rollout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PIXELS = spaces.Box(0, 255, (4, 84, 84), np.uint8)
VECTOR = spaces.Box(-np.inf, np.inf, (5,), np.float32)
DISCRETE, BOX = spaces.Discrete(4), spaces.Box(-1, 1, (2,), np.float32)
# each learner's settings: minibatches of 64 over 3 x 48 = 144 steps leave a last one of 16 (eager, seen once an epoch)
CASES = {
    "ppo-pixels": ("ppo", {"minibatch_size": 64, "epochs": 2, "anneal_clip_range": True, "hidden_sizes": [32]},
                   PIXELS, DISCRETE),
    "ppo-box": ("ppo", {"minibatch_size": 64, "epochs": 2, "normalize_observations": True}, VECTOR, BOX),
    "appo-pixels": ("appo", {"minibatch_size": 64, "epochs": 2, "hidden_sizes": [32]}, PIXELS, DISCRETE),
    "impala-box": ("impala", {"minibatch_size": None, "epochs": 3}, VECTOR, BOX),
}


@pytest.fixture(autouse=True)
def exact_float32_kernels():
    """Float32 convolutions and matmuls without TF32, and cuDNN's deterministic algorithms: by default
    torch lets cuDNN round convolutions through TF32 (~1e-3 relative), and a captured graph and an
    eager pass may pick different algorithms, so a CNN's numbers would differ by that much."""
    if not torch.cuda.is_available():
        yield
        return
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic,
     torch.backends.cudnn.benchmark) = saved


def _learner(case: str, graphed: bool, device: str = "cuda"):
    algo, settings, observation_space, action_space = CASES[case]
    algorithm = ALGORITHMS[algo]
    config = algorithm.config(**settings, cuda_graph=graphed)
    return algorithm.learner(config, observation_space, action_space, 3, device)


def _rollouts(case: str, count: int) -> list:
    _, _, observation_space, action_space = CASES[case]
    rng = np.random.default_rng(11)
    return [random_rollout(observation_space, action_space, 48, 3, rng) for _ in range(count)]


def _weights(learner) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu() for name, tensor in learner.network.state_dict().items()}


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_a_graphed_learner_learns_what_the_eager_one_does(case):
    graphed, eager = _learner(case, graphed=True), _learner(case, graphed=False)
    for progress, rollout in zip((0.0, 0.3, 0.6, 0.9), _rollouts(case, 4), strict=True):
        seen = graphed.learn([rollout], progress), eager.learn([rollout], progress)
        assert seen[0] == pytest.approx(seen[1], rel=1e-4, abs=1e-5)
    assert graphed.updates._captured, "no minibatch shape was captured: the graphed learner ran eager"
    for name, tensor in _weights(eager).items():
        torch.testing.assert_close(_weights(graphed)[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@needs_cuda
def test_a_state_loaded_into_a_graphed_learner_is_what_its_graphs_then_train():
    """Weights are copied in place and Adam is stepped outside the graph: a checkpoint loaded into a
    learner whose graphs are captured trains on as a fresh learner loaded with it does."""
    source, captured = _learner("ppo-pixels", graphed=True), _learner("ppo-pixels", graphed=True)
    first, second, third = _rollouts("ppo-pixels", 3)
    source.learn([first], 0.1)
    captured.learn([second], 0.1)
    captured.learn([second], 0.2)  # its graphs captured, its weights and moments elsewhere
    state = decode_state(*encode_state(source.state_dict()))
    fresh = _learner("ppo-pixels", graphed=True)
    captured.load_state_dict(state)
    fresh.load_state_dict(state)
    assert captured.learn([third], 0.5) == pytest.approx(fresh.learn([third], 0.5), rel=1e-4, abs=1e-5)
    for name, tensor in _weights(fresh).items():
        torch.testing.assert_close(_weights(captured)[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_on_a_cpu_the_update_is_eager_whatever_the_setting():
    learner = _learner("ppo-box", graphed=True, device="cpu")
    assert isinstance(learner.updates, MinibatchUpdate) and not learner.updates.graphed
    learner.learn(_rollouts("ppo-box", 1), 0.0)
    assert not learner.updates._captured
