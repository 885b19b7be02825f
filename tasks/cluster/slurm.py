"""Rollout workers as SLURM jobs (`distribution.slurm`), through dask-jobqueue's SLURMCluster.

Each job runs `processes` Dask workers, which leave on their own `lifetime_margin_s` before the
job's walltime (`dask worker --lifetime`, staggered so that they do not all leave at once): the
rollout a leaving worker held is sent to another, and the cluster, adaptive, submits a fresh job.
A worker the queue kills instead (preemption, `scancel`) costs the same, a rollout sent again.

Before any job is queued, the job is checked against the queue: its partition's time limit
and its nodes' CPUs and memory (`scontrol show partition`, `sinfo`), where a queue that does not
enforce them would leave the job pending for good; then `sbatch --test-only` with the job's
script (an account, a QOS, a GPU the queue refuses). A refusal is one line naming the field,
with the queue's own words, and nothing is queued.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import TYPE_CHECKING

import dask

from gymflow.errors import ClusterUnavailable, InvalidPreset
from gymflow.last_steps import before_exit_now
from gymflow.logs import AnyLogger
from gymflow.presets.model import DistributionConfig, SlurmConfig, slurm_seconds
from gymflow.tasks.cluster.clocks import HOUSEKEEPING_CLOCKS, housekeeping_exports

if TYPE_CHECKING:
    from dask_jobqueue import SLURMCluster

SLURM = "distribution.slurm"
COMMAND_TIMEOUT_S = 30  # sbatch, squeue: a controller that does not answer within it is down
JOB_NAME = "gymflow-worker"  # what squeue lists the jobs as (sbatch -J)
# the queue's refusals, by the field that leads to them (sbatch's and slurmctld's words)
_REFUSALS = (
    ("partition", ("invalid partition", "partition")),
    ("account", ("account", "association")),
    ("walltime", ("time limit", "qosmaxwalldurationperjob", "walltime")),
    ("memory", ("memory",)),
    ("gpus", ("gres", "generic resource")),
    ("cores", ("cpu count", "processor", "cpus")),
)


def worker_lifetime(slurm: SlurmConfig) -> tuple[int, int]:
    """(lifetime, stagger) in seconds for `dask worker --lifetime --lifetime-stagger`: a worker
    leaves lifetime ± stagger after it started, between two margins and one margin before its
    job's walltime (the job started a little before it)."""
    margin = int(slurm.lifetime_margin_s)
    stagger = margin // 2
    return slurm.walltime_s - margin - stagger, stagger


def slurm_cluster(config: DistributionConfig) -> SLURMCluster:
    """A SLURMCluster for the run's rollout workers, checked against the queue, then adaptive
    between `adaptive`'s bounds (or at rollout_workers)."""
    slurm = config.slurm
    assert slurm is not None
    if shutil.which("sbatch") is None:
        raise ClusterUnavailable(SLURM, "sbatch is not on this machine's PATH: run the flow on a SLURM login node "
                                        "(or a machine whose sbatch reaches the cluster)")
    check_against_partition(slurm)  # before a scheduler is started for it
    certificates = _certificates_folder(slurm) if config.cluster_tls else None
    try:
        cluster = _started_cluster(config, certificates)
    except BaseException:
        if certificates:
            shutil.rmtree(certificates, ignore_errors=True)
        raise
    if certificates:  # with the cluster, its certificates: dask-jobqueue's files (closed: removed), then their folder
        # the temporary files dask-jobqueue keeps as `_job_<key>` (beside them, `_job_kwargs`: a dict)
        files = [value for name, value in vars(cluster).items() if name.startswith("_job_") and hasattr(value, "close")]
        weakref.finalize(cluster, _remove_certificates, files, certificates)
    minimum, maximum = (config.adaptive.minimum, config.adaptive.maximum) if config.adaptive else (
        config.rollout_workers, config.rollout_workers)
    cluster.adapt(minimum=minimum, maximum=maximum)
    return cluster


def _started_cluster(config: DistributionConfig, certificates: str | None) -> SLURMCluster:
    """The SLURMCluster of `config.slurm` (its scheduler in this process); closed again if its job
    script is not one the queue takes."""
    from dask_jobqueue import SLURMCluster

    slurm = config.slurm
    assert slurm is not None
    lifetime, stagger = worker_lifetime(slurm)
    resources = [f"{name}={amount:g}" for name, amount in config.rollout_resources.items()]
    with dask.config.set(HOUSEKEEPING_CLOCKS):  # its scheduler is made here, in this process
        cluster = SLURMCluster(
            queue=slurm.partition,
            account=slurm.account,
            walltime=slurm.walltime,
            cores=slurm.cores,
            memory=slurm.memory,
            processes=slurm.processes,
            job_extra_directives=[*([f"--gres=gpu:{slurm.gpus}"] if slurm.gpus else []), *slurm.directives],
            # the jobs' workers on gymflow's clocks, the user's lines after ours (theirs win)
            job_script_prologue=[*housekeeping_exports(), *slurm.prologue],
            worker_extra_args=["--lifetime", f"{lifetime}s", "--lifetime-stagger", f"{stagger}s",
                               *(["--resources", ",".join(resources)] if resources else [])],
            python=slurm.python or sys.executable,
            interface=slurm.interface,
            log_directory=slurm.log_directory,
            job_name=JOB_NAME,
            scheduler_options={"dashboard_address": "127.0.0.1:0"},  # ":0" would bind every interface
            # mutual TLS: certificates made for the run; the workers' copies in a 0700 folder the nodes share
            security=certificates is not None or None,
            shared_temp_directory=certificates,
        )
    try:
        check_job_script(cluster.job_script())
    except BaseException:
        cluster.close()
        raise
    return cluster


def _certificates_folder(slurm: SlurmConfig) -> str:
    """A folder of this run's alone (0700) for the certificates its jobs' workers present, where the
    nodes read it too: the jobs' log folder, or the flow's working folder (as dask-jobqueue's default)."""
    base = slurm.log_directory or os.getcwd()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=".gymflow-tls-", dir=base)


def _remove_certificates(files: list, folder: str) -> None:
    for file in files:
        with contextlib.suppress(OSError):
            file.close()
    shutil.rmtree(folder, ignore_errors=True)


def check_against_partition(slurm: SlurmConfig) -> None:
    """The job's walltime within its partition's MaxTime, its cores and memory within what one of
    the partition's nodes has."""
    settings = _partition_settings(slurm.partition)
    name = settings["PartitionName"]
    max_time = settings.get("MaxTime", "UNLIMITED")
    if max_time not in ("UNLIMITED", "INFINITE") and slurm.walltime_s > slurm_seconds(max_time):
        raise InvalidPreset(f"{SLURM}.walltime", f"{slurm.walltime} is above partition {name}'s MaxTime "
                                                 f"{max_time}; allowed: up to {max_time}, or another partition")
    nodes = _run(["sinfo", "-h", "-p", name, "-o", "%c %m"]).split()
    cpus = max((int(value) for value in nodes[0::2]), default=0)
    memory_mb = max((int(value.rstrip("+")) for value in nodes[1::2]), default=0)
    if slurm.cores > cpus:
        raise InvalidPreset(f"{SLURM}.cores", f"{slurm.cores} is more CPUs than a node of partition {name} has; "
                                              f"allowed: up to {cpus}")
    if _megabytes(slurm.memory) > memory_mb:
        raise InvalidPreset(f"{SLURM}.memory", f"{slurm.memory} is more than a node of partition {name} has; "
                                               f"allowed: up to {memory_mb:,} MB")


def _partition_settings(partition: str | None) -> dict[str, str]:
    """scontrol's settings of `partition` (None: the default one)."""
    listed = _run(["scontrol", "show", "partition", "-o", *([partition] if partition else [])], missing_ok=True)
    for line in listed.splitlines():
        settings = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "PartitionName" in settings and (partition is not None or settings.get("Default") == "YES"):
            return settings
    if partition is None:
        raise InvalidPreset(f"{SLURM}.partition", "the queue has no default partition; allowed: "
                                                  + ", ".join(_partitions()))
    raise InvalidPreset(f"{SLURM}.partition", f"the queue has no partition {partition!r}; allowed: "
                                              + ", ".join(_partitions()))


def _partitions() -> list[str]:
    return sorted({line.strip().rstrip("*") for line in _run(["sinfo", "-h", "-o", "%P"]).splitlines()})


def _ask(command: list[str]) -> subprocess.CompletedProcess | None:
    """A SLURM command, run; None where it does not answer within COMMAND_TIMEOUT_S (slurmctld down)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None


def _run(command: list[str], missing_ok: bool = False) -> str:
    """A SLURM command's output; a controller that does not answer is the cluster unavailable, and
    a refusal is the queue refusing the job (`missing_ok`: what it lists may not be there)."""
    done = _ask(command)
    if done is None:
        raise ClusterUnavailable(SLURM, f"{command[0]} did not answer within {COMMAND_TIMEOUT_S} s: is slurmctld "
                                        "up? (scontrol ping)")
    if done.returncode != 0 and not (missing_ok and "not found" in done.stdout + done.stderr):
        raise refusal(done.stderr or done.stdout)
    return done.stdout


def _megabytes(memory: str) -> float:
    """'4GB', '3.5GiB', '500MB', '2G' (the preset model's pattern) in MB, as SLURM counts (1024s)."""
    from dask.utils import parse_bytes

    return parse_bytes(memory if memory[-1] == "B" else memory + "B") / 2**20


def check_job_script(script: str) -> None:
    """`sbatch --test-only`: what the queue says of the job, without queueing it; a refusal in
    one line naming the field that leads to it."""
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="gymflow-job-") as job:
        job.write(script)
        job.flush()
        _run(["sbatch", "--test-only", job.name])


def refusal(said: str) -> InvalidPreset | ClusterUnavailable:
    """sbatch's refusal as gymflow's one line: the field its words point at, and the words."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    words = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
    words = re.sub(r"^sbatch: error: ", "", words)
    if "unable to contact slurm controller" in words.lower() or "connection refused" in words.lower():
        return ClusterUnavailable(SLURM, f"the queue did not answer: {words}")
    for field, hints in _REFUSALS:
        if any(hint in words.lower() for hint in hints):
            return InvalidPreset(f"{SLURM}.{field}", f"the queue refuses the job: {words}")
    return InvalidPreset(SLURM, f"the queue refuses the job: {words}")


def job_ids(cluster: SLURMCluster) -> dict[str, str]:
    """The cluster's jobs that the queue gave an id, by their worker's name."""
    return {name: job.job_id for name, job in list(cluster.workers.items()) if getattr(job, "job_id", None)}


def jobs_waiting(cluster: SLURMCluster) -> str:
    """What the queue says of the cluster's jobs ('12 PENDING (Resources)'), for a run that
    waited for its first worker in vain."""
    ids = list(job_ids(cluster).values())
    if not ids:
        return "no job was queued"
    listed = _ask(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T (%r)"])
    if listed is None:
        return f"jobs {', '.join(ids)}; squeue did not answer"
    return "; ".join(listed.stdout.split("\n")).strip("; ") or f"jobs {', '.join(ids)} are no longer queued"


# a job in any other state (or no longer listed) has ended: cancelled, preempted, past its walltime,
# failed, or done because its workers left at their lifetime
_ALIVE = frozenset(("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING",
                    "SIGNALING", "STAGE_OUT"))
REAP_EVERY_S = 2.0


class EndedJobsReplaced:
    """Takes the jobs the queue says have ended out of the cluster's plan, so that its adaptive
    scaling submits fresh ones: dask-jobqueue keeps an ended job in its plan, and a cluster whose
    jobs are cancelled or reach their walltime never grows back (dask-jobqueue #611, #691). Meanwhile
    the scheduler's lines about departing workers stay off the terminal (WorkerDepartures). A look
    at the queue that fails is said once and tried again at the next (the watch never ends early).
    At the end every job still queued is cancelled in one `scancel` (dask-jobqueue's close cancels
    them one by one), also where the run ends at once (gymflow.last_steps)."""

    def __init__(self, cluster: SLURMCluster, logger: AnyLogger | None = None):
        self.cluster = cluster
        self.replaced: list[str] = []  # the ended jobs' ids, in the order they were seen
        self._logger = logger or logging.getLogger(__name__)
        self._failed_said = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gymflow-slurm-jobs", daemon=True)
        self._last_step = before_exit_now(self.cancel_jobs)

    def __enter__(self) -> EndedJobsReplaced:
        self._thread.start()
        self._last_step.__enter__()
        for name in _DEPARTURE_LOGGERS:
            logging.getLogger(name).addFilter(_DEPARTURES)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(COMMAND_TIMEOUT_S + REAP_EVERY_S)
        for name in _DEPARTURE_LOGGERS:
            logging.getLogger(name).removeFilter(_DEPARTURES)
        self.cancel_jobs()
        self._last_step.__exit__(None, None, None)

    def cancel_jobs(self) -> None:
        """Every job of the cluster's, cancelled in one `scancel` (bounded by COMMAND_TIMEOUT_S)."""
        if ids := job_ids(self.cluster):
            _ask(["scancel", *sorted(set(ids.values()))])

    def _watch(self) -> None:
        while not self._stop.wait(REAP_EVERY_S):
            try:
                self._replace_ended()
            except Exception as error:  # a queue that answers oddly once: looked at again next time
                if not self._failed_said:
                    self._failed_said = True
                    self._logger.warning("distribution.slurm: looking at the queue failed (%s: %s); the run goes on "
                                         "and looks again every %g s", type(error).__name__, error, REAP_EVERY_S)

    def _replace_ended(self) -> None:
        jobs, alive = job_ids(self.cluster), _alive_jobs()
        if jobs and alive is not None:
            ended = [name for name, job_id in jobs.items() if job_id not in alive]
            if ended:
                self.replaced += [jobs[name] for name in ended]
                self.cluster.loop.add_callback(self._forget, ended)

    def _forget(self, names: list[str]) -> None:
        for name in names:
            self.cluster.worker_spec.pop(name, None)
        self.cluster.scale(len(self.cluster.worker_spec))  # closes them; adapt then asks for more


class WorkerDepartures(logging.Filter):
    """Leaves out the scheduler's lines about a worker that leaves with the run's job host (an
    actor) on it, at its lifetime or with its job: the run says each in a line of its own."""

    SAID = ("which can't be moved", "Could not retire worker", "failed: CommClosedError")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(said in message for said in self.SAID)


_DEPARTURES = WorkerDepartures()
_DEPARTURE_LOGGERS = ("distributed.active_memory_manager", "distributed.scheduler")


def _alive_jobs() -> set[str] | None:
    """The ids of this user's jobs that have not ended; None where the queue does not answer
    (slurmctld restarting: nothing is taken for ended then)."""
    listed = _ask(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i %T"])
    if listed is None or listed.returncode != 0:
        return None
    return {job_id for job_id, state in (line.split()[:2] for line in listed.stdout.splitlines() if line.strip())
            if state in _ALIVE}
