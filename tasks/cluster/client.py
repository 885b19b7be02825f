"""The Dask cluster a run fans out over: a LocalCluster of worker processes by default, an
existing scheduler address, or a cluster class started and closed for the run; and the job
hosts (tasks/cluster/hosts.py) the run keeps on its workers."""

from __future__ import annotations

import importlib
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import dask
from distributed import Client, LocalCluster
from distributed.security import Security
from distributed.utils import get_mp_context

from gymflow.agents.algorithms import ALGORITHMS
from gymflow.errors import ClusterUnavailable, InvalidPreset
from gymflow.logs import AnyLogger
from gymflow.presets.model import DistributionConfig, TLSConfig
from gymflow.presets.validate import Experiment
from gymflow.tasks.cluster.clocks import HOUSEKEEPING_CLOCKS
from gymflow.tasks.cluster.hosts import HostPool
from gymflow.tasks.cluster.rounds import check_workers
from gymflow.tasks.cluster.scheduler_link import SchedulerAddress, SchedulerLink
from gymflow.tasks.cluster.shipping import code_shipped, code_to_ship, ship_code
from gymflow.tasks.cluster.slurm import EndedJobsReplaced, jobs_waiting, slurm_cluster

CONNECT_TIMEOUT_S = 10
FIRST_WORKER_SAID_AFTER_S = 10.0  # a SLURM run that waits longer for its first worker says what the queue says


_shared_client: Client | None = None  # a sweep's LocalCluster, used by every run started in this process
_runs_on_shared_cluster = itertools.count()  # each starts on the next worker


@contextmanager
def dask_client(config: DistributionConfig, logger: AnyLogger | None = None) -> Iterator[Client]:
    """A client of the run's cluster: the scheduler the preset names, or a cluster started for the run
    (SLURM's, a cluster class's, a LocalCluster), ended with it. `logger`: where a wait is said."""
    logger = logger or logging.getLogger(__name__)
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if config.scheduler_address:
        client = _connect(config.scheduler_address, _security(config.tls))
        with client:
            _check_resources(client, config.rollout_resources, config.cluster_start_timeout_s)
            yield client
        return
    if not (config.cluster_class or config.slurm) and _shared_client is not None:
        _check_resources(_shared_client, config.rollout_resources, config.cluster_start_timeout_s)
        yield _shared_client  # one client for all: actors are bound to the client they came through
        return
    if config.slurm:
        cluster = slurm_cluster(config)  # checked against the queue; adaptive
    elif config.cluster_class:
        cluster = _cluster_class(config.cluster_class)(**config.cluster_kwargs)
        if config.adaptive:  # workers come and go with Dask's load; a job on a retired one is sent again
            cluster.adapt(minimum=config.adaptive.minimum, maximum=config.adaptive.maximum)
        else:
            cluster.scale(config.rollout_workers)
    else:
        cluster = _local_cluster(config, min(config.rollout_workers, os.cpu_count() or 1))
    # a LocalCluster's workers are reachable from here: job calls go to them directly, not
    # through the scheduler (0.9 ms a call instead of 1.7 ms here)
    direct = isinstance(cluster, LocalCluster)
    with cluster, EndedJobsReplaced(cluster, logger) if config.slurm else nullcontext(), \
            Client(cluster, direct_to_workers=direct) as client:
        _first_worker(client, config, logger)
        _check_resources(client, config.rollout_resources, config.cluster_start_timeout_s)
        yield client


def _first_worker(client: Client, config: DistributionConfig, logger: AnyLogger) -> None:
    """Wait for the cluster's first worker. A SLURM run says what the queue says of its jobs when
    one has not started within FIRST_WORKER_SAID_AFTER_S, and again when it waited in vain."""
    timeout = config.cluster_start_timeout_s
    said_after = FIRST_WORKER_SAID_AFTER_S if config.slurm else timeout
    try:
        client.wait_for_workers(1, timeout=min(said_after, timeout))
        return
    except TimeoutError:
        if config.slurm is None:
            raise
    if said_after < timeout:
        logger.info("waiting for a first SLURM worker (up to distribution.cluster_start_timeout_s, %g s): %s",
                    timeout, jobs_waiting(client.cluster))
        try:
            client.wait_for_workers(1, timeout=timeout - said_after)
            return
        except TimeoutError:
            pass
    raise ClusterUnavailable("distribution.slurm", f"no worker started within {timeout:g} s "
                             f"(distribution.cluster_start_timeout_s): {jobs_waiting(client.cluster)}") from None


@contextmanager
def shared_local_cluster(config: DistributionConfig, workers: int) -> Iterator[Client | None]:
    """One LocalCluster for every run this process starts while inside (a sweep's trials, which
    would otherwise start and stop a cluster each), when `config` asks for a LocalCluster; runs
    of presets that name a scheduler or a cluster class keep theirs."""
    global _shared_client
    if config.scheduler_address or config.cluster_class or config.slurm or config.mode == "single":
        yield None
        return
    logging.getLogger("distributed").setLevel(logging.WARNING)  # as dask_client's: its start is no news
    cluster = _local_cluster(config, min(workers, os.cpu_count() or 1))
    with cluster, Client(cluster, direct_to_workers=True) as client:
        client.wait_for_workers(1, timeout=config.cluster_start_timeout_s)
        _shared_client = client
        try:
            yield client
        finally:
            _shared_client = None


@contextmanager
def local_cluster_started_beside(config: DistributionConfig | None) -> Iterator[Callable[[], None]]:
    """The command line's run: its LocalCluster (when `config` asks for one) starts in a thread
    while the process imports the flow and its Prefect API starts, and serves the run as a shared
    cluster would (see `shared_local_cluster`). Yields the wait for it to be up; a cluster that
    fails to start is left to the run, which starts its own and reports why."""
    if config is None or config.scheduler_address or config.cluster_class or config.slurm or config.mode == "single":
        yield lambda: None
        return
    _workers_forked_with_jobs_imported()  # their fork server made here, in the main thread: deaf to Ctrl-C
    up, done = threading.Event(), threading.Event()

    def serve() -> None:  # the cluster's client lives and ends in this thread's context
        try:
            with shared_local_cluster(config, config.rollout_workers):
                up.set()
                done.wait()
        except Exception:  # noqa: BLE001 (the run starts a cluster of its own and says what fails)
            pass
        finally:
            up.set()

    serving = threading.Thread(target=serve, name="gymflow-cluster", daemon=True)
    serving.start()
    try:
        yield up.wait
    finally:
        done.set()
        serving.join()


# What a LocalCluster's workers run without (docs/cluster.md):
# - MALLOC_TRIM_THRESHOLD_=65536, which Dask sets so that workers hand freed memory back to the
#   OS. Setting it at all turns off glibc's adaptive mmap threshold: every array over 128 KB a step
#   allocates (a CNN's activations, a batch of frames) is then mapped and unmapped anew, page
#   faults included. Breakout collection ran ~27% slower with it.
# - Dask's statistical profiler, which samples every thread's stack every 10 ms on the worker's
#   event loop: a job's thread waits for the GIL meanwhile (Breakout: the event loop's CPU time
#   halved without it, and collecting inside a job came within 2-4% of a plain process).
# - Dask's busiest housekeeping clocks, in the scheduler, every worker and nanny (tasks/cluster/clocks.py):
#   a core's share every job waits on for the GIL.
WORKER_CONFIG = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                 "distributed.worker.profile.enabled": False,
                 **HOUSEKEEPING_CLOCKS}


def _local_cluster(config: DistributionConfig, workers: int) -> LocalCluster:
    _drop_dasks_malloc_trim_threshold()
    _workers_forked_with_jobs_imported()
    with _main_module_not_reimported(), dask.config.set(WORKER_CONFIG):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address="127.0.0.1:0",  # loopback only: the dashboard shows the workers' logs
            silence_logs=logging.ERROR,
            # mutual TLS, its certificates made here and handed to its workers and clients alone
            security=Security.temporary() if config.cluster_tls else None,
            resources=config.rollout_resources or None,  # its workers offer what rollouts ask for
            preload=["gymflow.tasks.cluster.local_worker"],  # signals to the flow's group are the flow's
        )


@contextmanager
def job_hosts(client: Client, experiment: Experiment, logger: AnyLogger, resume_hint: str = "") -> Iterator[HostPool]:
    """The run's job hosts on the workers offering the rollout resources, released at the end;
    on a remote cluster the user's code is shipped to the workers first (tasks/cluster/shipping.py).
    Each worker the jobs go to checks that it can make the env (`check_workers`): one that cannot
    stops the run here, before anything is written. A scheduler at `distribution.scheduler_address`
    lost mid-run is waited for (tasks/cluster/scheduler_link.py); `resume_hint` is how to continue
    the run where none comes back."""
    config = experiment.preset.distribution
    first_worker = next(_runs_on_shared_cluster) if client is _shared_client else 0
    shipped = code_to_ship(experiment.preset)
    link = None
    if config.scheduler_address:
        at = SchedulerAddress(config.scheduler_address, _security(config.tls), config.scheduler_wait_s)
        link = SchedulerLink(client, at, resume_hint, logger, on_new_scheduler=lambda new: ship_code(new, shipped))
    try:
        with code_shipped(lambda: link.client if link is not None else client, shipped):
            hosts = HostPool(client, config.rollout_resources, config.rollout_timeout_s, first_worker, link)
            hosts.start(config.rollout_workers)
            try:
                check_workers(hosts, experiment, logger)
                yield hosts
            finally:
                hosts.close()
    finally:
        if link is not None:
            link.close()  # after the shipped code is taken off through its client


def _drop_dasks_malloc_trim_threshold() -> None:
    """A Dask nanny sets its pre-spawn variables in its own process's environment, and a
    LocalCluster's nannies run in this one: after any LocalCluster not started here (a
    `cluster_class`, a notebook's own), os.environ holds MALLOC_TRIM_THRESHOLD_=65536, and the
    workers (or the fork server they come from) would inherit it. Dask's value is dropped; a
    value of your own is kept."""
    dasks = dask.config.get("distributed.nanny.pre-spawn-environ").get("MALLOC_TRIM_THRESHOLD_")
    if dasks is not None and os.environ.get("MALLOC_TRIM_THRESHOLD_") == str(dasks):
        del os.environ["MALLOC_TRIM_THRESHOLD_"]


# the jobs and what they run (torch, every algorithm's networks and policy), imported once by the server
# the workers are forked from
WORKER_PRELOAD = ["distributed", "gymflow.tasks.cluster.local_worker", "gymflow.tasks.cluster.jobs",
                  *(algorithm.module for algorithm in ALGORITHMS.values())]


def _workers_forked_with_jobs_imported() -> None:
    """LocalCluster workers start as forks of one server process that has imported Dask, torch,
    Gymnasium and gymflow's jobs, instead of each importing them anew (spawn, Dask's default:
    ~2.5 s of CPU a worker, and a nanny's restart of a killed worker pays it again). The server
    starts with the first cluster and serves every later one (and restart) of this process; a
    worker's environment variables are the server's, taken when it started.

    Only where Dask's start method was left at its default, on systems that have forkserver.
    """
    if dask.config.get("distributed.worker.multiprocessing-method") != "spawn":
        return
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})  # for this process
    get_mp_context().set_forkserver_preload(WORKER_PRELOAD)  # after Dask's own preload list: this one wins
    _fork_server_deaf_to_the_flow_s_signals()


def _fork_server_deaf_to_the_flow_s_signals() -> None:
    """The fork server started here, and, from the main thread (the command's), with SIGINT and
    SIGTERM ignored for the instant it is made: an ignored signal stays ignored through exec, and
    Python installs no handler over it, so a Ctrl-C to the flow's process group during the server's
    interpreter start or its preloads (seconds of torch) neither ends it (each nanny then logged
    "Failed to start process ... EOFError") nor reaches the workers forked from it, which ignore
    both anyway (tasks/cluster/local_worker.py). A signal mask does not last: the new interpreter
    starts with none blocked. A Ctrl-C within the instant is lost; the next one stops the run."""
    from multiprocessing import forkserver, resource_tracker

    if threading.current_thread() is not threading.main_thread():  # signal dispositions are the main thread's
        forkserver.ensure_running()
        return
    resource_tracker.ensure_running()  # (it guards its own start) outside the instant, which stays ~3 ms
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        forkserver.ensure_running()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextmanager
def _main_module_not_reimported() -> Iterator[None]:
    """While inside, processes spawned from here do not import this process's main module.

    A LocalCluster spawns its worker processes, and multiprocessing's spawn imports the parent's
    main module in each child. Here that is gymflow's CLI, a Prefect engine or a test runner:
    Prefect, MLflow and the rest, 1-3 s of start-up per worker and memory for nothing, since
    jobs reach their code by module name (tasks/cluster/jobs.py) and functions of a main module travel
    by value (cloudpickle). A worker the nanny restarts later imports it again, which is only slower.
    """
    main = sys.modules["__main__"]
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    main.__spec__ = None
    if hasattr(main, "__file__"):
        del main.__file__
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _check_resources(client: Client, resources: dict[str, float], wait_s: float) -> None:
    """Refuse a run whose rollouts ask for resources no worker offers: they would wait forever."""
    if not resources:
        return
    deadline = time.monotonic() + wait_s
    while True:
        offered = [info.get("resources", {}) for info in client.scheduler_info(n_workers=-1)["workers"].values()]
        if any(all(have.get(name, 0) >= need for name, need in resources.items()) for have in offered):
            return
        if time.monotonic() > deadline:
            raise ClusterUnavailable(
                "distribution.rollout_resources",
                f"no Dask worker offers {resources} (workers offer {offered}); start workers with "
                "`dask worker --resources NAME=AMOUNT`",
            )
        time.sleep(0.5)


def _security(tls: TLSConfig | None) -> Security | None:
    """Dask's Security for the preset's certificates; a file that is not there is refused here."""
    if tls is None:
        return None
    for name in ("ca_file", "cert_file", "key_file"):
        if not os.path.isfile(getattr(tls, name)):
            raise ClusterUnavailable(f"distribution.tls.{name}", f"no such file {getattr(tls, name)!r}")
    return Security(tls_ca_file=tls.ca_file, tls_client_cert=tls.cert_file, tls_client_key=tls.key_file,
                    require_encryption=True)


def _connect(address: str, security: Security | None) -> Client:
    if address.startswith("tls://") and security is None and not dask.config.get("distributed.comm.tls.ca-file"):
        raise ClusterUnavailable("distribution.tls", f"the scheduler {address!r} speaks TLS: give the flow's "
                                 "certificates (ca_file, cert_file, key_file)")
    try:
        return Client(address, timeout=CONNECT_TIMEOUT_S, security=security)
    except (OSError, TimeoutError) as error:
        raise ClusterUnavailable(
            "distribution.scheduler_address",
            f"no Dask scheduler answered at {address!r} within {CONNECT_TIMEOUT_S} s ({error})",
        ) from None


def _cluster_class(dotted: str) -> type:
    module_name, _, class_name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise InvalidPreset("distribution.cluster_class", f"cannot import {dotted!r}: {error}") from None
