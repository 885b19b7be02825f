"""Job hosts on real Dask worker processes: a job's own error comes back as itself, a worker that
dies mid-job has the job redone elsewhere, and closing the pool leaves no host behind."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
from distributed import Client, LocalCluster

from gymflow.tasks.cluster.hosts import HostPool
from gymflow.tasks.cluster.rounds import run_round

LOGGER = logging.getLogger("test")


def whose_process(tag: str) -> tuple[str, int]:
    return tag, os.getpid()


def fails(tag: str) -> None:
    raise ValueError(f"bad spec {tag}")


def dies_once(once_file: str) -> int:
    try:
        with open(once_file, "x") as handle:
            handle.write(str(os.getpid()))
    except FileExistsError:
        return os.getpid()
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.fixture(scope="module")
def client():
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
          Client(cluster) as client):
        client.wait_for_workers(2)
        yield client


def test_job_i_runs_on_worker_i_and_results_come_back_in_order(client):
    hosts = HostPool(client, None, 60)
    results = run_round(hosts, whose_process, ["a", "b", "c"], LOGGER)
    hosts.close()
    assert [tag for tag, _ in results] == ["a", "b", "c"]
    assert results[0][1] == results[2][1] != results[1][1]  # slots 0 and 2 share a worker
    assert os.getpid() not in {pid for _, pid in results}


def test_a_jobs_own_error_is_raised_as_itself_and_not_retried(client):
    hosts = HostPool(client, None, 60)
    with pytest.raises(ValueError, match="bad spec x") as caught:
        run_round(hosts, fails, ["x"], LOGGER)
    hosts.close()
    assert any("on the Dask worker" in note for note in caught.value.__notes__)


def test_a_worker_killed_mid_job_has_the_job_redone_on_a_live_worker(client, tmp_path, caplog):
    hosts = HostPool(client, None, 60)
    once = tmp_path / "killed.once"
    [pid] = run_round(hosts, dies_once, [str(once)], LOGGER)
    hosts.close()
    assert pid != int(once.read_text())  # another process finished it
    assert "was lost" in caplog.text


def test_closing_the_pool_leaves_no_host_on_the_workers(client):
    hosts = HostPool(client, None, 60)
    processes = {pid for _, pid in run_round(hosts, whose_process, ["a", "b"], LOGGER)}
    assert sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) == len(processes)
    hosts.close()
    deadline = time.monotonic() + 10
    while sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) == 0
