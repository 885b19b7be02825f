"""What each algorithm's settings are: pydantic models and nothing heavier, so that presets,
the command line and the flows can read and check them without importing torch.

The networks, losses and learners that use them live in agents/ppo.py, appo.py, impala.py, dqn.py, sac.py,
td3.py, bc.py and iql.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

SHARED_POLICY = "shared"  # the policy of an agent group that PPOConfig.policies does not name
LayerWidths = list[Annotated[int, Field(ge=1, le=65_536)]]  # the hidden layers of an MLP, input to output


class ObservationNormalization(BaseModel):
    """Observation normalisation options, shared by every agent."""

    normalize_observations: bool = Field(
        default=False, description="Scale observations by their running mean and variance, updated by the learner; "
        "the statistics travel with each policy version."
    )
    observation_clip: float = Field(default=10.0, gt=0, description="Clip normalised observations to +-this.")


class ReplayOptions(BaseModel):
    """Replay settings shared by the off-policy agents."""

    replay: Literal["uniform", "prioritized"] = Field(
        default="uniform", description="uniform sampling, or prioritized by |TD error| (proportional)."
    )
    priority_alpha: float = Field(
        default=0.6, ge=0, le=1, description="Prioritized: how strongly priorities shape sampling."
    )
    priority_beta_start: float = Field(
        default=0.4, ge=0, le=1, description="Prioritized: importance-weight exponent at the start, annealed to 1."
    )
    priority_epsilon: float = Field(
        default=1e-6, gt=0, description="Prioritized: added to |TD error| so no priority is 0."
    )


class PPOConfig(ObservationNormalization):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["ppo"] = "ppo"
    lr: float = Field(default=3e-4, gt=0, le=1, description="Adam learning rate.")
    anneal_lr: bool = Field(default=True, description="Decay the learning rate linearly to 0.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    gae_lambda: float = Field(default=0.95, ge=0, le=1, description="GAE lambda.")
    clip_range: float = Field(default=0.2, gt=0, le=1, description="Surrogate clipping epsilon.")
    anneal_clip_range: bool = Field(
        default=False, description="Decay the clipping epsilon linearly to 0 over the run, as the learning rate."
    )
    epochs: int = Field(default=10, ge=1, le=1000, description="Passes over each iteration's batch.")
    minibatch_size: int = Field(default=256, ge=1, description="Samples per gradient step.")
    value_coef: float = Field(default=0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(default=0.0, ge=0, description="Weight of the entropy bonus.")
    max_grad_norm: float = Field(default=0.5, gt=0, description="Gradient clipping norm.")
    cuda_graph: bool = Field(
        default=True, description="With the learner on a GPU: each minibatch update's loss, gradients and clipping "
        "captured once as a CUDA graph and replayed (one launch instead of ~170 a minibatch). false: eager."
    )
    normalize_advantages: bool = Field(default=True, description="Normalise per minibatch.")
    recompute_advantages: bool = Field(
        default=False, description="Compute the advantages and value targets again before each epoch after the "
        "first, with the critic as the epochs left it (Tianshou's recompute_adv). false: once an iteration."
    )
    hidden_sizes: LayerWidths = Field(default=[64, 64], min_length=1, description="MLP widths.")
    activation: Literal["tanh", "relu"] = Field(default="tanh", description="Hidden-layer activation.")
    log_std_init: float = Field(
        default=0.0, ge=-20, le=2, description="Box actions: the initial log standard deviation (state-independent)."
    )
    normalize_rewards: bool = Field(
        default=False, description="Divide rewards by the running std of the discounted return (learner only)."
    )
    reward_clip: float = Field(
        default=10.0, gt=0, description="Clip normalised rewards to +-this (with normalize_rewards)."
    )
    recurrent: int | None = Field(
        default=None, ge=1, le=4096,
        description="A memory: an LSTM of this many units between the MLP encoder and the heads, carried along "
        "each env's episode (partially observed envs; vector observations). None: feed-forward.",
    )
    policies: dict[str, str] = Field(
        default_factory=dict,
        description="PettingZoo envs: the policy each agent group acts with, by name. Groups given the same name "
        "share one; a group not named acts with 'shared'. {} (the default): one policy for every agent, told "
        "each agent's index (parameter sharing); {adversary: adversaries, agent: runners}: two.",
    )

    def policy_of_each(self, groups: Sequence[str]) -> tuple[str, ...]:
        """The policy each agent acts with, from its group (`policies`; 'shared' where not named)."""
        return tuple(self.policies.get(group, SHARED_POLICY) for group in groups)


class VTraceOptions(ObservationNormalization):
    """What APPO and IMPALA share: an actor-critic learning while its workers act with older
    versions, its targets corrected for that lag by V-trace (Espeholt et al. 2018)."""

    lr: float = Field(default=3e-4, gt=0, le=1, description="Adam learning rate.")
    anneal_lr: bool = Field(default=False, description="Decay the learning rate linearly to 0.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    vtrace_rho_bar: float = Field(
        default=1.0, gt=0, le=1000, description="V-trace: importance weights of the value targets and the policy "
        "gradient are truncated at this (rho-bar; 1 in the paper). Larger: less bias, more variance."
    )
    vtrace_c_bar: float = Field(
        default=1.0, gt=0, le=1000, description="V-trace: the trace-cutting weights are truncated at this (c-bar; "
        "1 in the paper, <= vtrace_rho_bar): how far back a step's error reaches."
    )
    vtrace_lambda: float = Field(
        default=1.0, ge=0, le=1, description="V-trace: lambda, mixing the traces as GAE's does (1 in the paper)."
    )
    epochs: int = Field(default=1, ge=1, le=1000, description="Passes over each batch as it lands.")
    minibatch_size: int | None = Field(
        default=None, ge=1, description="Samples per gradient step; None: the whole batch in one step."
    )
    value_coef: float = Field(default=0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(default=0.01, ge=0, description="Weight of the entropy bonus.")
    max_grad_norm: float = Field(default=0.5, gt=0, description="Gradient clipping norm.")
    cuda_graph: bool = Field(
        default=True, description="With the learner on a GPU: each minibatch update's loss, gradients and clipping "
        "captured once as a CUDA graph and replayed (one launch instead of ~170 a minibatch). false: eager."
    )
    hidden_sizes: LayerWidths = Field(default=[64, 64], min_length=1, description="MLP widths.")
    activation: Literal["tanh", "relu"] = Field(default="tanh", description="Hidden-layer activation.")
    log_std_init: float = Field(
        default=0.0, ge=-20, le=2, description="Box actions: the initial log standard deviation (state-independent)."
    )
    normalize_rewards: bool = Field(
        default=False, description="Divide rewards by the running std of the discounted return (learner only), "
        "per worker's envs."
    )
    reward_clip: float = Field(
        default=10.0, gt=0, description="Clip normalised rewards to +-this (with normalize_rewards)."
    )


class APPOConfig(VTraceOptions):
    """Asynchronous PPO (Sample Factory, RLlib): PPO's clipped surrogate on V-trace targets,
    learned from batches as the workers' chunks land (distribution.mode async)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["appo"] = "appo"
    # the surrogate's ratio is against the proximal policy (agents/appo.py): 1 on a batch's first update,
    # so the clip acts only from its second (IMPALA's one pass is IMPALAConfig's default)
    epochs: int = Field(default=4, ge=1, le=1000, description="Passes over each batch as it lands; the clip "
                        "acts from the second update of a batch on (the first's ratio is 1).")
    clip_range: float = Field(default=0.2, gt=0, le=1, description="Surrogate clipping epsilon, on the ratio of "
                              "the learning policy to the proximal one (the learner's as the batch landed, not the "
                              "acting version: V-trace corrects for that lag).")
    normalize_advantages: bool = Field(default=True, description="Normalise per minibatch.")


class IMPALAConfig(VTraceOptions):
    """IMPALA's V-trace actor-critic (Espeholt et al. 2018): the policy gradient weighted by the
    truncated importance weights, the critic regressed on the V-trace targets."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["impala"] = "impala"


class DQNConfig(ReplayOptions, ObservationNormalization):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["dqn"] = "dqn"
    lr: float = Field(default=1e-3, gt=0, le=1, description="Adam learning rate.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    batch_size: int = Field(default=64, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(default=100_000, ge=1, description="Replay memory size.")
    train_steps_per_iteration: int = Field(
        default=128, ge=1, description="Gradient steps after each iteration's rollouts (TrainingSteps)."
    )
    target_update_every_train_steps: int = Field(
        default=128, ge=1, description="Copy the online network to the target every this many gradient steps."
    )
    epsilon_start: float = Field(default=1.0, ge=0, le=1, description="Exploration at step 0.")
    epsilon_end: float = Field(default=0.05, ge=0, le=1, description="Exploration after the decay.")
    epsilon_decay_env_steps: int = Field(
        default=10_000, ge=1, description="Environment steps over which epsilon decays linearly."
    )
    max_grad_norm: float = Field(default=10.0, gt=0, description="Gradient clipping norm.")
    hidden_sizes: LayerWidths = Field(default=[256, 256], min_length=1, description="MLP widths.")
    double_q: bool = Field(
        default=False, description="Double Q-learning: the online network picks the next action, the target values it."
    )
    dueling: bool = Field(default=False, description="Dueling heads: Q = V + A - mean(A).")
    n_step: int = Field(default=1, ge=1, le=100, description="Bootstrap after this many rewards (n-step returns).")
    cql_alpha: float = Field(
        default=0.0, ge=0, le=1000, description="Conservative Q-learning (Kumar et al. 2020), for learning from a "
        "dataset: adds cql_alpha x (logsumexp over actions of Q(s, .) - Q(s, a)) to the loss, pushing down the "
        "values of actions the data does not take. 0: off."
    )


def epsilon_at(config: DQNConfig, env_steps: int) -> float:
    fraction = min(env_steps / config.epsilon_decay_env_steps, 1.0)
    return config.epsilon_start + fraction * (config.epsilon_end - config.epsilon_start)


class SACConfig(ReplayOptions, ObservationNormalization):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["sac"] = "sac"
    lr: float = Field(default=3e-4, gt=0, le=1, description="Adam learning rate of actor, critics and temperature.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    tau: float = Field(
        default=0.005, gt=0, le=1, description="Polyak step of the target critics after each gradient step."
    )
    batch_size: int = Field(default=256, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(default=1_000_000, ge=1, description="Replay memory size.")
    train_steps_per_iteration: int = Field(
        default=64, ge=1, description="Gradient steps after each iteration's rollouts (TrainingSteps)."
    )
    entropy_coef: float | None = Field(
        default=None, gt=0, description="A fixed entropy coefficient; None learns it towards the target entropy."
    )
    target_entropy: float | None = Field(default=None, description="None: -(number of action dimensions).")
    hidden_sizes: LayerWidths = Field(
        default=[256, 256], min_length=1, description="MLP widths of actor and critics."
    )


class TD3Config(ReplayOptions, ObservationNormalization):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["td3"] = "td3"
    lr: float = Field(default=1e-3, gt=0, le=1, description="Adam learning rate of actor and critics.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    tau: float = Field(default=0.005, gt=0, le=1, description="Polyak step of the target networks at each update.")
    batch_size: int = Field(default=256, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(default=1_000_000, ge=1, description="Replay memory size.")
    train_steps_per_iteration: int = Field(
        default=64, ge=1, description="Critic gradient steps after each iteration's rollouts (TrainingSteps)."
    )
    exploration_noise: float = Field(
        default=0.1, ge=0, le=10, description="Std of the Gaussian noise added to actions while collecting, "
        "as a fraction of each action's half-range."
    )
    policy_delay: int = Field(default=2, ge=1, le=1000, description="Critic steps per actor and target update.")
    target_noise: float = Field(default=0.2, ge=0, le=10, description="Std of the target policy smoothing noise.")
    target_noise_clip: float = Field(default=0.5, ge=0, le=10, description="The smoothing noise is clipped to +-this.")
    hidden_sizes: LayerWidths = Field(default=[400, 300], min_length=1, description="MLP widths of actor and critics.")


class BCConfig(ObservationNormalization):
    """Behaviour cloning: learns offline only, from a dataset's actions (presets' `dataset`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["bc"] = "bc"
    lr: float = Field(default=1e-3, gt=0, le=1, description="Adam learning rate.")
    batch_size: int = Field(default=256, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(
        default=1_000_000, ge=1, description="Transitions held in memory: the dataset's, which must fit."
    )
    train_steps_per_iteration: int = Field(
        default=500, ge=1, description="Gradient steps between two committed versions (TrainingSteps)."
    )
    hidden_sizes: LayerWidths = Field(default=[256, 256], min_length=1, description="MLP widths.")


class IQLConfig(ObservationNormalization):
    """Implicit Q-learning (Kostrikov et al. 2021): offline from a dataset, and on from there online."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["iql"] = "iql"
    lr: float = Field(default=3e-4, gt=0, le=1, description="Adam learning rate of actor, critics and value.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    tau: float = Field(default=0.005, gt=0, le=1, description="Polyak step of the target critics at each update.")
    batch_size: int = Field(default=256, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(default=2_000_000, ge=1, description="Replay memory size: the dataset must fit.")
    train_steps_per_iteration: int = Field(
        default=1000, ge=1, description="Gradient steps per iteration: between two committed versions offline "
        "(TrainingSteps)."
    )
    expectile: float = Field(
        default=0.7, gt=0, lt=1, description="The value's expectile of Q over the dataset's actions (0.5: the mean; "
        "towards 1: the best action the data shows)."
    )
    temperature: float = Field(
        default=3.0, ge=0, le=1000, description="Inverse temperature of advantage-weighted policy extraction "
        "(0: behaviour cloning)."
    )
    max_weight: float = Field(default=100.0, gt=0, description="Advantage weights exp(temperature x A) are clipped "
                              "to this.")
    hidden_sizes: LayerWidths = Field(default=[256, 256], min_length=1, description="MLP widths of every network.")
