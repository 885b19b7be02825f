"""Beyond one machine: a Dask scheduler and workers started as separate processes (not a
LocalCluster), S3 storage, worker resources, cluster classes, and what is refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
from distributed import Client

from gymflow.flows.cli import main
from gymflow.flows.improve import improve
from gymflow.presets import InvalidPreset
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.storage.checkpoints import latest_version
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import free_port, local_overrides, written_files

pytestmark = pytest.mark.e2e
DASK = str(Path(sys.executable).with_name("dask"))


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """`dask scheduler` and two `dask worker` processes on loopback, started in a folder of their
    own; the first worker offers the resource ROLLOUT=1, the second OTHER=1. Yields (address,
    {pid: resources})."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": tmp_path_factory.mktemp("cluster")}
    processes = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                   "--dashboard-address", ":0"], **quiet)]
    try:
        for resource in ("ROLLOUT=1", "OTHER=1"):
            processes.append(subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                                               "--dashboard-address", ":0", "--resources", resource], **quiet))
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            pids = client.run(os.getpid)
            resources = {pids[addr]: info["resources"] for addr, info in client.scheduler_info(n_workers=-1)["workers"].items()}
        yield address, resources
    finally:
        _stop_workers_then_scheduler(processes)


def _stop_workers_then_scheduler(processes: list[subprocess.Popen]) -> None:
    """`dask scheduler` (the first) and its workers: the workers together first, a worker whose
    scheduler goes at the same moment waits ~10 s to reconnect."""
    for process in processes[1:]:
        process.terminate()
    for process in processes[1:]:
        process.wait(timeout=30)
    processes[0].terminate()
    processes[0].wait(timeout=30)


def _s3(s3_server, prefix: str) -> dict:
    return {"storage.root": f"s3://{s3_server.bucket}/{prefix}", "storage.options": s3_server.options()}


def _pids(summary) -> set[int]:
    return {int(process.split(":")[1]) for process in summary.rollout_processes}


def test_improve_runs_on_a_scheduler_and_workers_started_by_hand_with_s3_storage(prefect_api, workspace, s3_server, dask_cluster, tiny_budget):
    address, workers = dask_cluster
    overrides = {**tiny_budget, **_s3(s3_server, "cluster-run"), "distribution.scheduler_address": address,
                 "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}"}
    summary = improve("cartpole-ppo", overrides)
    assert _pids(summary) == set(workers)  # rollouts ran on both workers
    storage = Storage(StorageLocation(f"s3://{s3_server.bucket}/cluster-run", s3_server.options()))
    assert latest_version(storage, RunLayout(summary.run_id)) == summary.versions_committed - 1 == 5


def test_rollouts_go_only_to_workers_offering_the_resources_they_ask_for(prefect_api, workspace, s3_server, dask_cluster, tiny_budget):
    address, workers = dask_cluster
    overrides = {**tiny_budget, **_s3(s3_server, "resources"), "distribution.scheduler_address": address,
                 "distribution.rollout_resources": {"ROLLOUT": 1}, "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}"}
    summary = improve("cartpole-ppo", overrides)
    assert _pids(summary) == {pid for pid, offered in workers.items() if offered.get("ROLLOUT")}


def test_resources_no_worker_offers_are_refused_before_anything_is_written(prefect_api, workspace, s3_server, dask_cluster, tiny_budget):
    address, _ = dask_cluster
    overrides = {**tiny_budget, **_s3(s3_server, "no-gpu"), "distribution.scheduler_address": address,
                 "distribution.rollout_resources": {"GPU": 1}, "distribution.cluster_start_timeout_s": 2,
                 "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}"}
    state = improve("cartpole-ppo", overrides, return_state=True)
    assert state.is_failed() and "distribution.rollout_resources: no Dask worker offers {'GPU': 1.0}" in state.message
    assert written_files(workspace) == []


def test_a_local_folder_with_a_remote_cluster_is_refused_unless_declared_shared(workspace, capsys):
    remote = {"distribution.scheduler_address": "tcp://10.0.0.5:8786", "storage.root": str(workspace / "data")}
    with pytest.raises(InvalidPreset, match="^storage.root: the local folder .* is not reachable from a remote Dask cluster"):
        resolve_experiment("cartpole-ppo", remote)
    assert resolve_experiment("cartpole-ppo", {**remote, "storage.shared": True}).preset.storage.shared
    assert main(["run", "cartpole-ppo", "--set", "distribution.scheduler_address=tcp://10.0.0.5:8786"]) == 2
    assert "storage.root: the local folder 'gymflow-data'" in capsys.readouterr().err
    assert written_files(workspace) == []


def test_a_cluster_class_is_started_scaled_and_closed_for_the_run(prefect_api, workspace, tiny_budget):
    overrides = {**tiny_budget, **local_overrides(workspace), "storage.shared": True,
                 "distribution.cluster_class": "distributed.LocalCluster",
                 "distribution.cluster_kwargs": {"n_workers": 0, "threads_per_worker": 1, "processes": True,
                                                 "dashboard_address": ":0"}}
    before = set(_cluster_children())  # e.g. the module's own `dask worker` processes
    summary = improve("cartpole-ppo", overrides)
    assert summary.versions_committed == 6
    assert 1 <= len(_pids(summary)) <= 2  # scaled from 0 to rollout_workers=2
    deadline = time.monotonic() + 30
    while set(_cluster_children()) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert set(_cluster_children()) - before == set()  # its workers were closed with the run


def _worker_settings(dask_worker) -> dict:
    import dask

    clocks = dask_worker.periodic_callbacks  # what the running worker does, in ms
    return {"MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            "profiler": dask.config.get("distributed.worker.profile.enabled"),
            "clocks": {name: clocks[name].callback_time for name in ("tick", "memory_monitor", "monitor")}}


def _housekeeping_clocks(dask_scheduler) -> dict:
    return {name: dask_scheduler.periodic_callbacks[name].callback_time for name in ("tick", "monitor")}


def test_the_local_clusters_workers_run_without_dasks_malloc_trim_threshold_and_profiler_and_with_slower_clocks():
    from gymflow.presets.model import DistributionConfig
    from gymflow.tasks.cluster.client import dask_client

    with dask_client(DistributionConfig(rollout_workers=1)) as client:  # see docs/cluster.md for why
        assert list(client.run(_worker_settings).values()) == [
            {"MALLOC_TRIM_THRESHOLD_": None, "profiler": False,
             "clocks": {"tick": 500.0, "memory_monitor": 500.0, "monitor": 1000.0}}]
        assert client.run_on_scheduler(_housekeeping_clocks) == {"tick": 500.0, "monitor": 1000.0}


def test_the_housekeeping_clocks_environment_is_what_dask_reads_as_those_settings():
    """`gymflow stack up` starts its Dask scheduler and workers with this environment: each variable
    is read by Dask as the setting it stands for (its name's dots and hyphens as Dask spells them)."""
    import copy

    import dask
    import distributed  # noqa: F401 (its defaults in dask's config)

    from gymflow.tasks.cluster.clocks import HOUSEKEEPING_CLOCKS, housekeeping_environment

    read = dask.config.update(copy.deepcopy(dask.config.config), dask.config.collect_env(housekeeping_environment()))
    assert {key: dask.config.get(key, config=read) for key in HOUSEKEEPING_CLOCKS} == HOUSEKEEPING_CLOCKS
    assert {key: dask.config.get(key) for key in HOUSEKEEPING_CLOCKS} != HOUSEKEEPING_CLOCKS  # Dask's own differ


def _cluster_children() -> list[int]:
    children = psutil.Process().children(recursive=True)
    return [child.pid for child in children if _is_dask_worker(child)]


def _is_dask_worker(process: psutil.Process) -> bool:
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing" in command and "spawn" in command


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    """`dask scheduler` and a `dask worker` that speak only mutual TLS (self-signed CA) on
    loopback. Yields (address, the certificates, a set of certificates from another CA)."""
    from gymflow.testing.tls import write_certificates

    folder = tmp_path_factory.mktemp("tls")
    files, strangers = write_certificates(folder), write_certificates(folder / "other", "stranger")
    assert Path(files.key_file).stat().st_mode & 0o777 == 0o600  # a private key: its owner's alone (docs/cluster.md)
    tls = ["--tls-ca-file", files.ca_file, "--tls-cert", files.cert_file, "--tls-key", files.key_file]
    port = free_port()
    address = f"tls://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    processes = [subprocess.Popen([DASK, "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", str(port),
                                   "--dashboard-address", ":0", *tls], **quiet)]
    try:
        processes.append(subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                                           "--dashboard-address", ":0", *tls], **quiet))
        from distributed.security import Security

        security = Security(tls_ca_file=files.ca_file, tls_client_cert=files.cert_file,
                            tls_client_key=files.key_file, require_encryption=True)
        with Client(address, timeout=60, security=security) as client:
            client.wait_for_workers(1, timeout=60)
        yield address, files, strangers
    finally:
        _stop_workers_then_scheduler(processes)


def test_a_run_goes_through_a_tls_scheduler_with_the_presets_certificates(prefect_api, workspace, tls_cluster,
                                                                          tiny_budget):
    address, files, _ = tls_cluster
    tls = {"ca_file": files.ca_file, "cert_file": files.cert_file, "key_file": files.key_file}
    overrides = {**tiny_budget, **local_overrides(workspace), "storage.shared": True,
                 "distribution.scheduler_address": address, "distribution.tls": tls}
    summary = improve("cartpole-ppo", overrides)
    assert summary.env_steps == 640 and len(_pids(summary)) == 1  # the TLS cluster's one worker collected


def test_a_tls_scheduler_refuses_a_client_without_its_certificates(prefect_api, workspace, tls_cluster, tiny_budget):
    address, files, strangers = tls_cluster
    base = {**tiny_budget, **local_overrides(workspace), "storage.shared": True, "distribution.scheduler_address": address}
    state = improve("cartpole-ppo", base, return_state=True)  # no certificates
    assert state.is_failed() and "distribution.tls: the scheduler 'tls://" in state.message
    stranger = {"ca_file": files.ca_file, "cert_file": strangers.cert_file, "key_file": strangers.key_file}
    state = improve("cartpole-ppo", {**base, "distribution.tls": stranger}, return_state=True)  # signed by another CA
    assert state.is_failed() and "distribution.scheduler_address: no Dask scheduler answered" in state.message
    assert written_files(workspace) == []  # refused before anything was written


def test_tls_settings_are_refused_before_any_work_without_a_tls_address_or_their_files(workspace, tiny_budget):
    tls = {"ca_file": "ca.pem", "cert_file": "cert.pem", "key_file": "key.pem"}
    remote = {**tiny_budget, "storage.shared": True, "distribution.tls": tls}
    with pytest.raises(InvalidPreset, match="distribution.tls: needs a tls:// distribution.scheduler_address"):
        resolve_experiment("cartpole-ppo", {**remote, "distribution.scheduler_address": "tcp://127.0.0.1:8786"})
    assert main(["run", "cartpole-ppo", *(f"--set={k}={v}" for k, v in {
        "distribution.scheduler_address": "tls://127.0.0.1:8786", "distribution.tls.ca_file": "ca.pem",
        "distribution.tls.cert_file": "cert.pem", "distribution.tls.key_file": "key.pem",
        "storage.shared": "true"}.items())]) == 2


MY_ENV = """
from gymflow.testing.envs import Corridor


class MyCorridor(Corridor):
    '''The user's own env, in a module of the working folder only.'''
"""


@pytest.fixture
def working_folder_env(workspace, monkeypatch) -> str:
    """`my_corridor.py` in the working folder, importable by the flow's process (as the command
    line makes it) and by no worker of `dask_cluster`, whose processes started in another folder."""
    (workspace / "my_corridor.py").write_text(MY_ENV)
    monkeypatch.syspath_prepend(str(workspace))
    return "my_corridor:MyCorridor"


def test_a_working_folder_env_is_shipped_to_workers_started_elsewhere_and_the_run_solves_it(
        prefect_api, workspace, dask_cluster, tiny_budget, working_folder_env):
    address, workers = dask_cluster
    overrides = {**tiny_budget, **local_overrides(workspace), "env.id": working_folder_env,
                 "storage.root": "data",  # relative: the workers started elsewhere find it at the flow's path
                 "storage.shared": True, "distribution.scheduler_address": address,
                 "schedule.total_env_steps": 20_000, "schedule.target_return": 0.9}
    summary = improve("cartpole-ppo", overrides)
    assert summary.solved and _pids(summary) == set(workers)
    with Client(address, timeout=30) as client:  # the code left the workers with the run
        assert not any(client.run(lambda: any("my_corridor" in name for name in sys.modules)).values())
        assert not any(client.run(lambda: any("gymflow-shipped-code" in path for path in sys.path)).values())


def test_with_shipping_off_a_worker_without_the_env_module_is_refused_in_one_line_before_anything_is_written(
        workspace, dask_cluster, tiny_budget, working_folder_env, capsys):
    address, _ = dask_cluster
    started = time.monotonic()
    code = main(["run", "cartpole-ppo", "--quiet", "--set", f"env.id={working_folder_env}",
                 "--set", f"distribution.scheduler_address={address}", "--set", "storage.shared=true",
                 "--set", "distribution.ship_env_module=false"])
    assert code == 2 and time.monotonic() - started < 30
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"gymflow: error: env\.id: the Dask worker tcp://127\.0\.0\.1:\d+ cannot run this preset's "
                        r"jobs: cannot import 'my_corridor': No module named 'my_corridor' \(distribution\."
                        r"ship_env_module sends .*\)", error), error
    assert written_files(workspace) == ["my_corridor.py"]


NO_MUJOCO = "import sys\n\nsys.modules['mujoco'] = None  # as on a worker installed without gymflow's mujoco extra\n"


@pytest.mark.slow  # long tier: a worker's pre-flight refusal stays in (the env module shipping off)
def test_a_worker_without_the_mujoco_extra_is_refused_before_heatup(prefect_api, workspace, tmp_path_factory):
    pytest.importorskip("mujoco")
    elsewhere = tmp_path_factory.mktemp("worker-without-mujoco")
    (elsewhere / "no_mujoco.py").write_text(NO_MUJOCO)
    port = free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": elsewhere}
    processes = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                   "--dashboard-address", ":0"], **quiet)]
    try:
        processes.append(subprocess.Popen([DASK, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1", "--host",
                                           "127.0.0.1", "--dashboard-address", ":0", "--preload",
                                           str(elsewhere / "no_mujoco.py")], **quiet))
        overrides = {**local_overrides(workspace), "storage.shared": True, "distribution.rollout_workers": 1,
                     "distribution.scheduler_address": f"tcp://127.0.0.1:{port}"}
        state = improve("hopper-ppo", overrides, return_state=True)
    finally:
        _stop_workers_then_scheduler(processes)
    assert state.is_failed()
    assert re.search(r"env\.id: the Dask worker tcp://127\.0\.0\.1:\d+ cannot run this preset's jobs: 'Hopper-v5' "
                     r"needs a package that is not installed .*pip install 'gymflow\[mujoco\]'", state.message), \
        state.message
    assert written_files(workspace) == []


BROKEN_ENV = """
from gymflow.testing.envs import Corridor


class Stubborn(Exception):
    def __init__(self, what, why):  # pickle cannot rebuild it: its args hold one string
        super().__init__(f"{what} because {why}")


class Broken(Corridor):
    steps_in_process = 0

    def step(self, action):  # past gymflow's checks of the env (a step each), in the jobs
        Broken.steps_in_process += 1
        if Broken.steps_in_process > 10:
            raise Stubborn("the corridor caved in", "the env said so")
        return super().step(action)
"""


# default tier (one of its 25 slowest): the one test of a job's exception Dask cannot rebuild (a command that would otherwise wait forever)
def test_a_job_raising_an_exception_pickle_cannot_rebuild_fails_the_run_in_one_line_within_60_s(prefect_api, tmp_path):
    """As the run's first jobs start, not after their deadline (rollout_timeout_s, 600 s, three
    times): Dask's own reading of such an error would never answer the call. 60 s is the command's
    start and more: 13 s on the slowest machines here with a temporary API of its own, 31 s seen in
    CI; the command is pointed at this process's API (a temporary one of its own: test_what_users_see)."""
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gymflow.flows.cli", "run", "cartpole-ppo", "--quiet",
                           "--set", "env.id=broken_env:Broken", "--set", "distribution.rollout_workers=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 60
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "Failed to deserialize" not in output, output[-3000:]
    assert re.search(r"^gymflow: error: rollout job \S+ on the Dask worker tls://127\.0\.0\.1:\d+: Stubborn: the corridor "
                     r"caved in because the env said so$", done.stderr, re.MULTILINE), done.stderr[-3000:]


def test_shipped_code_reaches_a_worker_that_joins_later_and_leaves_with_the_run(dask_cluster, workspace,
                                                                                 working_folder_env):
    from gymflow.tasks.cluster.shipping import ShippedCode, code_shipped

    def _imports_my_corridor() -> bool:  # local: travels by value (the workers cannot import tests/)
        import importlib

        return importlib.import_module("my_corridor").MyCorridor.__name__ == "MyCorridor"

    address, workers = dask_cluster
    clients = [Client(address, timeout=30)]
    with code_shipped(lambda: clients[-1], [workspace / "my_corridor.py"]):
        client = clients[0]
        assert all(client.run(_imports_my_corridor).values())
        joined = subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                                   "--dashboard-address", ":0", "--name", "joined-later"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(len(workers) + 1, timeout=60)
            (newcomer,) = [worker for worker, info in client.scheduler_info(n_workers=-1)["workers"].items()
                           if info["name"] == "joined-later"]
            assert client.run(_imports_my_corridor, workers=[newcomer])[newcomer]
        finally:
            joined.terminate()
            joined.wait(timeout=30)
        # a run's scheduler link made a new client (the scheduler was lost and came back): the old one
        # is closed, and the code leaves through the new one
        clients.append(Client(address, timeout=30))
        client.close()
    clients[-1].close()
    with Client(address, timeout=30) as client:
        assert not any(client.run(lambda: "my_corridor" in sys.modules).values())
        assert ShippedCode.name not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))


def test_a_closing_worker_drops_only_the_heartbeat_failure_its_own_close_causes():
    """A LocalCluster worker's preload: the heartbeat a worker cuts short by closing is not
    logged; while it runs, a failed heartbeat is (tasks/cluster/local_worker.py)."""
    import logging

    from distributed import LocalCluster

    from gymflow.tasks.cluster.local_worker import HEARTBEAT_CUT, HeartbeatCutByClose

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, message, None, None)

    cluster = LocalCluster(n_workers=1, processes=False, dashboard_address=None)
    (worker,) = cluster.workers.values()
    cut = HeartbeatCutByClose(worker)
    assert cut.filter(record(f"{HEARTBEAT_CUT}."))  # a running worker's failed heartbeat is news
    cluster.close()
    assert not cut.filter(record(f"{HEARTBEAT_CUT}."))
    assert cut.filter(record("Heartbeat to scheduler failed"))  # anything else a closed worker says is kept


def test_an_adaptive_cluster_class_runs_as_a_scaled_one(prefect_api, workspace, tiny_budget):
    """`distribution.adaptive`: Dask adapts the cluster class between 1 and 2 workers (retiring
    idle ones, whose jobs are sent again); the SYNC run ends with the same weights as on the
    run's LocalCluster."""
    from gymflow.tasks.storage.checkpoints import read_policy

    run = {**tiny_budget, **local_overrides(workspace), "storage.shared": True, "schedule.total_env_steps": 2560}
    clean = improve("cartpole-ppo", {**run, "storage.root": str(workspace / "clean")})
    adaptive = improve("cartpole-ppo", {
        **run, "storage.root": str(workspace / "adaptive"), "distribution.cluster_class": "distributed.LocalCluster",
        "distribution.cluster_kwargs": {"n_workers": 0, "threads_per_worker": 1, "processes": True,
                                        "dashboard_address": ":0"},
        "distribution.adaptive": {"minimum": 1, "maximum": 2}})
    assert 1 <= len(_pids(adaptive)) and adaptive.versions_committed == clean.versions_committed
    final = clean.versions_committed - 1
    policies = [read_policy(Storage(StorageLocation(str(workspace / name))), RunLayout(summary.run_id), final)
                for name, summary in (("clean", clean), ("adaptive", adaptive))]
    assert policies[0] == policies[1]


def test_adaptive_without_a_cluster_class_is_refused_in_one_line(workspace):
    with pytest.raises(InvalidPreset, match="^distribution.adaptive: adapts a cluster the run starts: needs a "
                                            "distribution.cluster_class"):
        resolve_experiment("cartpole-ppo", {"distribution.adaptive": {"maximum": 4}})
    with pytest.raises(InvalidPreset, match="^distribution.adaptive.maximum: 1 is below minimum 2"):
        resolve_experiment("cartpole-ppo", {"distribution.cluster_class": "distributed.LocalCluster",
                                            "storage.shared": True,
                                            "distribution.adaptive": {"minimum": 2, "maximum": 1}})


def test_shipped_modules_are_forgotten_while_another_thread_of_the_worker_imports():
    """A worker forgets a run's shipped modules (its plugin's setup) while its other threads import:
    seen with two people's runs on one stack's workers at half the CPU ("dictionary changed size
    during iteration" failed the run)."""
    from gymflow.tasks.cluster.shipping import ShippedCode

    plugin, stop = ShippedCode(b"", ["gymflow_tests_shipped"]), threading.Event()

    def import_and_forget() -> None:  # as a worker's threads do: sys.modules grows and shrinks
        count = 0
        while not stop.is_set():
            sys.modules[f"gymflow_tests_churn_{count % 64}"] = types.ModuleType("churn")
            sys.modules.pop(f"gymflow_tests_churn_{(count + 32) % 64}", None)
            count += 1

    interval, churn = sys.getswitchinterval(), threading.Thread(target=import_and_forget)
    sys.setswitchinterval(1e-6)  # the other thread runs between any two steps of the forgetting
    churn.start()
    try:
        for _ in range(300):
            sys.modules["gymflow_tests_shipped.part"] = types.ModuleType("part")
            plugin._forget_modules()
            assert "gymflow_tests_shipped.part" not in sys.modules
    finally:
        stop.set()
        churn.join()
        sys.setswitchinterval(interval)
        for name in [name for name in list(sys.modules) if name.startswith("gymflow_tests_churn_")]:
            del sys.modules[name]


def test_shipped_code_removes_only_a_folder_it_unpacked(tmp_path):
    """A worker's `gymflow-shipped-code` folder is emptied for each run's code and removed after it:
    only where gymflow's marker says it unpacked it there; a folder of that name it did not make is
    refused in one line and left as it was."""
    from gymflow.errors import ClusterUnavailable
    from gymflow.tasks.cluster.shipping import SHIPPED_MARKER, ShippedCode, archive_of

    (tmp_path / "mine.py").write_text("VALUE = 1\n")
    worker = types.SimpleNamespace(local_directory=str(tmp_path / "worker"))
    plugin = ShippedCode(archive_of([tmp_path / "mine.py"]), ["mine"])
    folder = tmp_path / "worker" / "gymflow-shipped-code"
    try:
        plugin.setup(worker)
        assert (folder / "mine.py").exists() and (folder / SHIPPED_MARKER).exists()
        plugin.setup(worker)  # the next run's code replaces it
        plugin.teardown(worker)
        assert not folder.exists()
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("someone's")
        with pytest.raises(ClusterUnavailable, match=rf"^distribution.ship_paths: {folder} on the worker was not "
                                                     rf"made by gymflow \(no {SHIPPED_MARKER}\); nothing removed"):
            plugin.setup(worker)
        plugin.teardown(worker)
        assert (folder / "notes.txt").read_text() == "someone's"
    finally:
        sys.modules.pop("mine", None)
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
