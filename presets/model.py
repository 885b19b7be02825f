"""The preset: one validated object that defines a whole experiment.

Every field carries a description and bounds; Prefect shows them as a form and the CLI checks
them before any work starts. Derived values are properties, never fields filled in later.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gymflow.agents.configs import (
    APPOConfig,
    BCConfig,
    DQNConfig,
    IMPALAConfig,
    IQLConfig,
    PPOConfig,
    SACConfig,
    TD3Config,
)
from gymflow.envs.make import Preprocessing
from gymflow.presets.redaction import redacted_uri

STORAGE_SCHEMES = ("file", "s3", "s3a")
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "file")
_WINDOWS_DRIVE = re.compile(r"^[a-zA-Z]:[\\/]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


AgentConfig = Annotated[
    PPOConfig | APPOConfig | IMPALAConfig | DQNConfig | SACConfig | TD3Config | BCConfig | IQLConfig,
    Field(discriminator="algo"),
]


def field_models(annotation: Any) -> list[type[BaseModel]]:
    """The models a preset field's value may be: a section's (an optional one's too), the agent's
    algorithms', or none (a value, a list, a mapping such as env.kwargs)."""
    return [candidate for candidate in (annotation, *get_args(annotation))
            if isinstance(candidate, type) and issubclass(candidate, BaseModel)]


class EnvConfig(_Strict):
    id: str = Field(
        description="A registered Gymnasium id (CartPole-v1) or a 'module:Class' entry point."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the environment."
    )
    frame_stack: int = Field(
        default=1, ge=1, le=16,
        description="Observe the last k frames at once ([k, height, width]); image envs only.",
    )
    atari: bool = Field(
        default=False,
        description="Atari's standard preprocessing (no-op starts, frame skip 4 with max-pooling, 84x84 "
        "grey, FIRE at each game's start and lost life; for training only, a lost life is terminal for learning "
        "and rewards are clipped to their sign).",
    )
    hide: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list,
        description="Entries of a vector observation to leave out, by index: a partially observed env (CartPole "
        "without its velocities: [1, 3]; Pendulum without its angular velocity: [2]).",
    )

    backend: Literal["auto", "gymnasium", "envpool", "ale"] = Field(
        default="auto",
        description="What steps the rollout workers' envs: gymnasium (each env in Python, exactly replayable from "
        "its seed), envpool (EnvPool's C++ threads, a batch a call: MuJoCo's v5 tasks, ALE games with env.atari; "
        "its envs cannot be replayed, so for distribution.mode async only), ale (the ALE's C++ vector env: ALE "
        "games with env.atari, replayable from their seeds), or auto: envpool where it has the task and the run is "
        "async, ale for a sync or single run's Atari games, else gymnasium. Evaluation always plays on gymnasium.",
    )
    global_state: bool = Field(
        default=False,
        description="PettingZoo envs: each agent's row also carries the game's global state (env.state()), which "
        "only PPO's critic reads: a centralised critic, MAPPO. False: each agent's critic reads what it observes "
        "(IPPO).",
    )

    def preprocessing(self) -> Preprocessing:
        """How training envs are wrapped (`.evaluation()`: evaluation's)."""
        return Preprocessing(self.frame_stack, self.atari, hide=tuple(sorted(set(self.hide))),
                             global_state=self.global_state)


class OpponentPool(_Strict):
    """Self-play against past versions: a version is kept as a snapshot every `every` versions (v0,
    v`every`, ...); a rollout job's games face one of the newest `size` snapshots older than the
    acting version with probability `share`, else the acting version itself."""

    size: int = Field(default=5, ge=1, le=100, description="Snapshots in the pool: the newest this many.")
    every: int = Field(default=5, ge=1, description="Policy versions between two snapshots.")
    share: float = Field(default=0.5, gt=0.0, le=1.0,
                         description="The share of rollout jobs whose games face a snapshot (drawn from the seed).")

    def members(self, version: int) -> list[int]:
        """The snapshots round `version`'s games may face: the newest `size` older than `version`."""
        if version <= 0:
            return []
        newest = (version - 1) // self.every * self.every
        return list(range(max(newest - (self.size - 1) * self.every, 0), newest + 1, self.every))


class ScheduleConfig(_Strict):
    """The improve loop's schedule, each field in an explicit unit."""

    total_env_steps: int = Field(
        ge=0, description="Stop after this many environment steps of training (EnvironmentSteps). 0 with a "
        "dataset: an offline run, which collects nothing and stops after total_train_steps."
    )
    total_train_steps: int | None = Field(
        default=None, ge=0, description="Offline runs: stop after this many gradient steps (TrainingSteps). 0 in a "
        "run that collects: collect only, learning nothing (the starting policy, a warm start's, acts throughout: "
        "experience for a dataset)."
    )
    evaluate_every_train_steps: int | None = Field(
        default=None, gt=0, description="Offline runs: evaluate the greedy policy every this many gradient steps."
    )
    heatup_env_steps: int = Field(
        default=0,
        ge=0,
        description="Random-policy environment steps that fill replay before training "
        "(off-policy agents only).",
    )
    rollout_steps_per_env: int | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="Environment steps each env takes per training iteration (required unless offline).",
    )
    evaluate_every_env_steps: int | None = Field(
        default=None, gt=0,
        description="Evaluate the greedy policy every this many environment steps (required unless offline).",
    )
    evaluation_episodes: int = Field(
        default=10, gt=0, le=1000, description="Episodes averaged in each evaluation."
    )
    evaluate_on: Literal["env", "decisions"] = Field(
        default="env",
        description="env: each evaluation plays greedy episodes. decisions: an offline run on a decision log "
        "(dataset.decisions, dataset.holdout above 0) plays none: each version is scored off-policy on the held-out "
        "decisions (doubly robust; each decision's term is a return of the evaluation, their mean the estimate), "
        "and no film is made.",
    )
    evaluation_opponent: Literal["itself", "random"] = Field(
        default="itself",
        description="Two-player PettingZoo games: whom the greedy policy plays in evaluations. itself: every agent "
        "is the policy, each agent's return counted (a zero-sum game's mean is then 0). random: a uniformly random "
        "player, sides swapped every other game, each game's return the policy's score (1 a win, 0.5 a draw, 0 "
        "a loss).",
    )
    opponent_pool: OpponentPool | None = Field(
        default=None,
        description="Two-player PettingZoo games: the policy also trains against a pool of "
        "its own past versions. In a job that faces a snapshot, the policy plays one side of each game (the side "
        "alternates from game to game) and learns from that side only. None: every game is the policy against "
        "itself.",
    )
    target_return: float | None = Field(
        default=None, description="Stop early once the mean evaluation return reaches this."
    )


class AdaptiveConfig(_Strict):
    """A cluster class scaled by Dask's `cluster.adapt` between two sizes, instead of to rollout_workers."""

    minimum: int = Field(default=1, ge=1, le=1024, description="Workers kept however idle (>= 1: the run's "
                         "job hosts are actors, which Dask does not count as work to scale up for).")
    maximum: int = Field(ge=1, le=1024, description="Workers at most.")


WALLTIME = r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$"  # SLURM's [D-]HH:MM:SS
MEMORY = r"^\d+(\.\d+)?\s*([KMGT]i?B|[KMGT])$"  # 4GB, 3.5 GiB, 500MB


class SlurmConfig(_Strict):
    """Rollout workers as SLURM jobs, through dask-jobqueue's SLURMCluster (the `slurm` extra): each
    job runs `processes` Dask workers; each worker leaves `lifetime_margin_s` before its job's
    walltime, and the cluster adapts, submitting fresh jobs, so a run outlives its jobs."""

    partition: str | None = Field(default=None, min_length=1, description="The partition the jobs queue in "
                                  "(sbatch -p). None: the cluster's default partition.")
    account: str | None = Field(default=None, min_length=1, description="The account the jobs are charged to "
                                "(sbatch -A). None: the submitting user's default.")
    walltime: str = Field(default="01:00:00", pattern=WALLTIME, description="Each job's time limit as "
                          "[D-]HH:MM:SS (sbatch -t), within the partition's MaxTime.")
    cores: int = Field(default=1, ge=1, le=1024, description="CPUs each job asks for, shared by its workers "
                       "(one thread each).")
    memory: str = Field(default="2GB", pattern=MEMORY, description="Memory each job asks for (sbatch --mem), "
                        "shared by its workers: 4GB, 3.5GiB, 500MB.")
    processes: int = Field(default=1, ge=1, le=256, description="Dask worker processes each job runs; at most cores.")
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs each job asks for (sbatch --gres=gpu:N).")
    lifetime_margin_s: float = Field(default=300.0, ge=10, description="A worker leaves this many seconds before "
                                     "its job's walltime (dask worker --lifetime, with a stagger of half of it): "
                                     "its rollout is sent to another worker and a fresh job is submitted, where the "
                                     "queue would otherwise kill it mid-rollout.")
    directives: list[str] = Field(default_factory=list, description="More sbatch options for each job, e.g. "
                                  "['--qos=long', '--constraint=skylake'].")
    prologue: list[str] = Field(default_factory=list, description="Shell lines each job runs before its workers, "
                                "e.g. ['module load python/3.11', 'source ~/gymflow/.venv/bin/activate'].")
    python: str | None = Field(default=None, min_length=1, description="The Python that runs the workers on the "
                               "nodes, with gymflow installed. None: the flow's own interpreter (nodes that share "
                               "its file system).")
    interface: str | None = Field(default=None, min_length=1, description="The network interface the scheduler "
                                  "and workers listen on (ib0, eth1). None: Dask's choice.")
    log_directory: str | None = Field(default=None, min_length=1, description="Where each job writes its output "
                                      "(slurm-JOBID.out). None: the working folder of the flow.")

    @property
    def walltime_s(self) -> int:
        return slurm_seconds(self.walltime)


def slurm_seconds(limit: str) -> int:
    """A SLURM time ('[D-]HH:MM:SS', 'HH:MM:SS', 'MM:SS', as sbatch takes and scontrol shows it) in seconds."""
    days, _, clock = limit.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    hours, minutes, seconds = [0] * (3 - len(parts)) + parts
    return (int(days) if days else 0) * 86400 + hours * 3600 + minutes * 60 + seconds


class TLSConfig(_Strict):
    """Mutual TLS to a Dask scheduler that requires it (Dask's `Security`): files on the machine
    the flow runs on."""

    ca_file: str = Field(min_length=1, description="PEM file of the CA that signed the scheduler's and workers' "
                         "certificates.")
    cert_file: str = Field(min_length=1, description="PEM certificate the flow presents, signed by that CA.")
    key_file: str = Field(min_length=1, description="PEM private key of cert_file.")


class DistributionConfig(_Strict):
    mode: Literal["single", "sync", "async"] = Field(
        default="sync",
        description="single: no Dask cluster; the rollout jobs run in the flow's own process, one after another, "
        "evaluations in one helper process beside it, and the run is the same as in sync, byte for byte (small, "
        "fast envs; debugging). "
        "sync: every iteration waits for all rollout workers, then learns (on- and off-policy). "
        "async: rollout workers keep collecting with the newest committed policy while the learner learns from "
        "their shards as they land: off-policy agents insert them into replay and train at samples_per_insert; "
        "appo and impala (async only) learn from each batch of a chunk per worker, V-trace correcting for the lag.",
    )
    max_policy_lag: int = Field(
        default=4, ge=0, le=1_000_000,
        description="async: a shard collected by a policy more than this many versions behind the learner's "
        "newest is dropped (and counted), not inserted or learned from.",
    )
    samples_per_insert: float | None = Field(
        default=None, gt=0, le=1_000_000,
        description="async: transitions sampled for training per transition inserted (Reverb's ratio). "
        "None derives it from the sync schedule: batch_size x train_steps_per_iteration / env steps per iteration.",
    )
    commit_every_train_steps: int = Field(
        default=64, ge=1, le=1_000_000,
        description="async: the learner commits a new policy version every this many gradient steps.",
    )
    rollout_workers: int = Field(
        default=2, ge=1, le=1024, description="Rollout jobs per iteration, each writing one shard."
    )
    envs_per_worker: int = Field(
        default=8, ge=1, le=4096, description="In-process vectorised envs per rollout worker."
    )
    env_threads: int = Field(
        default=1, ge=1, le=256,
        description="C++ threads that step each rollout worker's envs, where a C++ backend steps them (env.backend "
        "envpool or ale); 1: the worker's own thread. A host's cores can go to one worker with as many threads "
        "(and its envs) instead of as many workers of one thread (docs/benchmarks.md).",
    )
    scheduler_address: str | None = Field(
        default=None,
        description="Address of a running Dask scheduler (tcp://host:8786). "
        "None starts a LocalCluster for the run.",
    )
    scheduler_wait_s: float = Field(
        default=120.0, ge=0, description="A scheduler at scheduler_address that is lost mid-run (killed, its "
        "node gone): how long the run waits for one to answer at the same address again, then continues where "
        "it was (jobs in flight are sent again); past it the run stops in one line naming `gymflow resume`.",
    )
    tls: TLSConfig | None = Field(
        default=None,
        description="Connect to a tls:// scheduler_address with these certificates; a scheduler started with "
        "--tls-ca-file/--tls-cert/--tls-key refuses clients without them. None: plain tcp:// (or Dask's own "
        "distributed.comm.tls configuration).",
    )
    cluster_tls: bool = Field(
        default=True,
        description="The Dask cluster gymflow starts for the run (its LocalCluster, a SLURM run's cluster) speaks "
        "mutual TLS, with certificates made for the run and handed to its own clients and workers only: a process "
        "without them cannot connect, so cannot run code as you. false: plain tcp, where anyone who reaches the "
        "scheduler's port runs code as you (the run says so once). A cluster at scheduler_address is the one its "
        "owner started: see `tls`.",
    )
    cluster_class: str | None = Field(
        default=None,
        description="A Dask cluster class as 'module.Class' (dask_jobqueue.SLURMCluster), "
        "started, scaled to rollout_workers and closed for the run.",
    )
    cluster_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for cluster_class."
    )
    slurm: SlurmConfig | None = Field(
        default=None, description="Start the rollout workers as SLURM jobs (docs/cluster.md, \"SLURM\"): the "
        "cluster is adaptive, between `adaptive`'s {minimum, maximum} workers or at rollout_workers.",
    )
    adaptive: AdaptiveConfig | None = Field(
        default=None, description="With a cluster_class or slurm: let Dask adapt it between {minimum, maximum} workers "
        "(workers retired and added mid-run; a job on a retired one is sent again) instead of scaling it to "
        "rollout_workers.",
    )
    rollout_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Dask worker resources each rollout and evaluation job needs, e.g. {'ROLLOUT': 1}; "
        "workers advertise theirs with `dask worker --resources ROLLOUT=1`.",
    )
    ship_env_module: bool = Field(
        default=True,
        description="On a remote cluster (scheduler_address or cluster_class): send the module an env.id "
        "'module:Class' names, where it is a file or package of the working folder, to every worker before the "
        "first job and to workers that join later. false: the workers must have it installed.",
    )
    ship_paths: list[str] = Field(
        default_factory=list,
        description="On a remote cluster: .py files and package folders sent to every worker and put on its "
        "import path, e.g. ['my_package']. Code only: what workers need installed (gymflow and its extras, "
        "pip packages) is not shipped.",
    )
    learner_threads: int = Field(
        default=1, ge=1, le=256, description="torch threads of the learner in the flow's process (of each rank's, "
        "with learners > 1)."
    )
    learners: int = Field(
        default=1, ge=1, le=64,
        description="Data-parallel learning ranks: 1 is the learner in the flow's process; N > 1 adds N - 1 rank "
        "processes beside it on the flow's machine (torch.distributed: gloo on CPU, NCCL on GPUs: rank r on the "
        "r-th GPU after learner_device's). Every rank holds the same learner and draws the same minibatches; each "
        "computes the gradients of its share of their rows, averaged over the ranks before every optimiser step, so "
        "the ranks take the steps one learner takes (within float rounding), and a SYNC run gives the same weights "
        "every time for the same N. The flow's rank commits; a rank lost mid-round is started again from the round's "
        "start. For ppo (not recurrent), appo, impala, dqn, sac and td3 (docs/cluster.md, \"Several learners\").",
    )
    learner_device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="Where the learner's networks, optimisers and sampled batches live: auto (cuda where torch "
        "sees a GPU and the networks read images, else cpu: an MLP's update runs no faster on a GPU), cpu, cuda "
        "or cuda:N. Rollout workers act on their CPU unless distribution.inference computes their outputs beside the "
        "learner; checkpoints and the MLflow model are stored as CPU tensors.",
    )
    inference: Literal["auto", "worker", "learner"] = Field(
        default="auto",
        description="Where rollout workers' policy networks run. worker: on each worker's CPU, beside its envs. "
        "learner: one process beside the learner, on its device, computes the outputs for every worker on the "
        "learner's machine in batches while their envs step (half a worker's envs step while the other half's "
        "outputs are computed); workers elsewhere act on their CPU. auto: learner for async runs whose learner is "
        "on a GPU, else worker. SYNC runs are reproduced bit for bit only with worker (a GPU's batched outputs "
        "depend on which requests it batches); for ppo, appo, impala and dqn, single-agent envs, no recurrent "
        "policy.",
    )
    cluster_start_timeout_s: float = Field(
        default=120.0, gt=0, description="How long to wait for the cluster's first worker, and for one "
        "offering rollout_resources.",
    )
    rollout_timeout_s: float = Field(
        default=600.0, gt=0, description="A rollout or evaluation job still running after this many seconds is "
        "taken as wedged: its worker is restarted and the job sent again (3 attempts in all, then the run fails)."
    )
    gpu_wait_s: float = Field(
        default=3600.0, gt=0, description="A learner on a GPU whose slots other runs hold (one per GPU unless an "
        "administrator gives it more: docs/deploy.md) waits this many seconds for one, saying who holds it, then the "
        "run stops."
    )


class StorageConfig(_Strict):
    root: str = Field(
        default="gymflow-data",
        description="Where shards and checkpoints live: a local folder, file:// or s3:// URL.",
    )

    @field_validator("root")
    @classmethod
    def _a_folder_or_a_supported_url(cls, root: str) -> str:
        if not root.strip():
            raise ValueError("must name a local folder, file:// or s3:// URL, not be empty")
        scheme = root.partition("://")[0].lower() if "://" in root else ""
        if scheme and scheme not in STORAGE_SCHEMES:
            raise ValueError(f"unsupported scheme {scheme!r}; allowed: a local folder, file:// or s3:// URL")
        return root
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec/s3fs options, e.g. {'endpoint_url': 'http://127.0.0.1:9000'}.",
    )
    options_block: str | None = Field(
        default=None, pattern=r"^[a-z0-9-]+/[A-Za-z0-9_.-]+$",
        description="A Prefect block holding storage options, credentials among them: secret/NAME (a Secret whose "
        "value is a mapping such as {key: ..., secret: ..., endpoint_url: ...}) or aws-credentials/NAME (prefect-aws). "
        "Read by the flow at its start and laid over `options`; its values are never stored, logged or parameters.",
    )
    shared: bool = Field(
        default=False,
        description="The local-folder root is mounted at the same path on every Dask worker "
        "(NFS, a shared disk), so a remote cluster may use it.",
    )
    outage_budget_s: float = Field(
        default=300.0, gt=0,
        description="How long an S3 object store may go unanswered (down, restarting) while what the run reads "
        "and writes there waits and is tried again; past it, or at once where the store answers that the bucket is "
        "gone, the run stops in one line, what it committed kept for `gymflow resume`.",
    )
    checkpoint_replay: bool = Field(
        default=False,
        description="Include the replay memory in every checkpoint (off-policy agents), so a resume loads it "
        "instead of rebuilding it from the run's shards.",
    )
    checkpoint_every_env_steps: int | None = Field(
        default=None, gt=0,
        description="Write a full checkpoint (learner, optimisers, loop state, RNG, replay if asked) every this "
        "many environment steps. Every committed version's policy is published for the rollout workers "
        "regardless, and a checkpoint is always written at version 0 and at the end. With both cadences None: "
        "at every version that is evaluated.",
    )
    checkpoint_every_seconds: float | None = Field(
        default=None, gt=0,
        description="Write a full checkpoint every this many seconds of wall-clock (with "
        "checkpoint_every_env_steps too: whichever comes first).",
    )
    keep_checkpoints: int = Field(
        default=2, ge=1, le=1_000_000,
        description="Full checkpoints kept: the newest this many, plus the delivered version's; older ones "
        "are deleted.",
    )
    keep_shards: Literal["needed", "all"] = Field(
        default="needed",
        description="needed: delete a shard (and an async ledger segment) once no kept checkpoint can need it: "
        "neither its envs' cursor nor the replay memory a resume rebuilds. all: keep every shard.",
    )


class TrackingConfig(_Strict):
    tracking_uri: str = Field(
        default="sqlite:///mlflow.db",
        description="MLflow tracking URI; the default is a SQLite file in the working folder.",
    )
    experiment: str = Field(default="gymflow", min_length=1, description="MLflow experiment.")
    outage_budget_s: float = Field(
        default=300.0, gt=0,
        description="How long the MLflow server, and apart from it the Prefect API, may each go unanswered (down, "
        "restarting, its database lost) while the run goes on and what it records waits; past it the run stops at "
        "its next commit, in one line, its checkpoints and what MLflow did not get kept for `gymflow resume`.",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _a_scheme_mlflow_knows(cls, uri: str) -> str:
        scheme = uri.partition(":")[0].lower() if ":" in uri and not _WINDOWS_DRIVE.match(uri) else ""
        if not uri.strip() or (scheme and scheme.split("+")[0] not in TRACKING_SCHEMES):
            allowed = ", ".join(f"{name}:" for name in TRACKING_SCHEMES)
            raise ValueError(f"unsupported tracking URI {redacted_uri(uri)!r}; allowed: {allowed} or a local folder")
        return uri
    artifact_location: str | None = Field(
        default=None,
        description="Where a new MLflow experiment keeps artifacts, e.g. s3://bucket/mlflow; "
        "None keeps MLflow's default. An existing experiment keeps its own.",
    )
    video: Literal["final", "every_evaluation", "off"] = Field(
        default="final",
        description="Film one greedy episode as MP4 (envs that render rgb_array) at the final evaluation, at every "
        "evaluation, or never; logged to the MLflow run under videos/. A rollout worker films it after the "
        "evaluation's own episodes, off the training path.",
    )


class DatasetConfig(_Strict):
    """Experience to learn from that no rollout of this run collected: a Minari dataset (`gymflow
    export` writes one from a run), or gymflow runs' own stored experience."""

    id: str | None = Field(
        default=None, min_length=1, description="The Minari dataset id, [namespace/]name-vN (gymflow/cartpole-v0)."
    )
    runs: list[str] = Field(
        default_factory=list,
        description="Instead of a Minari dataset: gymflow run ids whose stored experience (their shards' whole "
        "episodes, as `gymflow export` reads them) to learn from, in this order.",
    )
    decisions: str | None = Field(
        default=None, min_length=1,
        description="Instead of a Minari dataset or runs: a served policy's decision log (a folder or an s3:// URL, "
        "as GYMFLOW_DECISION_LOG named it where the policy served): each decision whose outcome arrived, a step "
        "from its observation to the outcome's next observation.",
    )
    holdout: float = Field(
        default=0.0, ge=0.0, le=0.9,
        description="decisions: the share of logged decisions not learned from (chosen by request id), kept for "
        "off-policy evaluation (a retraining's judge: off_policy).",
    )
    logged_before: float | None = Field(
        default=None,
        description="decisions: only the decisions and outcomes logged before this unix time, so a log that is "
        "still being written reads the same in every process of a run (a retraining sets its start). None: all "
        "there when read.",
    )
    root: str | None = Field(
        default=None,
        description="Where the dataset is: for `id`, the Minari datasets root (a local folder, file:// or s3:// "
        "URL; None: Minari's own, MINARI_DATASETS_PATH else ~/.minari/datasets); for `runs`, the gymflow storage "
        "root they are under (None: this preset's storage).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec/s3fs options for an s3:// root, e.g. {'endpoint_url': ...}."
    )

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if sum((self.id is not None, bool(self.runs), self.decisions is not None)) != 1:
            raise ValueError("name a Minari dataset (id), gymflow runs (runs) or a decision log (decisions), one of "
                             "the three")
        return self

    @property
    def name(self) -> str:
        """What a person reads: the dataset id, the runs, or the decision log."""
        if self.decisions is not None:
            return f"decisions at {self.decisions}"
        return self.id or f"runs {', '.join(self.runs)}"


class Preset(_Strict):
    """One experiment: what to learn, how, on what budget, where things go."""

    name: str = Field(min_length=1, description="Experiment name, used in run ids.")
    env: EnvConfig
    agent: AgentConfig
    schedule: ScheduleConfig
    distribution: DistributionConfig = Field(default_factory=DistributionConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    dataset: DatasetConfig | None = Field(
        default=None,
        description="Put this dataset's transitions in the replay memory before training (off-policy agents): the "
        "whole of an offline run's experience (schedule.total_env_steps 0), or the start of an online one's.",
    )
    seed: int = Field(default=0, ge=0, description="Run seed; every other seed derives from it.")

    @property
    def offline(self) -> bool:
        """Learns from its dataset alone: nothing is collected, and the budget is gradient steps."""
        return self.dataset is not None and self.schedule.total_env_steps == 0

    @property
    def collect_only(self) -> bool:
        """Collects with its starting policy and learns nothing (schedule.total_train_steps 0)."""
        return self.schedule.total_train_steps == 0 and self.schedule.total_env_steps > 0

    @property
    def remote_cluster(self) -> bool:
        """Rollouts run on a cluster gymflow did not start on this machine."""
        return bool(self.distribution.scheduler_address or self.distribution.cluster_class or self.distribution.slurm)

    @property
    def envs_in_total(self) -> int:
        return self.distribution.rollout_workers * self.distribution.envs_per_worker

    @property
    def env_steps_per_iteration(self) -> int:
        return self.envs_in_total * self.schedule.rollout_steps_per_env

    @property
    def steps_per_chunk(self) -> int:
        """async: env steps in one shard of one rollout worker."""
        return self.distribution.envs_per_worker * self.schedule.rollout_steps_per_env

    @property
    def samples_per_insert(self) -> float:
        """async: the training ratio, set or derived from the sync schedule of an off-policy agent."""
        if self.distribution.samples_per_insert is not None:
            return self.distribution.samples_per_insert
        agent = self.agent
        return agent.batch_size * agent.train_steps_per_iteration / self.env_steps_per_iteration
