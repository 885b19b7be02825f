"""A Dask scheduler lost mid-run, as when its node dies: the scheduler and its workers SIGKILLed,
then started again at the same address by a supervisor. A SYNC run waits for it, sends its jobs
in flight again and ends with a clean run's weights; where none comes back within
`distribution.scheduler_wait_s` it stops in one line naming the resume command, which then ends
the run with the same weights. Real processes throughout: `dask scheduler`, `dask worker`, the
`gymflow` command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import latest_version, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import drill_run, free_port, nothing_left_within, running_processes

pytestmark = pytest.mark.e2e
DASK = str(Path(sys.executable).with_name("dask"))
CLI = "import sys\nfrom gymflow.flows.cli import main\nsys.exit(main(sys.argv[1:]))"
KILLED_AFTER = 4  # the scheduler and its workers die once this version is committed


class Cluster:
    """`dask scheduler` and two `dask worker` processes at one loopback address, each in a
    session of its own (a worker's nanny and worker process die together)."""

    def __init__(self, folder: Path):
        self.port, self.folder = free_port(), folder
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen] = []

    def start(self) -> None:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": self.folder,
                 "start_new_session": True}
        self.processes = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                                            "--dashboard-address", ":0"], **quiet)]
        self.processes += [subprocess.Popen([DASK, "worker", self.address, "--nthreads", "1", "--host", "127.0.0.1",
                                             "--dashboard-address", ":0"], **quiet) for _ in range(2)]

    def kill(self) -> None:
        for process in self.processes:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            process.wait(timeout=30)


@pytest.fixture
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def nothing_of_the_run_left(cluster) -> Iterator[None]:
    """Nothing a test's run started is alive 10 s after it ends but the scheduler and workers."""
    before = running_processes()
    yield
    nothing_left_within(before, lambda: [process.pid for process in cluster.processes])


def _overrides(workspace: Path, root: str, address: str) -> dict:
    """The drill's run (tests/conftest.py) in a folder every worker reaches (one machine)."""
    return {**drill_run(workspace), "storage.root": str(workspace / root), "storage.shared": True,
            "distribution.scheduler_address": address}


def _final_policy(root: Path) -> tuple[str, int, bytes]:
    storage = Storage(StorageLocation(str(root)))
    (run_id,) = [path.name for path in (root / "runs").iterdir()]
    version = latest_version(storage, RunLayout(run_id))
    return run_id, version, read_policy(storage, RunLayout(run_id), version)["policy.safetensors"]


def _command(args: list[str], stderr: Path) -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    return subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=subprocess.DEVNULL, stderr=stderr.open("w"),
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})


def _run_command(overrides: dict) -> list[str]:
    sets = [item for key, value in overrides.items() for item in ("--set", f"{key}={'null' if value is None else value}")]
    return ["run", "cartpole-ppo", "--quiet", *sets]


def _lose_the_scheduler_once_committed(cluster: Cluster, root: Path, flow: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while max((int(path.parent.name[1:]) for path in root.glob("runs/*/checkpoints/v*/manifest.json")),
              default=-1) < KILLED_AFTER:
        assert flow.poll() is None and time.monotonic() < deadline, "the run ended before its scheduler could be lost"
        time.sleep(0.02)
    cluster.kill()


@pytest.fixture
def clean_policy(prefect_api, workspace, cluster) -> bytes:
    improve("cartpole-ppo", _overrides(workspace, "clean", cluster.address))
    return _final_policy(workspace / "clean")[2]


# Back after 2 s, Dask's client reconnects by itself (to a scheduler with another id); after 12 s
# it has given up (10 s) and the run connects a client of its own.
@pytest.mark.slow  # long tier (53 s): the async run through a lost scheduler stays in
@pytest.mark.parametrize("down_s", [2, pytest.param(12, marks=pytest.mark.slow)])
def test_a_run_waits_for_its_lost_scheduler_and_ends_with_a_clean_runs_weights(clean_policy, workspace, cluster, down_s):
    root, stderr = workspace / "lost", workspace / "stderr.txt"
    flow = _command(_run_command(_overrides(workspace, "lost", cluster.address)), stderr)
    _lose_the_scheduler_once_committed(cluster, root, flow)
    time.sleep(down_s)
    cluster.start()
    assert flow.wait(timeout=180) == 0, stderr.read_text()[-3000:]

    _, version, policy = _final_policy(root)
    assert version == 32 and policy == clean_policy
    said = stderr.read_text()
    assert f"the Dask scheduler at {cluster.address} was lost; waiting up to 120 s" in said
    assert f"a Dask scheduler answers at {cluster.address} again" in said
    assert "Traceback" not in said and "Failed to reconnect" not in said


@pytest.mark.slow  # long tier (56 s): the async run through a lost scheduler stays in
def test_a_scheduler_that_does_not_come_back_stops_the_run_in_one_line_and_resume_ends_it(
        clean_policy, workspace, cluster):
    root, stderr = workspace / "gone", workspace / "stderr.txt"
    overrides = {**_overrides(workspace, "gone", cluster.address), "distribution.scheduler_wait_s": 1}
    flow = _command(_run_command(overrides), stderr)
    _lose_the_scheduler_once_committed(cluster, root, flow)
    assert flow.wait(timeout=120) == 2

    run_id, version, _ = _final_policy(root)
    lines = stderr.read_text().splitlines()
    assert lines[-1] == (f"gymflow: error: distribution.scheduler_address: the Dask scheduler at {cluster.address} was "
                         f"lost and none answered there within distribution.scheduler_wait_s (1 s); what was "
                         f"committed stays: `gymflow resume {run_id} --root {root}` continues the run"), lines[-1]
    assert "Traceback" not in "\n".join(lines)
    assert KILLED_AFTER <= version < 32

    cluster.start()
    resumed = _command(["resume", run_id, "--root", str(root), "--quiet"], workspace / "resumed.txt")
    assert resumed.wait(timeout=180) == 0, (workspace / "resumed.txt").read_text()[-3000:]
    assert _final_policy(root)[1:] == (32, clean_policy)


IMPROVE = ("import json, sys\nfrom gymflow.flows.improve import improve\n"
           "summary = improve(sys.argv[1], json.loads(sys.argv[2]))\n"
           "open(sys.argv[3], 'w').write(json.dumps({'run_id': summary.run_id, 'lag_max': summary.policy_lag_max, "
           "'env_steps': summary.env_steps, 'versions': summary.versions_committed}))")


# default tier (one of its 25 slowest): the lost-scheduler drill kind
def test_an_async_run_through_a_lost_scheduler_accounts_for_every_chunk_once_within_its_lag_bound(
        prefect_api, workspace, cluster):
    from prefect.settings import PREFECT_API_URL

    from gymflow.tasks.storage.checkpoints import committed_versions
    from tests.stored import check_every_chunk_once

    root, stderr, result = workspace / "async", workspace / "stderr.txt", workspace / "summary.json"
    overrides = {**_overrides(workspace, "async", cluster.address), "distribution.mode": "async",
                 "distribution.max_policy_lag": 2, "storage.keep_shards": "all"}
    flow = subprocess.Popen([sys.executable, "-c", IMPROVE, "cartpole-appo", json.dumps(overrides), str(result)],
                            stdout=subprocess.DEVNULL, stderr=stderr.open("w"),
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    _lose_the_scheduler_once_committed(cluster, root, flow)
    time.sleep(12)
    cluster.start()
    assert flow.wait(timeout=180) == 0, stderr.read_text()[-3000:]

    summary = json.loads(result.read_text())
    # a chunk sent again after the loss acts with the version it was first sent with; the learner takes
    # the batch that had landed meanwhile (the batch stream holds no lock across the wait), so such a
    # chunk can land one version past the bound: it is dropped and counted, never learned from (below)
    assert summary["lag_max"] <= 2 + 1 and summary["env_steps"] >= 16384
    storage, layout = Storage(StorageLocation(str(root))), RunLayout(summary["run_id"])
    check_every_chunk_once(storage, summary["run_id"], workers=2, max_policy_lag=2)  # those lost with the scheduler once
    assert committed_versions(storage, layout)[-1] == summary["versions"] - 1
    assert "was lost; waiting up to 120 s" in stderr.read_text() and "Traceback" not in stderr.read_text()


def test_dasks_reconnect_verdict_stays_dropped_while_any_run_s_link_is_open():
    """Two runs of one process (a sweep's members) each hold a link: the first to close leaves the
    other's terminal as it was (Dask's "Failed to reconnect ..." dropped, the run saying it waits)."""
    import logging

    from distributed import Client, LocalCluster

    from gymflow.tasks.cluster.scheduler_link import SchedulerAddress, SchedulerLink, _dasks_verdict

    client_log = logging.getLogger("distributed.client")
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        at = SchedulerAddress(cluster.scheduler_address, None, 10.0)
        first, second = (SchedulerLink(client, at, "", logging.getLogger("test")) for _ in range(2))
        first.close()
        assert _dasks_verdict in client_log.filters
        second.close()
        assert _dasks_verdict not in client_log.filters
