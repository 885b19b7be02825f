"""A server lost for good mid-run (gymflow/outage.py): the run trains on through the outage
budget, then stops at its next commit in one line with the command that continues it; nothing it
recorded is lost, and the resumed run finishes in the same MLflow run. A real MLflow server on
loopback, a Prefect server and an S3 server (long tier), each killed as a machine that is lost
kills it; the object store's budget on a real S3 server behind a proxy that fails its requests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gymflow.errors import ServerLost
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.testing.faults import FaultyProxy
from tests.conftest import TINY_BUDGET, free_port
from tests.servers import MlflowServer, MotoServer, PrefectServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
GYMFLOW = str(Path(sys.executable).with_name("gymflow"))
BUDGET_S = 5
TOTAL, EVERY = 25_600, 2560  # 200 rounds of 128 env steps: the run is far from its end when its budget runs out


def _checkpoints(root: Path | Storage) -> int:
    if isinstance(root, Storage):
        return sum(key.endswith("/manifest.json") and "/checkpoints/" in key for key in root.list("runs"))
    return len(list(root.glob("runs/*/checkpoints/*/manifest.json")))


def _run_until_its_server_is_lost(settings: dict, root: Path | Storage, server, folder: Path,
                                  environment: dict[str, str] | None = None) -> tuple[int, str, float]:
    """`gymflow run` with `settings`, `server` killed once it has committed two checkpoints in `root`
    (a folder, or the store): its exit code, its stderr, and the seconds from the kill to its end."""
    command = [GYMFLOW, "run", "cartpole-ppo", "--quiet",
               *[part for key, value in settings.items() for part in ("--set", f"{key}={json.dumps(value)}")]]
    run = subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=environment)
    deadline = time.monotonic() + 240
    while _checkpoints(root) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
        time.sleep(0.1)
    server.kill()
    lost_at = time.monotonic()
    stderr = run.stderr.read()
    run.wait(timeout=300)
    (folder / "run.stderr").write_text(stderr)
    return run.returncode, stderr, time.monotonic() - lost_at


# default tier: the first of its capability (a server lost for good)
def test_an_mlflow_server_lost_mid_run_stops_it_in_one_line_past_its_budget_and_a_resume_loses_nothing(tmp_path):
    server, root = MlflowServer(tmp_path), tmp_path / "data"
    server.start()
    settings = {**TINY_BUDGET, "schedule.total_env_steps": TOTAL, "schedule.evaluate_every_env_steps": EVERY,
                "storage.root": str(root), "tracking.tracking_uri": server.url, "tracking.experiment": "outage",
                "tracking.outage_budget_s": BUDGET_S}
    try:
        code, stderr, ended_after = _run_until_its_server_is_lost(settings, root, server, tmp_path)
        (run_id,) = [path.name for path in (root / "runs").iterdir()]
        assert code == 2, stderr[-3000:]
        assert ended_after < BUDGET_S + 60, ended_after
        last = stderr.strip().splitlines()[-1]
        assert last.startswith(f"gymflow: error: tracking.tracking_uri: the MLflow server at {server.url} has not "
                               f"answered for {BUDGET_S} s (tracking.outage_budget_s): "), last
        assert last.endswith(f"`gymflow resume {run_id} --root {root}` continues the run once the server answers"), last
        assert "Traceback" not in stderr, stderr[-3000:]  # one line, not a wall of tracebacks

        server.start()  # back, with what it held
        resumed = subprocess.run([GYMFLOW, "resume", run_id, "--root", str(root), "--quiet"], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        from mlflow import MlflowClient

        client = MlflowClient(server.url)
        (mlflow_run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
        assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.tags["gymflow.run_id"] == run_id
        evaluations = [int(metric.step) for metric in client.get_metric_history(mlflow_run.info.run_id,
                                                                                 "eval/return_mean")]
        assert evaluations == list(range(EVERY, TOTAL + 1, EVERY)), evaluations  # the outage's too: nothing lost
        rounds = sorted({int(metric.step) for metric in client.get_metric_history(mlflow_run.info.run_id,
                                                                                   "time/env_steps")})
        assert rounds == list(range(rounds[0], TOTAL + 1, rounds[0])), rounds  # every round's, none missing
        assert not (root / "runs" / run_id / "tracking-backlog.json").exists()  # sent, then forgotten
    finally:
        server.kill()


@pytest.mark.slow  # long tier: the Prefect API's loss (the default tier's is the MLflow server's)
def test_a_prefect_api_lost_mid_run_ends_it_in_one_line_past_its_budget_and_it_resumes_under_another(tmp_path):
    """The run's Prefect server killed for good: the run trains on through the budget, then stops
    with one line (it used to go on retrying Prefect's requests for ten minutes), and resumes to its
    end under the command's own temporary API."""
    server, root = PrefectServer(tmp_path), tmp_path / "data"
    server.start()
    settings = {**TINY_BUDGET, "schedule.total_env_steps": TOTAL, "schedule.evaluate_every_env_steps": EVERY,
                "storage.root": str(root), "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                "tracking.experiment": "prefect-outage", "tracking.outage_budget_s": BUDGET_S}
    try:
        code, stderr, ended_after = _run_until_its_server_is_lost(settings, root, server, tmp_path,
                                                                  {**os.environ, "PREFECT_API_URL": server.url})
    finally:
        server.kill()
    (run_id,) = [path.name for path in (root / "runs").iterdir()]
    assert code == 2, stderr[-3000:]
    assert ended_after < BUDGET_S + 90, ended_after  # the watch's 5 s, the end's grace (60 s) at most
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"gymflow: error: PREFECT_API_URL: the Prefect API at {server.url} has not answered "
                           f"for {BUDGET_S} s (tracking.outage_budget_s): "), last
    assert f"`gymflow resume {run_id} --root {root}` continues the run" in last, last
    assert "Traceback" not in stderr, stderr[-3000:]

    environment = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    resumed = subprocess.run([GYMFLOW, "resume", run_id, "--root", str(root), "--quiet"], cwd=tmp_path,
                             env=environment, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(settings["tracking.tracking_uri"])
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("prefect-outage").experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    evaluations = {int(metric.step) for metric in client.get_metric_history(mlflow_run.info.run_id, "eval/return_mean")}
    # every one (one scored after the last checkpoint is scored again by the resume, as after a kill)
    assert sorted(evaluations) == list(range(EVERY, TOTAL + 1, EVERY)), sorted(evaluations)


# default tier: the first of its capability (a server that answers 500 to everything)
def test_a_prefect_api_answering_500_to_everything_ends_the_run_in_one_line_with_its_mlflow_run_failed(tmp_path):
    """A Prefect API whose database is gone answers 500. The run used to stop at its next commit and
    then end in Prefect's `PrefectHTTPStatusError ... 500` traceback (its engine's report of the run's
    end refused), exit 1, or with PREFECT_CLIENT_RETRY_EXTRA_CODES=500 (a team's stack sets it) minutes
    later. Now it ends within its budget and a minute, exit 2, its MLflow run FAILED, its last line
    naming the API, its budget and the command that continues it."""
    server = PrefectServer(tmp_path)
    server.start()
    settings = {**TINY_BUDGET, "schedule.total_env_steps": 256_000, "schedule.evaluate_every_env_steps": 12_800,
                "storage.root": str(tmp_path / "data"), "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                "tracking.experiment": "prefect-500", "tracking.outage_budget_s": BUDGET_S}
    try:
        with FaultyProxy(server.url.removesuffix("/api"), fault_rate=0.0, faults=("500",)) as proxy:
            switched = _Switch(proxy)
            code, stderr, ended_after = _run_until_its_server_is_lost(
                settings, tmp_path / "data", switched, tmp_path,
                {**os.environ, "PREFECT_API_URL": f"{proxy.url}/api", "PREFECT_CLIENT_RETRY_EXTRA_CODES": "500"})
    finally:
        server.kill()
    (run_id,) = [path.name for path in (tmp_path / "data" / "runs").iterdir()]
    assert code == 2 and ended_after < BUDGET_S + 60, (code, ended_after, stderr[-3000:])
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"gymflow: error: PREFECT_API_URL: the Prefect API at {proxy.url}/api has not answered "
                           f"for {BUDGET_S} s (tracking.outage_budget_s): HTTPStatusError: 500 "), last
    assert f"`gymflow resume {run_id} --root {tmp_path / 'data'}` continues the run" in last, last
    assert "Traceback" not in stderr and "Error logging to API" not in stderr, stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(settings["tracking.tracking_uri"])
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("prefect-500").experiment_id])
    assert mlflow_run.info.status == "FAILED"


class _Switch:
    """A proxy's faults switched on for good, as `_run_until_its_server_is_lost` kills a server."""

    def __init__(self, proxy: FaultyProxy):
        self.proxy = proxy

    def kill(self) -> None:
        self.proxy.fault_rate = 1.0


def test_a_deadline_that_ends_the_process_waits_for_what_holds_it():
    """A lost Prefect API's deadline (60 s) used to cut a delivery to a healthy MLflow under way, its
    MLflow run left RUNNING: what is `held` (a delivery, the MLflow run's last state) finishes first."""
    script = (
        "import sys, time\n"
        "from gymflow import last_steps\n"
        "last_steps.allow_ending()\n"
        "last_steps.end_within(0.2, 'gymflow: error: the API is lost')\n"
        "with last_steps.held('a delivery'):\n"
        "    time.sleep(1.5)\n"
        "    print('delivered', flush=True)\n"
        "time.sleep(30)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "delivered\n", done.stdout + done.stderr
    assert done.stderr.strip() == "gymflow: error: the API is lost" and time.monotonic() - started < 20


def test_only_a_server_that_does_not_answer_counts_against_the_budget():
    """No reply, a timeout or a 5xx is an outage; a refusal it answered (a 401: a login, tried again
    apart; a 404) is not."""
    import requests
    from mlflow.exceptions import MlflowException

    from gymflow.tasks.tracking.outage import unanswered

    no_reply = "API request to http://m/api/2.0/mlflow/runs/log-batch failed with exception HTTPConnectionPool"
    assert unanswered(MlflowException(no_reply)) and unanswered(requests.ConnectionError("refused"))
    assert unanswered(MlflowException("API request to http://m/x failed with timeout exception ReadTimeout."))
    assert unanswered(MlflowException("API request to endpoint /x failed with error code 503 != 200. Response body"))
    assert not unanswered(MlflowException("API request to endpoint /x failed with error code 401 != 200. Response"))
    assert not unanswered(MlflowException("RESOURCE_DOES_NOT_EXIST: Run 'abc' not found"))
    assert not unanswered(ValueError("a bug"))


@pytest.mark.slow  # long tier: the object store's loss (the default tier's is the MLflow server's)
@pytest.mark.parametrize("how", ["killed", "silent"])
def test_an_object_store_lost_mid_run_ends_it_in_one_line_past_its_budget(how, tmp_path):
    """The run's S3 server killed for good, or taking every request and never answering (on gymflow's
    default timeouts, which used to hold one call ~25 minutes): what the run reads and writes waits
    through the budget, then the run ends in one line naming the store, its budget and the command that
    continues it."""
    server = MotoServer()
    server.start()
    root = "s3://gymflow/outage"
    try:
        with FaultyProxy(server.with_bucket("gymflow").url, fault_rate=0.0, faults=("silent",)) as proxy:
            endpoint = server.url if how == "killed" else proxy.url
            settings = {**TINY_BUDGET, "schedule.total_env_steps": TOTAL, "schedule.evaluate_every_env_steps": EVERY,
                        "storage.root": root, "storage.options": {**server.options(), "endpoint_url": endpoint},
                        "storage.outage_budget_s": BUDGET_S,
                        "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
            store = Storage(StorageLocation(root, server.options()))
            lost = server if how == "killed" else _Switch(proxy)
            code, stderr, ended_after = _run_until_its_server_is_lost(settings, store, lost, tmp_path)
    finally:
        server.kill()
    assert code == 2, stderr[-3000:]
    assert ended_after < BUDGET_S + 60, ended_after
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gymflow: error: ") and "Traceback" not in stderr, stderr[-3000:]
    assert f"storage.root: the object store at {endpoint} has not answered for {BUDGET_S} s " \
           "(storage.outage_budget_s): " in last, last
    assert re.search(rf"`gymflow resume \S+ --root {root}` continues it once the store answers$", last), last


def _store(endpoint: str, budget_s: float) -> Storage:
    """A store at `endpoint` whose calls botocore tries once: each outage is the budget's to try again."""
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    return Storage(StorageLocation("s3://gymflow/data", options, budget_s))


def test_an_object_store_out_within_its_budget_is_waited_for_and_one_lost_past_it_ends_the_call_in_one_line(
        caplog):
    server = MotoServer()
    server.start()
    try:
        with FaultyProxy(server.with_bucket("gymflow").url, fault_rate=1.0, faults=("503", "reset")) as proxy:
            store = _store(proxy.url, budget_s=60)
            threading.Timer(4, setattr, (proxy, "fault_rate", 0.0)).start()  # every request failed for 4 s
            started = time.monotonic()
            store.write("runs/r1/shards/v000001/w000.npz", b"shard")
            assert time.monotonic() - started >= 4 and store.read("runs/r1/shards/v000001/w000.npz") == b"shard"
        said = [record.getMessage() for record in caplog.records if record.name == "gymflow.outage"]
        assert len(said) == 2 and "does not answer" in said[0] and "answers again after" in said[1], said

        server.kill()
        server.start()  # back without what it held: the bucket is gone, and so is the run's store
        store = _store(server.url, budget_s=300)
        started = time.monotonic()
        with pytest.raises(ServerLost, match=f"the object store at {server.url} answered that bucket 'gymflow' "
                                             "does not exist any more"):
            store.read("runs/r1/run.json")
        assert time.monotonic() - started < 5  # at once, not after the budget
    finally:
        server.kill()

    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store, started = _store(nobody, budget_s=2), time.monotonic()
    with pytest.raises(ServerLost) as lost:
        store.write("runs/r1/shards/v000001/w000.npz", b"shard")
    assert 2 <= time.monotonic() - started < 15
    assert str(lost.value).startswith(f"storage.root: the object store at {nobody} has not answered for 2 s "
                                      "(storage.outage_budget_s): EndpointConnectionError: "), lost.value
    assert str(lost.value).endswith("`gymflow resume r1 --root s3://gymflow/data` continues it once the store "
                                    "answers"), lost.value
    started = time.monotonic()
    with pytest.raises(ServerLost):  # lost: every call after it at once
        store.read("runs/r1/run.json")
    assert time.monotonic() - started < 1


# default tier: the first of its capability (a store that takes calls and never answers)
def test_a_store_that_takes_calls_and_never_answers_is_lost_within_its_budget_and_one_attempt():
    """Against a store that accepts and stays silent, one s3fs call used to make 25 requests (s3fs's 5
    retries times botocore's 5 attempts), ~25 minutes with the default timeouts: past every budget. On
    gymflow's defaults a call is now lost within its budget and one attempt, and the bucket probe at
    start refuses such a store within ~25 s."""
    from gymflow.errors import StorageRefused
    from gymflow.outage import store_call_bound_s
    from gymflow.tasks.storage.objects import check_storage

    budget_s = 10
    server = MotoServer()
    server.start()
    try:
        with FaultyProxy(server.with_bucket("gymflow").url, fault_rate=0.0, faults=("silent",)) as proxy:
            location = StorageLocation("s3://gymflow/data", {"endpoint_url": proxy.url, "key": "testing",
                                                             "secret": "testing"}, budget_s)
            check_storage(location)
            store = Storage(location)
            store.write("runs/r1/run.json", b"{}")
            proxy.fault_rate, before, started = 1.0, proxy.requests, time.monotonic()
            with pytest.raises(ServerLost) as lost:
                store.read("runs/r1/run.json")
            took = time.monotonic() - started
            assert budget_s <= took < budget_s + store_call_bound_s(budget_s), took
            assert proxy.requests - before <= 4, proxy.requests - before  # each try gymflow's, counted once
            assert str(lost.value).startswith(f"storage.root: the object store at {proxy.url} has not answered for "
                                              f"{budget_s} s (storage.outage_budget_s): ReadTimeoutError"), lost.value
            assert str(lost.value).endswith("`gymflow resume r1 --root s3://gymflow/data` continues it once the "
                                            "store answers") and "\n" not in str(lost.value), lost.value
            started = time.monotonic()
            with pytest.raises(StorageRefused, match=rf"^storage.options.endpoint_url: cannot reach {proxy.url}: "):
                check_storage(location)
            assert time.monotonic() - started < 30
    finally:
        server.kill()


def test_only_an_object_store_that_does_not_answer_counts_against_its_budget():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    from gymflow.tasks.storage.objects import BUCKET_GONE, store_unanswered

    def answered(status: int, code: str) -> OSError:
        error = OSError(code)
        error.__cause__ = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                                      "PutObject")
        return error

    assert store_unanswered(EndpointConnectionError(endpoint_url="http://s3"))
    assert store_unanswered(ReadTimeoutError(endpoint_url="http://s3"))
    assert store_unanswered(answered(503, "SlowDown")) and store_unanswered(answered(500, "InternalError"))
    assert store_unanswered(answered(404, "NoSuchBucket")) == BUCKET_GONE
    assert not store_unanswered(answered(403, "AccessDenied")) and not store_unanswered(FileNotFoundError("key"))
    assert not store_unanswered(ValueError("a bug"))


def _answering(statuses: list[int]):
    """A loopback HTTP server answering each request with the next of `statuses` (the last one again
    once they run out): an MLflow server whose database is away for a moment."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            body = b'{"error_code": "TEMPORARILY_UNAVAILABLE"}' if status == 503 else b'{"error_code": "NOT_FOUND"}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_tracking_server_without_its_database_for_a_moment_is_waited_for_at_a_run_s_start(monkeypatch):
    from gymflow.errors import ServerRefused
    from gymflow.tasks.tracking import servers

    restarting = _answering([503, 503, 404])  # the database back: no such experiment yet, the run makes it
    try:
        servers.check_tracking_server(f"http://127.0.0.1:{restarting.server_port}", "gymflow")
    finally:
        restarting.shutdown()
    monkeypatch.setattr(servers, "UNAVAILABLE_WAIT_S", 1.5)
    down = _answering([503])
    try:
        with pytest.raises(ServerRefused) as refused:
            servers.check_tracking_server(f"http://127.0.0.1:{down.server_port}", "gymflow")
    finally:
        down.shutdown()
    assert str(refused.value).startswith("tracking.tracking_uri: the MLflow server at http://127.0.0.1:")
    assert " answered 503: " in str(refused.value)
