"""Rollout workers as SLURM jobs (`distribution.slurm`), against a real SLURM started on this
machine (tests/slurm.py): the jobs are in the queue while the run trains and gone after it; a
job cancelled mid-run (as preemption does) costs the SYNC run nothing; what the queue would
refuse is refused before anything is queued, in one line naming the field."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

from gymflow.errors import GymflowError
from gymflow.tasks.cluster.clocks import housekeeping_environment
from tests.conftest import local_overrides
from tests.slurm import Slurm, slurm_on_this_machine, why_not
from tests.stored import newest_published


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Slurm:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    with slurm_on_this_machine(tmp_path_factory.mktemp("slurm")) as started:
        yield started


def _on_slurm(workspace, **slurm) -> dict:
    """A run whose two rollout workers are SLURM jobs of one core and 1 GB each, sharing this
    machine's folder (storage.shared: the nodes mount it)."""
    return {**local_overrides(workspace), "storage.shared": True, "distribution.rollout_workers": 2,
            "distribution.slurm": {"cores": 1, "memory": "1GB", "walltime": "00:30:00",
                                   "log_directory": str(workspace / "slurm-logs"), **slurm}}


class QueueWatch:
    """The most jobs squeue listed running at once, and every job it listed, polled beside a run;
    and the Dask clocks its jobs' workers and its scheduler (in this process) ran on."""

    def __init__(self, slurm: Slurm, intruders: bool = False):
        self.slurm, self.most, self.ids = slurm, 0, set()
        # with `intruders`: once the run's scheduler has workers, what two clients not the run's got
        # in (tests/conftest.py's `intruders_let_in`), and the scheduler's address
        self.intruders: list[str] | None = None
        self.scheduler_address = ""
        self._try_intruders = intruders
        self.worker_clocks: dict[int, dict[str, str]] = {}  # a job's Dask worker process: its DASK_* variables
        self.scheduler_ticks: set[float] = set()  # each running scheduler's tick interval, s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        from distributed import Scheduler

        while not self._stop.wait(0.2):
            listed = self.slurm.squeue()
            self.most = max(self.most, sum(line.endswith(" RUNNING") for line in listed))
            self.ids |= {line.split()[0] for line in listed}
            self.worker_clocks.update(_job_workers_dask_variables())
            self.scheduler_ticks |= {scheduler._tick_interval for scheduler in list(Scheduler._instances)
                                     if scheduler.status.name == "running"}
            serving = [scheduler for scheduler in list(Scheduler._instances) if scheduler.workers]
            if self._try_intruders and self.intruders is None and serving:
                from tests.conftest import intruders_let_in

                self.scheduler_address = serving[0].address
                self.intruders = intruders_let_in(self.scheduler_address)

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(10)


def _job_workers_dask_variables() -> dict[int, dict[str, str]]:
    """The DASK_* variables of each `dask worker` command (its nanny) a SLURM job runs on this machine."""
    found = {}
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if b"distributed.cli.dask_worker" not in (process / "cmdline").read_bytes():
                continue
            environment = dict(line.partition(b"=")[::2] for line in (process / "environ").read_bytes().split(b"\0")
                               if line)
        except OSError:  # ended meanwhile
            continue
        if b"SLURM_JOB_ID" in environment:
            found[int(process.name)] = {name.decode(): value.decode() for name, value in environment.items()
                                        if name.startswith(b"DASK_")}
    return found


def _final_policy(root, summary) -> bytes:
    from gymflow.tasks.storage.checkpoints import read_policy
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    version = summary.versions_committed - 1
    return read_policy(Storage(StorageLocation(str(root))), RunLayout(summary.run_id), version)["policy.safetensors"]


def _cancel_a_job_once(slurm: Slurm, root, at_version: int, cancelled: list[str]) -> None:
    """Once the run under `root` has published `at_version`, scancel one of its running jobs (as
    preemption does), and say which in `cancelled`."""
    deadline = time.monotonic() + 120
    while newest_published(root) < at_version and time.monotonic() < deadline:
        time.sleep(0.05)
    running = [line.split()[0] for line in slurm.squeue() if line.endswith(" RUNNING")]
    if running:
        slurm.scancel(running[0])
        cancelled.append(running[0])


# default tier (one of its 25 slowest): SLURM's one end-to-end run, and its one fault (a job cancelled mid-run)
def test_a_slurm_run_solves_cartpole_through_a_cancelled_job_to_a_local_cluster_runs_weights(
        slurm, prefect_api, workspace, monkeypatch):
    """Its two workers are SLURM jobs while it trains, and none is left after it. One job is
    cancelled mid-run (as preemption does): its rollout is sent to the other worker, a fresh job
    takes its place, and as SYNC rollouts are the same whichever worker runs them, the run ends
    on a LocalCluster run's weights. The watch of the queue fails once first (it used to end for
    good then, and no ended job was replaced)."""
    import gymflow.tasks.cluster.slurm as on_slurm_jobs
    from gymflow.flows.improve import improve

    looked, real_look = [], on_slurm_jobs._alive_jobs

    def fails_the_first_time() -> set[str] | None:
        looked.append(time.monotonic())
        if len(looked) == 1:
            raise ValueError("not enough values to unpack (expected 2, got 1)")  # a line squeue cut short
        return real_look()

    monkeypatch.setattr(on_slurm_jobs, "_alive_jobs", fails_the_first_time)

    run = {"schedule.total_env_steps": 100_000, "distribution.rollout_workers": 2}
    clean = improve("cartpole-ppo", {**run, **local_overrides(workspace), "storage.root": str(workspace / "clean")})
    cancelled: list[str] = []
    canceller = threading.Thread(target=_cancel_a_job_once, args=(slurm, workspace / "slurm", 2, cancelled))
    canceller.start()
    with QueueWatch(slurm, intruders=True) as queue:
        on_slurm = improve("cartpole-ppo", {**run, **_on_slurm(workspace), "storage.root": str(workspace / "slurm")})
    canceller.join()
    assert clean.solved and on_slurm.solved, (clean.final_return, on_slurm.final_return)
    # its scheduler speaks mutual TLS: a client without the run's certificate was refused while it trained
    assert queue.scheduler_address.startswith("tls://") and queue.intruders == [], (queue.scheduler_address,
                                                                                   queue.intruders)
    assert queue.most == 2  # one job a worker, running while it trained
    # the jobs' workers and the run's scheduler on gymflow's clocks (tasks/cluster/clocks.py)
    assert queue.worker_clocks and all(variables.items() >= housekeeping_environment().items()
                                       for variables in queue.worker_clocks.values()), queue.worker_clocks
    assert queue.scheduler_ticks == {0.5}, queue.scheduler_ticks
    assert cancelled and cancelled[0] in queue.ids and len(queue.ids) >= 3, (cancelled, queue.ids)  # and a fresh one
    assert len(looked) >= 3  # the watch went on after it failed
    assert on_slurm.versions_committed == clean.versions_committed
    assert _final_policy(workspace / "slurm", on_slurm) == _final_policy(workspace / "clean", clean)
    _wait_for_an_empty_queue(slurm)
    assert slurm.squeue() == []


@pytest.mark.slow  # long tier (~2 min): a run through its workers' walltime; the cancelled job is the default's fault
def test_a_run_longer_than_its_jobs_walltime_goes_on_through_fresh_jobs_to_the_same_weights(
        slurm, prefect_api, workspace, tiny_budget):
    """One-minute jobs whose workers leave 15-30 s before the walltime (lifetime_margin_s 15): a
    ~90 s run goes through fresh jobs, none killed by the queue at its walltime, and ends on the
    LocalCluster run's weights."""
    from gymflow.flows.improve import improve

    run = {**tiny_budget, "schedule.total_env_steps": 128_000, "schedule.evaluate_every_env_steps": 32_000}
    clean = improve("cartpole-ppo", {**run, **local_overrides(workspace), "storage.root": str(workspace / "clean")})
    with QueueWatch(slurm) as queue:
        rotated = improve("cartpole-ppo", {**run, **_on_slurm(workspace, walltime="00:01:00", lifetime_margin_s=15),
                                           "storage.root": str(workspace / "slurm")})
    assert len(queue.ids) >= 4, queue.ids  # the first two jobs, and fresh ones as their workers left
    assert _final_policy(workspace / "slurm", rotated) == _final_policy(workspace / "clean", clean)
    logs = "".join(path.read_text() for path in (workspace / "slurm-logs").glob("*"))
    assert "DUE TO TIME LIMIT" not in logs  # the queue killed none: their workers had left


def _wait_for_an_empty_queue(slurm: Slurm) -> None:
    deadline = time.monotonic() + 30  # a closed cluster cancels its jobs; the queue forgets them
    while slurm.squeue() and time.monotonic() < deadline:
        time.sleep(0.5)


def test_jobs_the_queue_keeps_pending_past_the_start_timeout_stop_the_run_in_one_line_saying_why(
        slurm, prefect_api, workspace, monkeypatch, caplog):
    """While it waits it says so once, with what the queue says; as it stops, its jobs are cancelled."""
    import gymflow.tasks.cluster.client as client_module
    from gymflow.errors import ClusterUnavailable
    from gymflow.flows.improve import improve

    monkeypatch.setattr(client_module, "FIRST_WORKER_SAID_AFTER_S", 2.0)
    with slurm.partition_down(), pytest.raises(ClusterUnavailable) as stopped, caplog.at_level(logging.INFO):
        improve("cartpole-ppo", {**_on_slurm(workspace), "distribution.cluster_start_timeout_s": 6})
    stopped_at = time.monotonic()
    assert stopped.value.field == "distribution.slurm"
    assert re.fullmatch(r"no worker started within 6 s \(distribution.cluster_start_timeout_s\): "
                        r"\d+ PENDING \(PartitionDown\); \d+ PENDING \(PartitionDown\)", stopped.value.problem), \
        stopped.value.problem
    waited = [record.getMessage() for record in caplog.records if "waiting for a first SLURM worker" in record.getMessage()]
    assert len(waited) == 1 and re.fullmatch(r"waiting for a first SLURM worker \(up to distribution\."
                                             r"cluster_start_timeout_s, 6 s\): \d+ PENDING \(\w+\); \d+ PENDING "
                                             r"\(\w+\)", waited[0]), waited
    while slurm.squeue() and time.monotonic() < stopped_at + 3:  # cancelled in one scancel as the run stopped
        time.sleep(0.2)
    assert slurm.squeue() == []


@pytest.mark.slow  # long tier: the queue holding the jobs a while (the default tier holds one held too long)
def test_a_run_waits_for_jobs_the_queue_holds_pending_a_while_then_trains(slurm, prefect_api, workspace, tiny_budget):
    from gymflow.flows.improve import improve

    seen: list[str] = []
    down = threading.Event()

    def hold_them_a_while() -> None:
        with slurm.partition_down():
            down.set()
            deadline = time.monotonic() + 60
            while len(seen) < 2 and time.monotonic() < deadline:
                seen[:] = [line for line in slurm.squeue(reasons=True) if "(PartitionDown)" in line]
                time.sleep(0.2)
            time.sleep(5)

    holding = threading.Thread(target=hold_them_a_while)
    holding.start()
    down.wait(30)
    summary = improve("cartpole-ppo", {**tiny_budget, **_on_slurm(workspace)})  # the flow's signals: the main thread
    holding.join()
    assert len(seen) == 2 and summary.versions_committed == 6  # held back, then trained to its end
    _wait_for_an_empty_queue(slurm)
    assert slurm.squeue() == []


@pytest.mark.slow  # long tier: the controller lost mid-run (the default tier's fault is a cancelled job)
def test_a_run_outlives_slurmctld_restarted_mid_run_to_the_same_weights(slurm, prefect_api, workspace, tiny_budget):
    """The jobs run on while slurmctld is down (slurmd keeps them), the run's workers with them;
    nothing is taken for an ended job while the queue does not answer."""
    from gymflow.flows.improve import improve

    run = {**tiny_budget, "schedule.total_env_steps": 12800}
    clean = improve("cartpole-ppo", {**run, **local_overrides(workspace), "storage.root": str(workspace / "clean")})

    def restart_at_version_3() -> None:
        deadline = time.monotonic() + 120
        while newest_published(workspace / "slurm") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        slurm.restart_controller(down_s=3)

    restarting = threading.Thread(target=restart_at_version_3)
    restarting.start()
    with QueueWatch(slurm) as queue:
        survived = improve("cartpole-ppo", {**run, **_on_slurm(workspace), "storage.root": str(workspace / "slurm")})
    restarting.join()
    assert len(queue.ids) == 2  # the same two jobs throughout: none taken for ended
    assert _final_policy(workspace / "slurm", survived) == _final_policy(workspace / "clean", clean)
    _wait_for_an_empty_queue(slurm)
    assert slurm.squeue() == []


@pytest.mark.parametrize(("slurm_settings", "field", "says"), [
    ({"partition": "nowhere"}, "distribution.slurm.partition", "no partition 'nowhere'; allowed: debug, short"),
    ({"partition": "short", "walltime": "00:30:00"}, "distribution.slurm.walltime",
     "00:30:00 is above partition short's MaxTime 00:01:00"),
    ({"memory": "100TB"}, "distribution.slurm.memory", "100TB is more than a node of partition debug has"),
    ({"gpus": 1}, "distribution.slurm.gpus", "the queue refuses the job: Invalid generic resource"),  # sbatch's words
])
def test_what_the_queue_would_refuse_is_refused_in_one_line_and_nothing_is_queued(
        slurm, prefect_api, workspace, slurm_settings, field, says):
    from gymflow.flows.improve import improve

    with pytest.raises(GymflowError) as refused:
        improve("cartpole-ppo", _on_slurm(workspace, **slurm_settings))
    assert refused.value.field == field and says in refused.value.problem, str(refused.value)
    assert "\n" not in str(refused.value)
    assert slurm.squeue() == []
    assert not [path for path in workspace.rglob("*") if path.is_file()]  # nothing written (the storage root is made)


@pytest.mark.parametrize(("changes", "field", "says"), [
    ({"distribution.slurm": {"cores": 1, "processes": 2}}, "distribution.slurm.processes",
     "2 workers on 1 cores; allowed: at most cores (1)"),
    ({"distribution.slurm": {"walltime": "00:01:00", "lifetime_margin_s": 20}}, "distribution.slurm.lifetime_margin_s",
     "allowed: at most 15 s, or a longer walltime"),
    ({"distribution.slurm": {"walltime": "1:00"}}, "distribution.slurm.walltime", "String should match pattern"),
    ({"distribution.slurm": {}, "distribution.cluster_class": "distributed.LocalCluster"}, "distribution.slurm",
     "starts a cluster of its own"),
    ({"distribution.slurm": {}, "distribution.mode": "single"}, "distribution.mode", "slurm asks for a cluster"),
])
def test_slurm_settings_that_cannot_work_are_refused_before_the_queue_is_asked(changes, field, says):
    from gymflow.errors import InvalidPreset
    from gymflow.presets.validate import resolve_experiment

    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("cartpole-ppo", {"storage.shared": True, **changes})
    assert refused.value.field == field and says in refused.value.problem, str(refused.value)

