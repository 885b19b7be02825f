"""Job hosts on real Dask worker processes: a job's own error comes back at once as one line (of
any exception type, one pickle cannot rebuild included), a worker that dies mid-job has the job
redone elsewhere, as is one whose worker leaves while its host starts, and closing the pool leaves no
host behind."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from distributed import Client, LocalCluster

from gymflow.errors import JobFailed
from gymflow.tasks.cluster import hosts as hosts_module
from gymflow.tasks.cluster.hosts import HOST_START_TIMEOUT_S, MOVES, HostPool
from gymflow.tasks.cluster.rounds import run_round

LOGGER = logging.getLogger("test")


def whose_process(tag: str) -> tuple[str, int]:
    return tag, os.getpid()


def fails(tag: str) -> None:
    raise ValueError(f"bad spec {tag}")


class Stubborn(Exception):
    """An exception pickle cannot rebuild: its constructor takes two arguments, its args hold one."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what} because {why}")


def fails_stubbornly(tag: str) -> None:
    raise Stubborn(tag, "the env\nsaid so")


class OnlyHere:
    """A result whose class the flow's side will not find."""


def returns_what_the_flow_cannot_read(tag: str) -> object:
    OnlyHere.__module__ = "a_module_only_the_worker_has"
    OnlyHere.__qualname__ = "OnlyHere"
    import sys
    import types

    module = sys.modules["a_module_only_the_worker_has"] = types.ModuleType("a_module_only_the_worker_has")
    module.OnlyHere = OnlyHere
    return OnlyHere()


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


def test_a_jobs_own_error_fails_the_call_at_once_in_one_line_naming_job_worker_and_cause(client, caplog):
    hosts = HostPool(client, None, 60)
    with pytest.raises(JobFailed) as caught:
        run_round(hosts, fails, ["x"], LOGGER)
    hosts.close()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("fails job of slot 0 on the Dask worker tcp://127.0.0.1:")
    assert message.endswith(": ValueError: bad spec x")
    assert "in fails" in caught.value.trace  # the worker's traceback, for the run's log
    assert "submitting the job again" not in caplog.text  # nothing retried


@pytest.mark.parametrize("job, cause", [
    (fails_stubbornly, "Stubborn: x because the env said so"),
    (returns_what_the_flow_cannot_read, "its result cannot be read here: "),
])
def test_an_error_or_result_that_cannot_be_unpickled_here_fails_the_call_within_seconds(client, job, cause):
    hosts = HostPool(client, None, 60)
    started = time.monotonic()
    with pytest.raises(JobFailed, match=cause) as caught:
        run_round(hosts, job, ["x"], LOGGER)
    hosts.close()
    assert time.monotonic() - started < 10  # not the 60 s deadline, three times over
    assert "\n" not in str(caught.value)


def test_a_worker_killed_mid_job_has_the_job_redone_on_a_live_worker(client, tmp_path, caplog):
    hosts = HostPool(client, None, 60)
    once = tmp_path / "killed.once"
    [pid] = run_round(hosts, dies_once, [str(once)], LOGGER)
    hosts.close()
    assert pid != int(once.read_text())  # another process finished it
    assert "was lost" in caplog.text and "(attempt 2 of 3)" in caplog.text  # a death counts


def _close_as_at_its_lifetime(dask_worker) -> None:
    # what `--lifetime` calls (distributed/worker.py)
    dask_worker.loop.add_callback(dask_worker.close_gracefully, restart=True, reason="worker-lifetime-reached")


@pytest.mark.parametrize("moves", [MOVES, 0])
def test_a_worker_that_leaves_while_its_host_starts_has_the_job_sent_elsewhere_within_seconds(moves, caplog,
                                                                                               monkeypatch):
    """Dask keeps a host's start waiting for its worker, which never comes back once it closed (its
    nanny starts a new one, at a new address): the pool sees it gone and sends the job on, counting
    no attempt (the worker closed itself, as at its lifetime). Such moves are capped: with none
    allowed, the run fails in one line saying why."""
    monkeypatch.setattr(hosts_module, "MOVES", moves)
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
          Client(cluster) as client):  # its own: the closed worker is not replaced
        client.wait_for_workers(2)
        first = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
        busy = client.submit(time.sleep, 60, workers=[first], pure=False)  # its one thread: the host waits
        while not client.processing().get(first):
            time.sleep(0.05)
        threading.Timer(1, lambda: client.run(_close_as_at_its_lifetime, workers=[first])).start()
        hosts = HostPool(client, None, 60)
        started = time.monotonic()
        try:
            run_round(hosts, whose_process, ["x"], LOGGER)
        except TimeoutError as error:
            failed = str(error)
        else:
            failed = ""
        waited = time.monotonic() - started
        hosts.close()
        client.cancel(busy)
    left = f"could not start a job host on {first}: the worker left while its host was starting"
    if moves:
        assert f"{left} (it closed itself: not counted as an attempt) (attempt 1 of 3)" in caplog.text
        assert not failed
    else:
        assert failed.startswith("whose_process job of slot 0 did not complete: its worker left before it ended once "
                                 "(is the workers' --lifetime shorter than a job?); the last: "), failed
        assert left in failed and "\n" not in failed
    assert waited < HOST_START_TIMEOUT_S / 2, waited


def test_closing_the_pool_leaves_no_host_on_the_workers(client):
    hosts = HostPool(client, None, 60)
    processes = {pid for _, pid in run_round(hosts, whose_process, ["a", "b"], LOGGER)}
    assert sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) == len(processes)
    hosts.close()
    deadline = time.monotonic() + 10
    while sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) == 0


class _HeldHosts:
    """Hosts whose jobs finish when the test says: slot 0 at once, slot 1 after `late_s`."""

    timeout_s, closed, one_process = 600.0, False, False

    def __init__(self, late_s: float):
        self.late_s = late_s

    def call(self, function, spec, slot, attempt=1):
        import concurrent.futures
        import threading

        from gymflow.tasks.cluster.hosts import Call

        future = concurrent.futures.Future()
        if slot == 0:
            future.set_result(slot)
        else:
            threading.Timer(self.late_s, future.set_result, [slot]).start()
        return Call(future, function, spec, slot, f"tcp://worker-{slot}", attempt, time.monotonic() + self.timeout_s)

    def settle(self, call, logger):
        return call


def run_held_rollout(spec):  # a log line calls it `held_rollout job <its shard>`
    return spec


@pytest.mark.parametrize(("name_stalls", "named"), [(True, 1), (False, 0)])
def test_a_rollout_still_running_after_its_round_s_first_finished_is_named_once(monkeypatch, caplog, name_stalls,
                                                                                named):
    from types import SimpleNamespace

    from gymflow.tasks.cluster import rounds

    monkeypatch.setattr(rounds, "STALL_NOTICE_S", 0.2)
    specs = [SimpleNamespace(shard_key=f"runs/r/shards/v000003-w{worker}") for worker in range(2)]
    with caplog.at_level(logging.WARNING):
        assert run_round(_HeldHosts(late_s=2.0), run_held_rollout, specs, logging.getLogger("round"),
                         name_stalls=name_stalls) == [0, 1]
    warnings = [record.getMessage() for record in caplog.records if "still running" in record.getMessage()]
    assert len(warnings) == named  # once, though the round looked at it ~10 times after the notice was due
    if named:
        assert "job runs/r/shards/v000003-w1 on the Dask worker tcp://worker-1" in warnings[0]
