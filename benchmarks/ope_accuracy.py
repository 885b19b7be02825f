"""How close gymflow's off-policy estimators (agents/ope.py) come to the truth, and how often their 95%
intervals hold it: a contextual bandit made from a classification dataset, as Open Bandit Pipeline's
benchmarks make one (scikit-learn's digits: a context is an image, an action a label, the reward 1
where the label is right), where a policy's true value is exact (its expected accuracy over every
context).

    .venv/bin/python benchmarks/ope_accuracy.py --datasets 20 --decisions 1000

The behaviour is a weak classifier, epsilon-greedy at 0.5 (it logs every action's probability); the
targets are better (an accurate classifier, epsilon-greedy at 0.1), alike (the behaviour itself) and
worse (a softmax away from the weak classifier's choice). The reward model of DM and DR is a third
classifier, fitted on data apart. For each target, `--datasets` logs of `--decisions` decisions each
are drawn; printed: each estimator's median relative error and how many intervals covered the truth.
"""

from __future__ import annotations

import argparse
import os
import platform

import numpy as np

from gymflow.agents.ope import Decisions, evaluate_decisions


def classifiers(seed: int):
    """Contexts (held out from the training), their labels, and three policies' scores over the labels:
    a weak one (the behaviour's), an accurate one, and the reward model's."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    features, labels = load_digits(return_X_y=True)
    features = features / 16.0
    rest, contexts, rest_labels, context_labels = train_test_split(features, labels, test_size=0.5, random_state=seed)
    weak_x, strong_x, weak_y, strong_y = train_test_split(rest, rest_labels, test_size=0.5, random_state=seed)
    weak = LogisticRegression(max_iter=500, C=0.1).fit(weak_x[:60], weak_y[:60])
    strong = LogisticRegression(max_iter=2_000).fit(strong_x, strong_y)
    model = LogisticRegression(max_iter=2_000, C=0.05).fit(weak_x, weak_y)
    return contexts, context_labels, weak.predict_proba(contexts), strong.predict_proba(contexts), \
        model.predict_proba(contexts)


def epsilon_greedy(scores: np.ndarray, epsilon: float) -> np.ndarray:
    probs = np.full(scores.shape, epsilon / scores.shape[1])
    probs[np.arange(len(scores)), scores.argmax(axis=1)] += 1 - epsilon
    return probs


def softmax(scores: np.ndarray, temperature: float) -> np.ndarray:
    exp = np.exp((scores - scores.max(axis=1, keepdims=True)) / temperature)
    return exp / exp.sum(axis=1, keepdims=True)


def logged(behaviour: np.ndarray, target: np.ndarray, labels: np.ndarray, model: np.ndarray, decisions: int,
           rng: np.random.Generator) -> Decisions:
    rows = rng.integers(0, len(labels), decisions)
    probs = behaviour[rows]
    actions = (probs.cumsum(axis=1) > rng.random((decisions, 1))).argmax(axis=1)
    rewards = (actions == labels[rows]).astype(np.float64)
    return Decisions(actions, rewards, probs[np.arange(decisions), actions], target[rows], model[rows], probs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", type=int, default=20)
    parser.add_argument("--decisions", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    _, labels, weak, strong, model = classifiers(args.seed)
    behaviour = epsilon_greedy(weak, 0.5)
    targets = {"better": epsilon_greedy(strong, 0.1), "alike": behaviour, "worse": softmax(-weak, 0.1)}
    correct = np.eye(weak.shape[1])[labels]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; digits, {len(labels)} contexts, 10 actions; "
          f"behaviour's value {float(np.mean(np.sum(behaviour * correct, axis=1))):.3f}")
    print(f"{'target':<7} {'true':>6} {'estimator':<6} {'median rel. error':>18} {'covered':>8} {'median ESS':>11}")
    for name, target in targets.items():
        truth = float(np.mean(np.sum(target * correct, axis=1)))
        rng, results = np.random.default_rng(args.seed + 1), {}
        for dataset in range(args.datasets):
            estimates = evaluate_decisions(logged(behaviour, target, labels, model, args.decisions, rng), seed=dataset)
            for estimator, estimate in estimates.items():
                results.setdefault(estimator, []).append(estimate)
        for estimator, estimates in results.items():
            errors = [abs(e.value - truth) / truth for e in estimates]
            covered = sum(e.low <= truth <= e.high for e in estimates)
            print(f"{name:<7} {truth:>6.3f} {estimator:<6} {np.median(errors):>18.3f} {covered:>5}/{len(estimates)} "
                  f"{np.median([e.effective_sample_size for e in estimates]):>11.0f}")
    print("peer: Open Bandit Pipeline (obp 0.5.7, 2023) and d3rlpy are not installed here; not compared")


if __name__ == "__main__":
    main()
