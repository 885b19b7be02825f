"""How close gymflow's off-policy estimators (agents/ope.py) come to the truth, and how often their 95%
intervals hold it, on two problems whose truth is known: a contextual bandit and CartPole.

    .venv/bin/python benchmarks/ope_accuracy.py                      # both, 20 datasets per target
    .venv/bin/python benchmarks/ope_accuracy.py --only cartpole --datasets 20 --episodes 200

The bandit is made from a classification dataset, as Open Bandit Pipeline's benchmarks make one
(scikit-learn's digits: a context is an image, an action a label, the reward 1 where the label is
right), where a policy's true value is exact (its expected accuracy over every context). The behaviour
is a weak classifier, epsilon-greedy at 0.5 (it logs every action's probability); the targets are
better (an accurate classifier, epsilon-greedy at 0.1), alike (the behaviour itself) and worse (a
softmax away from the weak classifier's choice). The reward model of DM and DR is a third classifier,
fitted on data apart. For each target, `--datasets` logs of `--decisions` decisions each are drawn.

CartPole-v1 (gymnasium), its episodes capped at 200 steps (`max_episode_steps`) for the logs and the
truth alike, discount 0.99. No policy is trained: a fixed hand-made linear one, push right (action 1)
where 0.1 x + 0.5 x' + 10 theta + theta' > 0, balanced all 200 episodes tried to the cap. The behaviour
is it epsilon-greedy at 0.3 (logging its probability of each action taken: 0.85 or 0.15); the targets
are better (epsilon 0.1 around it), alike (the behaviour itself) and worse (epsilon 0.3 around a weaker
policy that looks at the pole's angle alone: push right where theta > 0). Each target's true value is
its mean discounted return over `--truth-episodes` episodes it plays itself (its standard error
printed). `--datasets` logs of `--episodes` behaviour episodes are drawn, the same logs for every
target; the estimators are PDIS and WPDIS, and, with a Q of the target fitted by agents/fqe.py on one
more behaviour log apart (as large), DR, WDR and FQE's own value of the logs' first states (its
interval resamples those states, not the fit; its "ESS" is their count). FQE's Q sees the step's share
of the cap beside the state, and each episode's last step is terminal (nothing is earned past the cap,
in the truth either), so a Q exact for the capped problem exists; it runs one bootstrapped regression
per step of the cap (200), agents/fqe.py's defaults otherwise. The defaults took 5-8 minutes on a shared
2-core VM (it prints each part's seconds).

Printed, per target: each estimator's median relative error |estimate - truth| / |truth|, how many of
the datasets' 95% bootstrap intervals hold the truth, and the median effective sample size (of the
episodes' last cumulative weights for the episodic estimators). Then which peer libraries were looked
for and whether any is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from typing import NamedTuple

import numpy as np

from gymflow.agents.ope import Decisions, Episodes, Estimate, evaluate_decisions, evaluate_episodes

PEERS = {"obp": "Open Bandit Pipeline (obp)", "scope_rl": "SCOPE-RL (scope-rl)", "d3rlpy": "d3rlpy"}


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


def header() -> None:
    print(f"{'target':<7} {'true':>6} {'estimator':<6} {'median rel. error':>18} {'covered':>8} {'median ESS':>11}")


def report(name: str, truth: float, results: dict[str, list[Estimate]]) -> None:
    """One line per estimator: its median relative error, how many intervals held the truth, median ESS."""
    for estimator, estimates in results.items():
        errors = [abs(e.value - truth) / abs(truth) for e in estimates]
        covered = sum(e.low <= truth <= e.high for e in estimates)
        print(f"{name:<7} {truth:>6.3f} {estimator:<6} {np.median(errors):>18.3f} {covered:>5}/{len(estimates)} "
              f"{np.median([e.effective_sample_size for e in estimates]):>11.1f}")


def bandit(args: argparse.Namespace) -> None:
    _, labels, weak, strong, model = classifiers(args.seed)
    behaviour = epsilon_greedy(weak, 0.5)
    targets = {"better": epsilon_greedy(strong, 0.1), "alike": behaviour, "worse": softmax(-weak, 0.1)}
    correct = np.eye(weak.shape[1])[labels]
    print(f"bandit: digits, {len(labels)} contexts, 10 actions; {args.datasets} logs of {args.decisions:,} "
          f"decisions per target; behaviour's value {float(np.mean(np.sum(behaviour * correct, axis=1))):.3f}")
    header()
    for name, target in targets.items():
        truth = float(np.mean(np.sum(target * correct, axis=1)))
        rng, results = np.random.default_rng(args.seed + 1), {}
        for dataset in range(args.datasets):
            estimates = evaluate_decisions(logged(behaviour, target, labels, model, args.decisions, rng), seed=dataset)
            for estimator, estimate in estimates.items():
                results.setdefault(estimator, []).append(estimate)
        report(name, truth, results)


# CartPole

GAMMA = 0.99
CAP = 200  # steps an episode may last, in the logs and the truth alike
BALANCING = np.array([0.1, 0.5, 10.0, 1.0])  # push right (action 1) where obs @ these > 0: balances to the cap
ANGLE_ONLY = np.array([0.0, 0.0, 1.0, 0.0])  # the weaker policy: push right where the pole leans right


class Linear(NamedTuple):
    """Epsilon-greedy around a linear rule: the greedy action is 1 where obs @ coefficients > 0."""

    coefficients: np.ndarray
    epsilon: float

    def probs(self, obs: np.ndarray) -> np.ndarray:
        """[..., 2] each action's probability at each observation [..., 4]."""
        greedy = (obs @ self.coefficients > 0).astype(np.int64)
        return np.where(np.arange(2) == greedy[..., None], 1 - self.epsilon / 2, self.epsilon / 2)


class Logs(NamedTuple):
    """E episodes padded to the cap: obs [E, CAP + 1, 4] (the state after the last decision at its
    end), the rest [E, CAP]."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    probs: np.ndarray  # the behaviour's probability of the action it took
    mask: np.ndarray


def play(policy: Linear, episodes: int, seed: int) -> Logs:
    """`episodes` episodes of CartPole-v1 (capped at CAP steps) played by `policy`, seeded."""
    import gymnasium as gym

    env, rng = gym.make("CartPole-v1", max_episode_steps=CAP), np.random.default_rng(seed)
    obs, actions, rewards, probs = (np.zeros((episodes, CAP + 1, 4)), np.zeros((episodes, CAP), np.int64),
                                    np.zeros((episodes, CAP)), np.ones((episodes, CAP)))
    mask = np.zeros((episodes, CAP), bool)
    keep = 1 - policy.epsilon / 2  # the greedy action's probability
    for episode in range(episodes):
        obs[episode, 0], _ = env.reset(seed=int(rng.integers(2**31)))
        draws = rng.random(CAP) < keep  # whether each step takes the greedy action
        for t in range(CAP):
            greedy = int(obs[episode, t] @ policy.coefficients > 0)
            action = greedy if draws[t] else 1 - greedy
            obs[episode, t + 1], rewards[episode, t], terminated, truncated, _ = env.step(action)
            actions[episode, t], probs[episode, t], mask[episode, t] = action, keep if draws[t] else 1 - keep, True
            if terminated or truncated:
                break
    env.close()
    return Logs(obs, actions, rewards, probs, mask)


def discounted_returns(logs: Logs) -> np.ndarray:
    return np.sum(GAMMA ** np.arange(CAP) * logs.rewards * logs.mask, axis=1)


def features(obs: np.ndarray) -> np.ndarray:
    """[E, T, 5] each state with its step's share of the cap: the capped problem's Q depends on both."""
    steps = np.broadcast_to(np.arange(obs.shape[1])[None, :, None] / CAP, obs.shape[:2] + (1,))
    return np.concatenate([obs, steps], axis=-1)


def transitions(logs: Logs, target: Linear):
    """agents/fqe.py's transitions of the logs for `target`: every logged step, each episode's last one
    terminal (the pole fell or the cap came: nothing is earned after either)."""
    from gymflow.agents.fqe import LoggedTransitions

    inputs, mask = features(logs.obs), logs.mask
    last = mask & ~np.concatenate([mask[:, 1:], np.zeros((len(mask), 1), bool)], axis=1)
    return LoggedTransitions(inputs[:, :-1][mask], logs.actions[mask], logs.rewards[mask], inputs[:, 1:][mask],
                             last[mask], target.probs(logs.obs[:, 1:])[mask])


def fitted_target_q(logs: Logs, target: Linear, seed: int):
    """The target's Q fitted by agents/fqe.py to the logs: one bootstrapped regression per step of the
    cap (its other options the module's defaults), so the values reach from the cap to the start."""
    from gymflow.agents.fqe import FQEOptions, fitted_q

    return fitted_q(transitions(logs, target), FQEOptions(gamma=GAMMA, iterations=CAP, seed=seed))


def episodes_for(logs: Logs, target: Linear, network) -> Episodes:
    """The logs as agents/ope.py's Episodes for `target`, with its fitted Q at each logged decision."""
    from gymflow.agents.fqe import q_values

    rows, steps = np.indices(logs.actions.shape)
    target_probs = target.probs(logs.obs[:, :-1])
    q = q_values(network, features(logs.obs)[:, :-1].reshape(-1, 5)).reshape(target_probs.shape)
    return Episodes(logs.rewards, logs.probs, np.where(logs.mask, target_probs[rows, steps, logs.actions], 1.0),
                    logs.mask, q[rows, steps, logs.actions], np.sum(q * target_probs, axis=-1))


def cartpole(args: argparse.Namespace) -> None:
    from gymflow.agents.fqe import fqe_estimate

    behaviour = Linear(BALANCING, 0.3)
    targets = {"better": Linear(BALANCING, 0.1), "alike": behaviour, "worse": Linear(ANGLE_ONLY, 0.3)}
    datasets = [play(behaviour, args.episodes, seed=args.seed + 100 + dataset) for dataset in range(args.datasets)]
    apart = play(behaviour, args.episodes, seed=args.seed + 99)  # FQE's
    lengths = np.concatenate([logs.mask.sum(axis=1) for logs in datasets])
    print(f"cartpole: CartPole-v1 capped at {CAP} steps, discount {GAMMA}; {args.datasets} logs of {args.episodes:,} "
          f"behaviour episodes (mean length {lengths.mean():.1f}, {np.mean(lengths == CAP):.0%} to the cap); "
          f"behaviour's mean discounted return in them {np.mean([discounted_returns(d) for d in datasets]):.3f}; "
          f"truth over {args.truth_episodes:,} episodes of each target")
    header()
    for name, target in targets.items():
        returns = discounted_returns(play(target, args.truth_episodes, seed=args.seed + 7))
        network, results = fitted_target_q(apart, target, args.seed), {}
        for dataset, logs in enumerate(datasets):
            episodes = episodes_for(logs, target, network)
            estimates = evaluate_episodes(episodes, GAMMA, seed=dataset)
            estimates["fqe"] = fqe_estimate(network, features(logs.obs)[:, 0], target.probs(logs.obs[:, 0]), dataset)
            for estimator, estimate in estimates.items():
                results.setdefault(estimator, []).append(estimate)
        report(name, float(returns.mean()), results)
        print(f"{'':<7} (truth's standard error {returns.std() / np.sqrt(len(returns)):.3f})")


def peers() -> str:
    """One line: which peer OPE libraries were looked for, and whether any is installed here."""
    installed = [label for module, label in PEERS.items() if importlib.util.find_spec(module) is not None]
    looked = ", ".join(PEERS.values())
    if not installed:
        return f"peer: looked for {looked}; none is installed here (none was pip-installed for this run): not compared"
    return f"peer: {', '.join(installed)} installed, but no comparison with it is written here yet: not compared"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("bandit", "cartpole"), help="one problem (default: both)")
    parser.add_argument("--datasets", type=int, default=20, help="logged datasets per target")
    parser.add_argument("--decisions", type=int, default=1_000, help="decisions in each bandit log")
    parser.add_argument("--episodes", type=int, default=200, help="behaviour episodes in each CartPole log")
    parser.add_argument("--truth-episodes", type=int, default=5_000, help="episodes each CartPole target plays")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores")
    for problem, run in (("bandit", bandit), ("cartpole", cartpole)):
        if args.only in (None, problem):
            started = time.perf_counter()
            run(args)
            print(f"({problem}: {time.perf_counter() - started:.0f} s)")
    print(peers())


if __name__ == "__main__":
    main()
