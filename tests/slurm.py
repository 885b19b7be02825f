"""A real SLURM on this machine for the tests: munged, slurmctld and slurmd started under a
temporary folder (Debian's slurm-wlm and munge, which `make test` and .ci/run install), one node
(this machine) in two partitions: `debug` (the default, no time limit) and `short` (at most one
minute a job). Every command of the test's process reaches it through SLURM_CONF; the daemons
are stopped by their pids after, once no job is left."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
MUNGE_KEY = Path("/etc/munge/munge.key")
START_TIMEOUT_S = 30


@dataclass
class Slurm:
    conf: Path  # SLURM_CONF
    node: str
    folder: Path
    controller: subprocess.Popen

    def squeue(self, reasons: bool = False) -> list[str]:
        """'JOBID STATE' (with reasons: 'JOBID STATE (REASON)') of every job in the queue."""
        listed = _run("squeue", "-h", "-o", "%i %T (%r)" if reasons else "%i %T")
        return [line for line in listed.splitlines() if line.strip()]

    def scancel(self, job_id: str) -> None:
        _run("scancel", job_id)

    @contextmanager
    def partition_down(self, partition: str = "debug") -> Iterator[None]:
        """Jobs queue in `partition` but none starts (PartitionDown) until this ends."""
        _run("scontrol", "update", f"PartitionName={partition}", "State=DOWN")
        try:
            yield
        finally:
            _run("scontrol", "update", f"PartitionName={partition}", "State=UP")

    def restart_controller(self, down_s: float) -> None:
        """Stop slurmctld, wait `down_s`, start it again on its saved state (the jobs run on)."""
        _stop(self.controller)
        time.sleep(down_s)
        self.controller = _start(self.folder, "slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        _wait_for(lambda: bool(_run("sinfo", "-h", "-o", "%t").strip()), "slurmctld back", [self.controller])


def why_not() -> str | None:
    """Why a SLURM cannot be started here, or None."""
    if os.geteuid() != 0:
        return "starting slurmctld and slurmd as they run here needs root"
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge; make test does)"
    if not MUNGE_KEY.exists():
        return f"no munge key at {MUNGE_KEY} (the munge package makes one)"
    return None


@contextmanager
def slurm_on_this_machine(folder: Path) -> Iterator[Slurm]:
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "logs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    munge = Path(tempfile.mkdtemp(prefix="gymflow-munge-"))  # munged runs as munge: a folder it can reach
    os.chmod(munge, 0o755)
    shutil.chown(munge, "munge", "munge")
    socket_path = munge / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, node, socket_path))
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    started: list[subprocess.Popen] = []
    slurm: Slurm | None = None
    try:
        started.append(_start(folder, "munged", ["munged", "--foreground",
                                                  f"--socket={socket_path}", f"--key-file={MUNGE_KEY}",
                                                  f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                                                  f"--seed-file={munge / 'munged.seed'}"]))
        _wait_for(socket_path.exists, "munged's socket", started)
        started.append(_start(folder, "slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)]))
        started.append(_start(folder, "slurmd", ["slurmd", "-D", "-f", str(conf), "-N", node]))
        _wait_for(lambda: _idle(node), "the node to be idle in sinfo", started)
        slurm = Slurm(conf, node, folder, started[1])
        yield slurm
    finally:
        try:
            controller_up = slurm is not None and slurm.controller.poll() is None
            if len(started) == 3 and controller_up and started[2].poll() is None:
                _cancel_every_job()
        finally:
            if started[1:2] and slurm is not None:
                started[1] = slurm.controller  # restarted in a test
            for process in reversed(started):
                _stop(process)
            shutil.rmtree(munge, ignore_errors=True)
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous


def _conf(folder: Path, node: str, munge_socket: Path) -> str:
    cpus = os.cpu_count() or 1
    memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
    return "\n".join([
        "ClusterName=gymflow-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'logs' / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'logs' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU_Memory",
        "SlurmdParameters=config_overrides",  # the node as declared here, whatever slurmd finds
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=5",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "PartitionName=short Nodes=ALL MaxTime=00:01:00 State=UP",
        "",
    ])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(folder: Path, name: str, command: list[str]) -> subprocess.Popen:
    log = open(folder / "logs" / f"{name}.out", "w")  # noqa: SIM115 (the daemon's, closed with it)
    user = "munge" if name == "munged" else None  # munged will not run as root
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, user=user)


def _run(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=10, check=False).stdout


def _idle(node: str) -> bool:
    return _run("sinfo", "-h", "-n", node, "-o", "%t").strip().startswith("idle")


def _wait_for(ready: Callable[[], bool], what: str, started: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        ended = [" ".join(map(str, process.args[:2])) for process in started if process.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {START_TIMEOUT_S} s" + (f": {ended} ended" if ended else ""))
        time.sleep(0.2)


def _cancel_every_job() -> None:
    _run("scancel", "--user", "root")
    deadline = time.monotonic() + 20
    while _run("squeue", "-h", "-o", "%i").strip() and time.monotonic() < deadline:
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 15)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait(10)
