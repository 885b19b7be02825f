"""gymflow's one-step off-policy estimators (agents/ope.py) against Open Bandit Pipeline's on the same
logged data: benchmarks/ope_accuracy.py's digits bandit (the same behaviour, targets, reward model and
logs), each log estimated by both; printed per target and estimator: the median absolute difference of
the two estimates, each side's median relative error to the truth, and how many of each side's 95%
intervals held it (OBP's bootstrap interval, 1,000 resamples; gymflow's, 2,000).

OBP 0.5.7 declares Python < 3.11 and pins old numpy, so it is kept out of gymflow's environment. A
virtual environment that sees gymflow's packages and adds OBP alone:

    .venv/bin/python -m venv /tmp/obp-venv
    .venv/bin/python -c "import site; print(f'import site; site.addsitedir({site.getsitepackages()[0]!r})')" \\
        > "$(/tmp/obp-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/gymflow.pth"
    /tmp/obp-venv/bin/pip install --no-deps --ignore-requires-python obp==0.5.7 seaborn
    /tmp/obp-venv/bin/python benchmarks/ope_vs_obp.py --datasets 20 --decisions 1000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ope_accuracy import classifiers, epsilon_greedy, logged, softmax  # noqa: E402  (the same bandit)

from gymflow.agents.ope import Decisions, Estimate, evaluate_decisions  # noqa: E402

NAMES = {"ips": "ipw", "snips": "snipw", "dm": "dm", "dr": "dr"}  # gymflow's names, OBP's estimator names


def obp_estimates(decisions: Decisions, seed: int) -> dict[str, Estimate]:
    """OBP's IPW, SNIPW, DM and DR of the same logs: each estimate and its bootstrap 95% interval."""
    from obp.ope import DirectMethod, DoublyRobust, InverseProbabilityWeighting, OffPolicyEvaluation
    from obp.ope import SelfNormalizedInverseProbabilityWeighting as SelfNormalized

    feedback = {"n_rounds": len(decisions.actions), "n_actions": decisions.target_probs.shape[1],
                "action": decisions.actions, "reward": decisions.rewards, "pscore": decisions.logged_probs,
                "position": None, "context": np.zeros((len(decisions.actions), 1))}  # the estimators here read none
    evaluation = OffPolicyEvaluation(bandit_feedback=feedback, ope_estimators=[
        InverseProbabilityWeighting(), SelfNormalized(), DirectMethod(), DoublyRobust()])
    given = {"action_dist": decisions.target_probs[:, :, None],
             "estimated_rewards_by_reg_model": decisions.rewards_model[:, :, None]}
    values = evaluation.estimate_policy_values(**given)
    intervals = evaluation.estimate_intervals(**given, alpha=0.05, n_bootstrap_samples=1_000, random_state=seed)
    return {ours: Estimate(float(values[theirs]), float(intervals[theirs]["95.0% CI (lower)"]),
                           float(intervals[theirs]["95.0% CI (upper)"]), float("nan"))
            for ours, theirs in NAMES.items()}


def compare(name: str, truth: float, pairs: list[tuple[dict[str, Estimate], dict[str, Estimate]]]) -> None:
    for estimator in NAMES:
        ours = [pair[0][estimator] for pair in pairs]
        theirs = [pair[1][estimator] for pair in pairs]
        difference = np.median([abs(a.value - b.value) for a, b in zip(ours, theirs, strict=True)])
        print(f"{name:<7} {truth:>6.3f} {estimator:<6} {difference:>12.2e} "
              f"{_error(ours, truth):>8.3f} {_covered(ours, truth):>6} {_error(theirs, truth):>8.3f} "
              f"{_covered(theirs, truth):>6}")


def _error(estimates: list[Estimate], truth: float) -> float:
    return float(np.median([abs(e.value - truth) / abs(truth) for e in estimates]))


def _covered(estimates: list[Estimate], truth: float) -> str:
    return f"{sum(e.low <= truth <= e.high for e in estimates)}/{len(estimates)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=20)
    parser.add_argument("--decisions", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        import obp
    except ImportError:
        sys.exit("Open Bandit Pipeline (obp) is not installed in this Python: see this script's docstring")
    _, labels, weak, strong, model = classifiers(args.seed)
    behaviour = epsilon_greedy(weak, 0.5)
    targets = {"better": epsilon_greedy(strong, 0.1), "alike": behaviour, "worse": softmax(-weak, 0.1)}
    correct = np.eye(weak.shape[1])[labels]
    print(f"obp {obp.__version__}; digits bandit, {args.datasets} logs of {args.decisions:,} decisions per target")
    print(f"{'target':<7} {'true':>6} {'est.':<6} {'|ours-OBP|':>12} {'ours err':>8} {'cover':>6} {'OBP err':>8} "
          f"{'cover':>6}")
    for name, target in targets.items():
        truth = float(np.mean(np.sum(target * correct, axis=1)))
        rng, pairs = np.random.default_rng(args.seed + 1), []
        for dataset in range(args.datasets):
            decisions = logged(behaviour, target, labels, model, args.decisions, rng)
            pairs.append((evaluate_decisions(decisions, seed=dataset), obp_estimates(decisions, dataset)))
        compare(name, truth, pairs)


if __name__ == "__main__":
    main()
