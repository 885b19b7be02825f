from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

# torch's intra-op threads in the test processes (and the processes they start, where a run does not
# set its own count, as its learner and Dask workers do): one. Two test processes share two cores, so a
# second thread is a core the other process holds: each parallel region waits for it (a learner test took
# 0.6 s alone and 11 s beside another process at half the CPU; benchmarks/records/history.md, "The test suite in two tiers").
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite's commands on PATH, as an activated environment has them: the commands gymflow prints then
# begin `gymflow` (gymflow/commands.py; tests/test_users_env.py prints them without it on PATH)
os.environ["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", "")))

# Ctrl-C at its default in the test processes, and so in every process they start: a suite started in
# the background of a script (`make test &`, nohup) inherits SIGINT ignored, and an ignored SIGINT
# passes through exec. A `prefect worker` stops on SIGTERM by sending itself SIGINT: with SIGINT
# ignored it never stopped, and each test's worker waited out its kill (tests/prefect_workers.py).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from gymflow.flows.stopping import still_running  # noqa: F401 (the tests import it from here)
from gymflow.testing.s3 import SET_UP_REQUESTS, free_port, moto_on_loopback, user_and_bucket  # noqa: F401 (free_port: the tests import it from here)
from tests.prefect_databases import harness_databases_seeded, seed_prefect_database
from tests.shared_prefect_api import read_url
from tests.suite import ALONE_AFTER, ALONE_SET_UP, SHARED_API

# The tests' own Prefect home, before Prefect reads its settings: a test (or a command it starts)
# that makes its own temporary API never touches the developer's ~/.prefect database, which
# another Prefect version may have migrated beyond this one.
# Under pytest-xdist each worker has a home of its own: two temporary APIs on one SQLite database
# wait on each other's locks.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"gymflow-tests-prefect-{os.environ['PYTEST_XDIST_WORKER']}-")
else:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="gymflow-tests-prefect-"))


# The files that take longest in the default run, longest first (each file's tests' durations summed, beside
# the other process's load: benchmarks/records/history.md, "The test suite in two tiers"); the others follow in their order, each under
# 10 s. tests/suite.py keeps this order in the default run's two xdist processes (`--no-loadscope-reorder`; xdist's own puts
# the files with the most tests first, which left the longest, with few tests each, to the end): each
# process takes the next file as it finishes one, so the run ends on short files, not on one long file
# while the other process idles.
LONGEST_FILES = ("test_deployments.py", "test_team_stack.py", "test_network_hosts.py", "test_cluster.py", "test_offline.py",
                 "test_slurm.py", "test_lake.py", "test_s3_storage.py", "test_what_users_see.py", "test_scheduler_loss.py",
                 "test_stops.py", "test_retrain.py", "test_multi_agent.py", "test_faults.py", "test_inference.py",
                 "test_pbt.py", "test_hosts.py", "test_errors.py", "test_solves.py", "test_async.py", "test_levels.py",
                 "test_pixels.py", "test_layering.py", "test_suite_command.py", "test_agents.py", "test_resume.py",
                 "test_appo.py", "test_reference_results.py", "test_improve_flow.py", "test_results_suite.py",
                 "test_mujoco.py", "test_helper.py", "test_gpu_slot.py")


# tests/suite.py names two files in its second run's environment (the tests marked `alone`, a run it starts
# beside the first): ALONE_AFTER's exists once the first run has ended, ALONE_SET_UP's once it has reported
# SET_UP_AT % of its tests. The second run waits for them at most this long.
ALONE_WAITS_AT_MOST_S = 3 * 3600


def pytest_collection_modifyitems(items: list) -> None:
    """The longest files first, the rest in their order (the same order in every xdist process).
    In the suite's second run, a test marked `alone` is timed from its call on (its wait for the
    first run and its module's fixtures, made meanwhile, are not what its timeout bounds)."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order
    if os.environ.get(ALONE_AFTER):
        for item in items:
            if item.get_closest_marker("alone"):
                given = item.get_closest_marker("timeout")
                seconds = (given.kwargs.get("timeout") or (given.args[0] if given.args else None)) if given else None
                item.add_marker(pytest.mark.timeout(timeout=seconds, func_only=True), append=False)


@pytest.fixture(scope="session", autouse=True)
def _set_up_late_in_the_first_run():
    """In the suite's second run (tests/suite.py), the session's and modules' fixtures are made once
    the first run has reported its set-up mark (tests/suite.py's SET_UP_AT % of its tests; first among
    the session's fixtures: autouse): made at its start, its Prefect server (and then its own Prefect API) idled
    through all of it, ~3.7 CPU-s a minute together (benchmarks/records/history.md, "The test suite in two tiers")."""
    if ready := os.environ.get(ALONE_SET_UP):
        _wait_for_the_first_run(ready, "report its set-up mark")


@pytest.fixture(autouse=True)
def _after_the_first_run(request):
    """In the suite's second run (tests/suite.py), a test marked `alone` begins once the first run
    has ended: no other test's load moves its bound. Its session's and module's fixtures (a server
    with its deployment, a clean run) are made before this, late in the first run."""
    go = os.environ.get(ALONE_AFTER)
    if go and request.node.get_closest_marker("alone"):
        _wait_for_the_first_run(go, "end")


def _wait_for_the_first_run(signal_file: str, to: str) -> None:
    """Wait until tests/suite.py makes `signal_file`, its word that the first run did what `to` says."""
    deadline = time.monotonic() + ALONE_WAITS_AT_MOST_S
    while not os.path.exists(signal_file):
        if time.monotonic() > deadline:
            pytest.fail(f"the suite's first run did not {to} within {ALONE_WAITS_AT_MOST_S} s ({signal_file} never came)")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (a temporary server with its own SQLite database) for the session: the one
    tests/suite.py started for its whole run (tests/shared_prefect_api.py), else one of its own."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")  # no telemetry from a test machine
    # the loop run in-process (tests/in_process.py) makes task runs outside any flow run: their logs stay here
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # the commands this process starts with no API of their own make a temporary one on PREFECT_HOME's database
    seed_prefect_database(Path(os.environ["PREFECT_HOME"], "prefect.db"))
    if shared := os.environ.get(SHARED_API):
        with _prefect_api_at(_shared_api_url(Path(shared))):
            yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with harness_databases_seeded(), prefect_test_harness(server_startup_timeout=120):
        yield


def _shared_api_url(url_file: Path, seconds: float = 300) -> str:
    deadline = time.monotonic() + seconds
    while (url := read_url(url_file)) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"the suite's shared Prefect API did not answer within {seconds:.0f} s ({url_file})")
        time.sleep(0.1)
    return url


@contextmanager
def _prefect_api_at(url: str) -> Iterator[None]:
    """This process's flows and clients on the API at `url`, as Prefect's test harness points them
    at its own; what its log and event threads hold is sent before the session ends."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}), \
            _temporary_global_settings_context(get_settings_context()):
        try:
            yield
        finally:
            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch) -> Path:
    """An empty working folder; runs write their storage and MLflow store inside it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# A SYNC run in a second: the test corridor, 2 workers x 4 envs x 16 steps = 128 env steps a round,
# 640 in all, evaluated every 256.
# a MuJoCo preset's end-to-end run on a tiny budget: 1,024 env steps, two evaluations of 2 episodes
TINY_MUJOCO = {"distribution.rollout_workers": 2, "distribution.envs_per_worker": 2, "schedule.rollout_steps_per_env": 64,
               "schedule.total_env_steps": 1024, "schedule.evaluate_every_env_steps": 512,
               "schedule.evaluation_episodes": 2, "agent.hidden_sizes": [32, 32]}
TINY_BUDGET = {
    "env.id": "gymflow.testing.envs:Corridor",
    "distribution.rollout_workers": 2,
    "distribution.envs_per_worker": 4,
    "schedule.rollout_steps_per_env": 16,
    "schedule.total_env_steps": 640,
    "schedule.evaluate_every_env_steps": 256,
    "schedule.evaluation_episodes": 4,
    "schedule.target_return": None,
}


@pytest.fixture
def tiny_budget() -> dict:
    return dict(TINY_BUDGET)


# The run the stop drills stop (tests/test_stops.py; tests/test_deployments.py's cancellation): 100 rounds;
# stopped at its third, the resume trains the other 97 (the stop lands mid-run with seconds to spare)
STOPPED_RUN = {**TINY_BUDGET, "schedule.total_env_steps": 12_800, "schedule.evaluate_every_env_steps": 1280}


@pytest.fixture(scope="session")
def clean_stopped_run(prefect_api, tmp_path_factory) -> tuple[Path, object]:
    """cartpole-ppo on STOPPED_RUN to its end without a stop, once a test process (in the suite's
    `alone` run, made late in the first run, before its tests wait): its storage root and summary.
    A stopped run, resumed, must end with its weights."""
    from gymflow.flows.improve import improve

    folder = tmp_path_factory.mktemp("clean")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)  # what a run writes beside its store, in its own folder
        return folder / "data", improve("cartpole-ppo", {**STOPPED_RUN, **local_overrides(folder)})


@pytest.fixture
def async_budget() -> dict:
    """An ASYNC DQN run in a few seconds: 2 workers x 2 envs x 16 steps = 32 env steps a chunk,
    1,024 in all, a version every 8 gradient steps at 4 samples per insert."""
    return {
        "env.id": "gymflow.testing.envs:Corridor",
        "agent.hidden_sizes": [32],
        "agent.batch_size": 16,
        "agent.epsilon_decay_env_steps": 500,
        "distribution.mode": "async",
        "distribution.rollout_workers": 2,
        "distribution.envs_per_worker": 2,
        "distribution.samples_per_insert": 4,
        "distribution.commit_every_train_steps": 8,
        "schedule.rollout_steps_per_env": 16,
        "schedule.heatup_env_steps": 64,
        "schedule.total_env_steps": 1024,
        "schedule.evaluate_every_env_steps": 256,
        "schedule.evaluation_episodes": 4,
        "schedule.target_return": None,
    }


def local_overrides(workspace: Path) -> dict[str, str]:
    return {
        "storage.root": str(workspace / "data"),
        "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}",
    }


def prefect_events(resource_id: str, names: Iterable[str], seconds: float = 20.0, at_least: int = 0) -> list:
    """The events about `resource_id` the Prefect API holds, oldest first, once each name in
    `names` is among them and they are `at_least` many (events reach the API from the sender's
    events thread, shortly after)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventOccurredFilter, EventResourceFilter

    wanted, deadline = set(names), time.monotonic() + seconds
    while True:
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(occurred=EventOccurredFilter(since=_AN_HOUR_AGO()),
                                                  resource=EventResourceFilter(id=[resource_id])), limit=50)
        found = sorted(page.events, key=lambda event: event.occurred)
        complete = wanted <= {event.event for event in found} and len(found) >= at_least
        if complete or time.monotonic() > deadline:
            assert complete, f"{resource_id}: {[e.event for e in found]}"
            return found
        time.sleep(0.25)


def _AN_HOUR_AGO():  # noqa: N802 (read as a constant)
    import datetime

    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)


def written_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


os.environ.setdefault("MPLBACKEND", "Agg")


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    key: str
    secret: str
    bucket: str

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        return {"endpoint_url": endpoint or self.endpoint, "key": self.key, "secret": self.secret}


def intruders_let_in(address: str) -> list[str]:
    """What happens to two clients that are not the run's: one over plain tcp (no certificate), one
    with a certificate of its own CA's; each refused, or what it got in."""
    from distributed import Client
    from distributed.security import Security

    let_in = []
    intruders = [("no certificate", address.replace("tls://", "tcp://"), None)]
    if address.startswith("tls://"):
        intruders.append(("its own certificate", address, Security.temporary()))
    for name, url, security in intruders:
        try:
            with Client(url, security=security, timeout=3) as intruder:
                let_in.append(f"{name}: ran {intruder.submit(os.getpid).result(timeout=10)}")
        except (OSError, TimeoutError):
            pass  # refused
    return let_in


def running_processes() -> set[int]:
    """The ids of every process now: what a later `processes_started_since` leaves out."""
    import psutil

    return set(psutil.pids())


def processes_started_since(before: set[int], spared: Iterable[int]) -> list[str]:
    """The processes not running at `before` (`running_processes()`), this one's descendants or
    orphans, that are neither `spared` nor one of theirs (a drill's hosts): what a run left alive.
    (psutil's start times count from a boot time in whole seconds: too coarse to tell them.)"""
    import psutil

    mine = {child.pid for child in psutil.Process().children(recursive=True)}
    spared_tree: set[int] = set()
    for pid in spared:
        try:
            spared_tree |= {pid} | {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            continue
    left = []
    for process in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        info = process.info
        if info["pid"] in before or info["pid"] in spared_tree or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if info["pid"] in mine or (info["ppid"] == 1 and _started_by_this_worker(process)):
            left.append(f"{info['pid']} {' '.join((info['cmdline'] or [])[:4])}")
    return left


def _started_by_this_worker(process) -> bool:
    """Whether an orphan comes from this pytest-xdist worker's tests (it inherited the worker's
    name), not the other worker's: always, when the tests run in one process."""
    import psutil

    mine = os.environ.get("PYTEST_XDIST_WORKER")
    if mine is None:
        return True
    try:
        return process.environ().get("PYTEST_XDIST_WORKER") == mine
    except psutil.Error:
        return False


def nothing_left_within(before: set[int], spared: Callable[[], Iterable[int]], within_s: float = 10.0) -> None:
    """Wait up to `within_s` for every process started since `before` (but `spared`'s) to end."""
    deadline = time.monotonic() + within_s
    while (left := processes_started_since(before, spared())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left alive {within_s:.0f} s after the run: " + "; ".join(left)


def drill_run(workspace: Path) -> dict:
    """32 SYNC rounds of 512 steps on the test corridor (2 workers x 4 envs x 64 steps), evaluated
    every 8, MLflow in the workspace: long enough for a fault after version 4 to fall mid-run."""
    return {"env.id": "gymflow.testing.envs:Corridor", "distribution.rollout_workers": 2,
            "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 64,
            "schedule.total_env_steps": 16384, "schedule.evaluate_every_env_steps": 4096,
            "schedule.evaluation_episodes": 4, "schedule.target_return": None,
            "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}"}


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server (moto's server mode) on loopback, with IAM authentication on: only
    the access key made here is accepted, in one bucket."""

    # The first four requests (the set-up below) go unauthenticated; every later one must be signed
    # with a key the server knows.
    with moto_on_loopback({"INITIAL_NO_AUTH_ACTION_COUNT": str(SET_UP_REQUESTS)}) as endpoint:
        key, secret = user_and_bucket(endpoint, "gymflow")
        yield S3Server(endpoint, key, secret, "gymflow")
