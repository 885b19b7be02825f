"""Many hosts on one machine (gymflow.testing.network): the S3 server, the Dask scheduler and two
worker hosts each in a network namespace of its own, with its own address and folder; the flow
in this machine's namespace, at the bridge's address. Nothing is shared but what the network
carries: storage is the S3 server. A SYNC run through a fault ends with a clean run's weights."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import latest_version, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.testing.network import Host, Network, unavailable
from gymflow.testing.s3 import user_and_bucket
from tests.conftest import drill_run, nothing_left_within, running_processes

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]
DASK = str(Path(sys.executable).with_name("dask"))
S3_PORT, SCHEDULER_PORT = 5000, 8786


@dataclass
class Hosts:
    network: Network
    s3: Host
    scheduler: Host
    workers: list[Host]
    options: dict[str, str]  # the bucket's endpoint and key

    @property
    def scheduler_address(self) -> str:
        return f"tcp://{self.scheduler.address}:{SCHEDULER_PORT}"


def _answers(address: str, port: int, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing answered at {address}:{port} within {within_s} s"
            time.sleep(0.2)


def _s3_with_a_key(host: Host) -> dict[str, str]:
    """moto's S3 server on `host`, IAM on: a user with a key, and the bucket `gymflow`."""
    host.start([sys.executable, "-m", "moto.server", "-H", host.address, "-p", str(S3_PORT)],
               env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    _answers(host.address, S3_PORT)
    endpoint = f"http://{host.address}:{S3_PORT}"
    key, secret = user_and_bucket(endpoint, "gymflow")
    return {"endpoint_url": endpoint, "key": key, "secret": secret}


def _start_dask(scheduler: Host, workers: list[Host]) -> None:
    scheduler.start([DASK, "scheduler", "--host", scheduler.address, "--port", str(SCHEDULER_PORT),
                     "--dashboard-address", ":0"])
    _answers(scheduler.address, SCHEDULER_PORT)
    for worker in workers:
        worker.start([DASK, "worker", f"tcp://{scheduler.address}:{SCHEDULER_PORT}", "--host", worker.address,
                      "--nthreads", "1", "--dashboard-address", ":0", "--local-directory", str(worker.folder)])


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[Hosts]:
    network = Network(tmp_path_factory.mktemp("hosts"))
    try:
        s3, scheduler = network.host("s3"), network.host("scheduler")
        workers = [network.host("worker1"), network.host("worker2")]
        options = _s3_with_a_key(s3)
        _start_dask(scheduler, workers)
        yield Hosts(network, s3, scheduler, workers, options)
    finally:
        network.close()


@pytest.fixture(autouse=True)
def every_worker_host_serving(hosts) -> None:
    """Each test starts with a worker of each worker host at the scheduler. An earlier test's fault
    can end one for good: a worker whose link to the scheduler stays unacknowledged past Dask's
    TCP timeout (30 s: a 20 s partition, then TCP's resends backing off on a loaded machine) closes,
    and its nanny with it; the run through it still ends clean. Such a host's worker is started
    again, with a warning; one started by the test before may still be joining."""
    from distributed import Client

    for host in hosts.workers:
        if not any(process.poll() is None for process in host.processes):
            warnings.warn(f"{host.name}'s worker had ended (its log: {host.folder}); started again", stacklevel=2)
            host.stop()
            _start_worker(host, hosts)
    with Client(hosts.scheduler_address, timeout=30) as client:
        for host in hosts.workers:
            _wait_for_a_worker_of(client, host)


def _wait_for_a_worker_of(client, host: Host, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not _worker_ports(client, host):
        assert time.monotonic() < deadline, f"no worker of {host.name} joined the scheduler within {within_s:.0f} s"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def nothing_of_the_run_left(hosts) -> Iterator[None]:
    """Nothing a test's run started is alive 10 s after it ends but the drill's hosts."""
    before = running_processes()
    yield
    nothing_left_within(before, lambda: [process.pid for host in hosts.network.hosts for process in host.processes])


def _overrides(hosts: Hosts, workspace: Path, prefix: str) -> dict:
    """The drill's run (tests/conftest.py), stored on the S3 host."""
    return {**drill_run(workspace), "storage.root": f"s3://gymflow/{prefix}", "storage.options": hosts.options,
            "distribution.scheduler_address": hosts.scheduler_address}


def _final_policy(hosts: Hosts, prefix: str, run_id: str) -> tuple[int, bytes]:
    storage = Storage(StorageLocation(f"s3://gymflow/{prefix}", hosts.options))
    version = latest_version(storage, RunLayout(run_id))
    return version, read_policy(storage, RunLayout(run_id), version)["policy.safetensors"]


def _newest_checkpoint(hosts: Hosts, prefix: str) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=hosts.options["endpoint_url"], region_name="us-east-1",
                      aws_access_key_id=hosts.options["key"], aws_secret_access_key=hosts.options["secret"])
    listed = s3.list_objects_v2(Bucket="gymflow", Prefix=f"{prefix}/runs/").get("Contents", [])
    versions = [int(item["Key"].split("/checkpoints/v")[1][:6]) for item in listed
                if "/checkpoints/v" in item["Key"] and item["Key"].endswith("manifest.json")]
    return max(versions, default=-1)


class _DuringTheRun(threading.Thread):
    """`fault()` in a thread once the run under `prefix` has committed `after_version`; `join`
    raises what the fault raised (a fault that failed is not one the run went through)."""

    def __init__(self, fault, hosts: Hosts, prefix: str, after_version: int):
        super().__init__(daemon=True)
        self.fault, self.hosts, self.prefix, self.after_version = fault, hosts, prefix, after_version
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 180
            while _newest_checkpoint(self.hosts, self.prefix) < self.after_version and time.monotonic() < deadline:
                time.sleep(0.1)
            self.fault()
        except BaseException as error:  # handed to the test's thread by join
            self.error = error

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise AssertionError(f"the fault during the run failed: {self.error!r}") from self.error


def _during_the_run(fault, hosts: Hosts, prefix: str, after_version: int = 4) -> _DuringTheRun:
    """Run `fault()` in a thread once the run under `prefix` has committed `after_version`."""
    thread = _DuringTheRun(fault, hosts, prefix, after_version)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def clean_policy(hosts, prefect_api, tmp_path_factory) -> tuple[int, bytes]:
    summary = improve("cartpole-ppo", _overrides(hosts, tmp_path_factory.mktemp("clean"), "clean"))
    return _final_policy(hosts, "clean", summary.run_id)


class Partition:
    """`host` cut off the network for `seconds`, the times noted."""

    def __init__(self, host: Host, seconds: float = 20):
        self.host, self.seconds = host, seconds
        self.cut_at = self.mended_at = float("inf")

    def __call__(self) -> None:
        self.cut_at = time.monotonic()
        self.host.cut()
        time.sleep(self.seconds)
        self.host.mend()
        self.mended_at = time.monotonic()


def _run_through(partition: Partition, hosts: Hosts, workspace: Path, prefix: str, **changes) -> tuple[int, bytes]:
    """A run under `prefix`, its host cut off once it has committed version 4; its final policy."""
    return _final_policy(hosts, prefix, _summary_through(partition, hosts, workspace, prefix, **changes).run_id)


def _summary_through(partition: Partition, hosts: Hosts, workspace: Path, prefix: str, **changes):
    fault = _during_the_run(partition, hosts, prefix)
    summary = improve("cartpole-ppo", {**_overrides(hosts, workspace, prefix), **changes})
    ended = time.monotonic()
    fault.join()
    assert partition.cut_at < ended and partition.mended_at < ended, "the run did not go on across the partition"
    return summary


@pytest.mark.slow  # long tier (70 s): the async run through a worker host's and the S3 host's partitions stays in
def test_a_run_whose_worker_host_is_cut_off_for_20_s_ends_with_a_clean_runs_weights(hosts, clean_policy, workspace):
    """The job on the cut-off host is waited for (its connections hold: TCP resends once the link is up),
    or, where the resend comes after Dask's TCP timeout (a loaded machine), the worker closes and its
    job is done again on the other: the same weights either way."""
    assert _run_through(Partition(hosts.workers[0]), hosts, workspace, "cut") == clean_policy


@pytest.mark.slow  # the twin of the worker host's partition (SYNC) and the async run's S3 partition, which stay in
def test_a_run_whose_s3_host_is_cut_off_for_20_s_ends_with_a_clean_runs_weights(hosts, clean_policy, workspace):
    """Writes and reads of the flow and the workers wait for the S3 host; nothing is committed unstored."""
    assert _run_through(Partition(hosts.s3), hosts, workspace, "s3cut") == clean_policy


@pytest.mark.slow  # the twin of tests/test_scheduler_loss.py's scheduler and workers killed and back after 2 s
def test_a_run_whose_scheduler_and_worker_hosts_die_and_come_back_ends_with_a_clean_runs_weights(
        hosts, clean_policy, workspace):
    """The scheduler's and workers' processes SIGKILLed, as when their machines die, and started
    again at the same addresses 5 s later (tasks/cluster/scheduler_link.py)."""
    dead: list[float] = []

    def die_and_come_back() -> None:
        for host in (hosts.scheduler, *hosts.workers):
            host.kill()
        dead.append(time.monotonic())
        time.sleep(5)
        _start_dask(hosts.scheduler, hosts.workers)

    fault = _during_the_run(die_and_come_back, hosts, "died")
    summary = improve("cartpole-ppo", _overrides(hosts, workspace, "died"))
    ended = time.monotonic()
    fault.join()
    assert dead and dead[0] < ended, "the run ended before its cluster died"
    assert _final_policy(hosts, "died", summary.run_id) == clean_policy


def _start_worker(host: Host, hosts: Hosts, *extra: str) -> None:
    host.start([DASK, "worker", hosts.scheduler_address, "--host", host.address, "--nthreads", "1",
                "--dashboard-address", ":0", "--local-directory", str(host.folder), *extra])


class Churn:
    """A third worker host joins once the run has committed version 4; then the first is
    preempted (SIGTERM: Dask's worker closes, its job is redone elsewhere); then the new one is
    retired through the scheduler. `events`: when each happened."""

    def __init__(self, hosts: Hosts):
        self.hosts, self.events = hosts, []
        self.joined = hosts.network.host(f"worker{len(hosts.network.hosts)}")

    def __call__(self) -> None:
        from distributed import Client

        hosts, joined = self.hosts, self.joined
        _start_worker(joined, hosts)
        with Client(hosts.scheduler_address, timeout=30) as client:
            _wait_for_a_worker_of(client, joined)
            self.events.append(time.monotonic())
            time.sleep(1)
            hosts.workers[0].stop()  # SIGTERM, as a spot instance's preemption notice
            self.events.append(time.monotonic())
            time.sleep(1)
            client.retire_workers([f"tcp://{joined.address}:{port}" for port in _worker_ports(client, joined)])
            self.events.append(time.monotonic())

    def run_through(self, preset: str, overrides: dict, prefix: str):
        """`preset`'s run under `prefix` through the churn; its summary. The hosts are as before after."""
        try:
            fault = _during_the_run(self, self.hosts, prefix)
            summary = improve(preset, overrides)
            ended = time.monotonic()
            fault.join()
            assert len(self.events) == 3 and self.events[-1] < ended, "the run ended before the workers came and went"
            return summary
        finally:
            self.joined.stop()
            if not self.hosts.workers[0].processes:
                _start_worker(self.hosts.workers[0], self.hosts)


@pytest.mark.slow  # long tier: the async run through workers added, preempted and retired stays in
def test_workers_added_preempted_and_retired_mid_run_leave_a_sync_run_as_a_clean_one(hosts, clean_policy, workspace):
    """Rounds go on through the churn, each job lands once, and the weights are a clean run's."""
    summary = Churn(hosts).run_through("cartpole-ppo", _overrides(hosts, workspace, "churn"), "churn")
    assert _final_policy(hosts, "churn", summary.run_id) == clean_policy


# default tier (one of its 25 slowest): the worker-churn drill kind (workers joining, preempted, retired)
def test_an_async_run_through_workers_added_preempted_and_retired_accounts_for_every_chunk_once(hosts, prefect_api,
                                                                                             workspace):
    """APPO's chunks through the same churn: the preempted and the retired workers' chunks in
    flight are collected again (by their keys), and each lands once within the lag bound."""
    from tests.stored import check_every_chunk_once

    overrides = {**_overrides(hosts, workspace, "async-churn"), "distribution.mode": "async",
                 "distribution.max_policy_lag": 2, "storage.keep_shards": "all"}
    summary = Churn(hosts).run_through("cartpole-appo", overrides, "async-churn")
    assert summary.env_steps >= 16384
    check_every_chunk_once(Storage(StorageLocation("s3://gymflow/async-churn", hosts.options)), summary.run_id,
                           workers=2, max_policy_lag=2)


def _worker_ports(client, host: Host) -> list[int]:
    return [int(address.rsplit(":", 1)[1]) for address in client.scheduler_info(n_workers=-1)["workers"]
            if address.startswith(f"tcp://{host.address}:")]


# default tier (one of its 25 slowest): the network-partition drill kind (a worker host's and the S3 host's), on namespace hosts
def test_an_async_run_through_partitions_of_a_worker_host_and_the_s3_host_accounts_for_every_chunk_once(
        hosts, prefect_api, workspace):
    from tests.stored import check_every_chunk_once

    worker, store = Partition(hosts.workers[1]), Partition(hosts.s3)

    def partitions() -> None:
        worker()
        store()

    overrides = {**_overrides(hosts, workspace, "async"), "distribution.mode": "async",
                 "distribution.max_policy_lag": 2, "storage.keep_shards": "all"}
    fault = _during_the_run(partitions, hosts, "async")
    summary = improve("cartpole-appo", overrides)
    ended = time.monotonic()
    fault.join()
    assert store.mended_at < ended, "the run did not go on across both partitions"
    assert summary.env_steps >= 16384
    storage = Storage(StorageLocation("s3://gymflow/async", hosts.options))
    # the cut-off worker's chunk lands versions late, and is dropped (the summary's lag counts it)
    check_every_chunk_once(storage, summary.run_id, workers=2, max_policy_lag=2)


@pytest.mark.slow  # 100-190 s; tests/test_hosts.py holds a worker closing at its lifetime (host starting), and the
# churn test above a SYNC run through workers preempted and retired
@pytest.mark.timeout(900)  # 144 s on the AVX-512 kind beside another test: past 300 s on the AVX2 kind
def test_a_sync_run_on_workers_that_end_at_their_lifetime_ends_as_a_clean_one(hosts, clean_policy, workspace):
    """dask-jobqueue's way: each worker retires after `--lifetime` (here 10 s, staggered) and its
    nanny starts a new one; the run goes on with whichever workers are up. (A worker's life must
    outlast its start: ~5 s on the slowest machines here, its process and then its job host.)"""
    for host in hosts.workers:
        host.stop()
        _start_worker(host, hosts, "--lifetime", "10s", "--lifetime-stagger", "1s", "--lifetime-restart")
    try:
        began_with = _workers_up(hosts, wait_for=len(hosts.workers))
        summary = improve("cartpole-ppo", _overrides(hosts, workspace, "lifetime"))
        assert began_with - _workers_up(hosts), "no worker reached its lifetime during the run"
        assert _final_policy(hosts, "lifetime", summary.run_id) == clean_policy
    finally:
        for host in hosts.workers:
            host.stop()
            _start_worker(host, hosts)


def _workers_up(hosts: Hosts, wait_for: int = 0) -> set[str]:
    """The addresses of the workers the scheduler lists, once it lists `wait_for` of them."""
    from distributed import Client

    with Client(hosts.scheduler_address, timeout=30) as client:
        if wait_for:
            client.wait_for_workers(wait_for, timeout=60)
        return set(client.scheduler_info(n_workers=-1)["workers"])


@pytest.mark.slow  # the twin of the worker and S3 host partitions, which stay in the default run
def test_a_run_whose_mlflow_host_is_cut_off_for_20_s_ends_finished_with_every_metric(hosts, clean_policy, workspace):
    """MLflow's client retries its requests (with backoff, for minutes): the run waits, and its
    MLflow run holds every evaluation and ends FINISHED."""
    from mlflow.tracking import MlflowClient

    tracking = hosts.network.host(f"mlflow{len(hosts.network.hosts)}")
    tracking.start([str(Path(sys.executable).with_name("mlflow")), "server", "--host", tracking.address,
                    "--port", "5001", "--workers", "1", "--backend-store-uri", f"sqlite:///{tracking.folder}/mlflow.db",
                    "--artifacts-destination", str(tracking.folder / "artifacts")])
    try:
        _answers(tracking.address, 5001, within_s=120)
        uri = f"http://{tracking.address}:5001"
        summary = _summary_through(Partition(tracking), hosts, workspace, "mlcut", **{"tracking.tracking_uri": uri})
        assert _final_policy(hosts, "mlcut", summary.run_id) == clean_policy
        client = MlflowClient(uri)
        assert client.get_run(summary.mlflow_run_id).info.status == "FINISHED"
        history = client.get_metric_history(summary.mlflow_run_id, "eval/return_mean")
        assert [int(metric.step) for metric in history] == [evaluation.env_steps for evaluation in summary.evaluations]
    finally:
        tracking.stop()


@pytest.mark.slow  # the twin of the worker and S3 host partitions, which stay in the default run
def test_a_run_whose_prefect_server_is_cut_off_for_20_s_goes_on_and_ends_completed(hosts, clean_policy, workspace):
    """`gymflow run` under a Prefect server on a host of its own: its requests wait for the
    server (Prefect's client retries them), the run goes on, and its flow run ends Completed."""
    import subprocess

    server = hosts.network.host(f"prefect{len(hosts.network.hosts)}")
    server.start([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", server.address,
                  "--port", "4201"], env={**os.environ, "PREFECT_HOME": str(server.folder),
                                          "PREFECT_UI_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "0"})
    try:
        _answers(server.address, 4201, within_s=120)
        api = f"http://{server.address}:4201/api"
        overrides = _overrides(hosts, workspace, "apicut")
        sets = [f"--set={key}={json.dumps(value)}" for key, value in overrides.items()]
        partition = Partition(server)
        fault = _during_the_run(partition, hosts, "apicut")
        flow = subprocess.run([str(Path(sys.executable).with_name("gymflow")), "run", "cartpole-ppo", "--quiet", *sets],
                              env={**os.environ, "PREFECT_API_URL": api}, capture_output=True, text=True, timeout=300)
        ended = time.monotonic()
        fault.join()
        assert flow.returncode == 0, flow.stderr[-3000:]
        assert partition.mended_at < ended, "the run did not go on across the partition"
        run_id = flow.stdout.split()[1]  # "run RUN_ID ended: ..." (the drill's run has no target)
        assert _final_policy(hosts, "apicut", run_id) == clean_policy
        assert _flow_run_states(api) == ["Completed"]
    finally:
        server.stop()


def _flow_run_states(api: str) -> list[str]:
    import httpx

    runs = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=30).json()
    return [run["state"]["name"] for run in runs]
