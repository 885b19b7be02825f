"""benchmarks/ope_accuracy.py's CartPole part on logs whose answer is known without a model: the
behaviour's own logs (target = behaviour, every importance weight 1), where the per-decision
estimators must give the logs' mean discounted return, and FQE's transitions of them."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import ope_accuracy as bench
from gymflow.agents.ope import evaluate_episodes

BEHAVIOUR = bench.Linear(bench.BALANCING, 0.6)  # explores enough that some episodes end before the cap


@pytest.fixture(scope="module")
def logs() -> bench.Logs:
    return bench.play(BEHAVIOUR, 60, seed=3)


def test_the_logged_probabilities_are_the_behaviour_s_and_it_takes_its_greedy_action_as_often_as_they_say(logs):
    rows, steps = np.indices(logs.actions.shape)
    probs = BEHAVIOUR.probs(logs.obs[:, :-1])[rows, steps, logs.actions]
    np.testing.assert_allclose(np.where(logs.mask, probs, 1.0), logs.probs)
    greedy = (logs.obs[:, :-1] @ BEHAVIOUR.coefficients > 0)[logs.mask]
    assert np.mean(logs.actions[logs.mask] == greedy) == pytest.approx(0.7, abs=0.03)
    assert np.all(logs.rewards[logs.mask] == 1.0) and np.all(logs.rewards[~logs.mask] == 0.0)


def test_on_the_behaviour_s_own_logs_pdis_is_their_mean_discounted_return_with_every_episode_counted(logs):
    lengths = logs.mask.sum(axis=1)
    assert lengths.min() < bench.CAP  # episodes of unequal length: the case the padding must get right
    estimates = evaluate_episodes(bench.episodes_for(logs, BEHAVIOUR, _ZeroQ()), bench.GAMMA)
    mean = float(np.mean((1 - bench.GAMMA ** lengths) / (1 - bench.GAMMA)))
    assert estimates["pdis"].value == pytest.approx(mean)
    assert estimates["pdis"].low < mean < estimates["pdis"].high
    assert estimates["pdis"].effective_sample_size == pytest.approx(len(lengths))
    assert estimates["dr"].value == pytest.approx(mean)  # a Q of zeros: DR is PDIS


def test_on_the_behaviour_s_own_logs_wpdis_is_their_mean_discounted_return(logs):
    lengths = logs.mask.sum(axis=1)
    estimates = evaluate_episodes(bench.episodes_for(logs, BEHAVIOUR, _ZeroQ()), bench.GAMMA)
    assert estimates["wpdis"].value == pytest.approx(float(np.mean((1 - bench.GAMMA ** lengths) / (1 - bench.GAMMA))))


def test_fqe_s_transitions_are_every_logged_step_with_the_step_s_share_of_the_cap_and_only_each_last_terminal(logs):
    target = bench.Linear(bench.BALANCING, 0.1)
    transitions = bench.transitions(logs, target)
    lengths = logs.mask.sum(axis=1)
    assert len(transitions.actions) == lengths.sum() and transitions.terminal.sum() == len(lengths)
    assert np.all(transitions.terminal[np.cumsum(lengths) - 1])
    np.testing.assert_allclose(transitions.next_obs[:, 4] - transitions.obs[:, 4], 1 / bench.CAP)
    np.testing.assert_allclose(transitions.obs[: lengths[0], :4], logs.obs[0, : lengths[0]])
    np.testing.assert_allclose(transitions.next_target_probs.sum(axis=1), 1.0)


class _ZeroQ:
    """Stands for a fitted Q network: zero for every action."""

    def __call__(self, inputs):
        import torch

        return torch.zeros((len(inputs), 2))

    def eval(self):
        return self
