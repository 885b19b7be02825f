"""MLflow tracking for a run: one MLflow run per flow run, logged from the flow's process only
(many writers on one SQLite file lock it). What the run records is written by a thread of the
tracker's own, so a server that does not answer for a while (tasks/tracking/outage.py) holds up
that thread, not training; what it has not written yet is `unsent()`, for the run to keep."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymflow.outage import Outage
from gymflow.tasks.tracking.outage import mlflow_outage, unanswered
from gymflow.tasks.tracking.pages import runs_by_return_view

if TYPE_CHECKING:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from gymflow.presets.model import TrackingConfig

# MLflow (~1 s to import) is imported where a tracker is made or used: importing a flow costs none of it

_BATCH = 100  # MLflow accepts at most 100 params per batch
_MAX_PENDING = 256  # queued metric batches held before waiting on the oldest
# Metrics are sent to MLflow's background logger at most this often: each batch it writes costs
# the flow's thread a few milliseconds of GIL (SQLAlchemy), so a batch per CartPole step slowed
# the next rollout's stepping by half (docs/benchmarks.md, single mode).
METRICS_EVERY_S = 2.0
_METRICS_HELD = 1000  # metrics held before they are sent, however recent the last batch
# A login the tracking server took, then refused: its auth database reconnecting in a failover
# answered 401 for a moment (docs/deploy.md, "For a team"). Tried again with backoff this long.
LOGIN_RETRY_S = 120.0
OUTAGE_PAUSE_S = 2.0  # how often a call the server did not answer is tried again
_logger = logging.getLogger(__name__)
# MLflow 3's UI opens an experiment in its GenAI view unless this tag says it is for model training
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


@dataclass(frozen=True)
class TrackerOptions:
    """A tracker's settings beyond where it logs: a new experiment's artifact location, and how long
    the server may go unanswered (tracking.outage_budget_s)."""

    artifact_location: str | None = None
    outage_budget_s: float = 300.0

    @classmethod
    def of(cls, tracking: TrackingConfig) -> TrackerOptions:
        return cls(tracking.artifact_location, tracking.outage_budget_s)


def _experiment_for_training(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The experiment's id, made where it is missing; marked for model training, with the runs-by-return
    view (tasks/tracking/pages.py), where it lacks them (a view a user saved over is theirs)."""
    view, envelope = runs_by_return_view(int(time.time() * 1000))
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name, artifact_location=artifact_location,
                                        tags={EXPERIMENT_KIND: MODEL_TRAINING, view: envelope})
    for key, value in {EXPERIMENT_KIND: MODEL_TRAINING, view: envelope}.items():
        if key not in found.tags:  # an experiment someone made without saying what for, or before the view
            client.set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


class Tracker:
    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str],
        existing_run_id: str | None = None,
        options: TrackerOptions | None = None,
    ):
        """A new MLflow run, or `existing_run_id` reopened (a resumed run logs into its own)."""
        from gymflow.tasks.tracking.store import tracking_client

        options = options or TrackerOptions()
        bounded_mlflow_requests()
        # MLflow's own "View run ... at: URL" (a password in it, where the URI has one) opens its GenAI view:
        # the run's summary prints the run's page in the model-training view instead (tasks/tracking/pages.py)
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        client, self.tracking_uri = tracking_client(tracking_uri), tracking_uri
        self.outage = mlflow_outage(tracking_uri, options.outage_budget_s)
        self.prefect_outage: Outage | None = None  # the Prefect API's, where the run is watched (prefect_watch.py)
        if existing_run_id is not None:
            run = client.get_run(existing_run_id)
            client.update_run(existing_run_id, status="RUNNING")
            client.set_tag(existing_run_id, "prefect.flow_run_id.resumed", tags.get("prefect.flow_run_id", ""))
            self.run_id, self.experiment_id = existing_run_id, run.info.experiment_id
        else:
            experiment_id = _experiment_for_training(client, experiment, options.artifact_location)
            self.run_id = client.create_run(experiment_id, run_name=run_name, tags=dict(tags)).info.run_id
            self.experiment_id = experiment_id
        self.client = PatientClient(client, self.outage)  # the login was taken: a refusal from here on may pass
        self._start_queue()

    def _start_queue(self) -> None:
        # Batches are written in order by a thread of the tracker's own, not by MLflow's
        # asynchronous logging, whose thread waits up to a second for its queue when the run ends
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gymflow-mlflow-writer")
        self._pending: deque[tuple[Future, Unsent]] = deque()  # what was handed to the writer, with what it writes
        self._held: list[Metric] = []  # metrics not yet handed over
        self._sent_at = time.monotonic()
        self._newest_step: int | None = None
        self._newest: dict[str, Metric] = {}  # the metrics logged at the newest step, by key

    def _write_batch(self, **batch: Any) -> None:
        unsent = Unsent(metrics=tuple(batch.get("metrics", ())), params=tuple(batch.get("params", ())))
        self._pending.append((self._writer.submit(self.client.log_batch, self.run_id, **batch), unsent))

    def send_again(self, unsent: Unsent, read: Callable[[str], bytes]) -> None:
        """What an earlier process of the run had not written (`unsent()`, kept with a checkpoint),
        written now; `read` gives a film's bytes from its storage key."""
        for start in range(0, len(unsent.params), _BATCH):
            self._write_batch(params=list(unsent.params[start : start + _BATCH]))
        for start in range(0, len(unsent.metrics), 1000):
            self._write_batch(metrics=list(unsent.metrics[start : start + 1000]))
        for key, folder, name in unsent.films:
            self.log_bytes(read(key), folder, name, source=key)
        self.flush()

    def unsent(self) -> Unsent:
        """What was logged and is not known to be written (the newest may be written meanwhile: a
        resume sends it again, and MLflow keeps one row of a metric logged twice alike)."""
        waiting = [unsent for future, unsent in self._pending if not future.done() or future.exception() is not None]
        return Unsent(tuple(self._held) + tuple(m for unsent in waiting for m in unsent.metrics),
                      tuple(film for unsent in waiting for film in unsent.films),
                      tuple(param for unsent in waiting for param in unsent.params))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Written by the tracker's writer thread, before any metric logged after them (the first
        training round does not wait for a few hundred rows of SQLite); `flush` waits for them."""
        from mlflow.entities import Param

        items = [Param(key, str(value)[:6000]) for key, value in params.items()]
        for start in range(0, len(items), _BATCH):
            self._write_batch(params=items[start : start + _BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Held, then written by the tracker's writer thread in batches of about METRICS_EVERY_S,
        off the training loop's path; `flush` writes what is held."""
        from mlflow.entities import Metric

        timestamp = _now_ms()
        logged = [Metric(key, float(value), timestamp, step) for key, value in metrics.items() if math.isfinite(value)]
        self._held += logged
        if self._newest_step is None or step > self._newest_step:
            self._newest_step, self._newest = step, {}
        if step == self._newest_step:
            self._newest |= {metric.key: metric for metric in logged}
        if len(self._held) >= _METRICS_HELD or time.monotonic() - self._sent_at >= METRICS_EVERY_S:
            self.send()

    def send(self) -> None:
        """Hand the metrics held so far to the writer thread now."""
        held, self._held, self._sent_at = self._held, [], time.monotonic()
        for start in range(0, len(held), 1000):  # MLflow's most metrics a batch
            self._write_batch(metrics=held[start : start + 1000])
        # long runs: hold a bounded queue, the oldest long written (not while the server is out: training goes on)
        while len(self._pending) > _MAX_PENDING and not self.outage.going_on:
            self._pending.popleft()[0].result()

    def metrics_at(self, step: int) -> list[Metric]:
        """The metrics this tracker logged at `step`, where it is the newest step it logged; else none."""
        return list(self._newest.values()) if step == self._newest_step else []

    def link_metrics(self, metrics: Sequence[Metric], model_id: str) -> None:
        """`metrics` linked to a logged model (what MLflow's `Model.log(step=)` does by reading the
        history of every metric of the run: one request a key through a tracking server)."""
        from mlflow.entities import Metric

        self.flush()
        linked = [Metric(m.key, m.value, m.timestamp, m.step, run_id=self.run_id, model_id=model_id) for m in metrics]
        for start in range(0, len(linked), 1000):
            self.client.log_batch(self.run_id, metrics=linked[start : start + 1000])

    def metric_rows(self, keys: Sequence[str]) -> list[dict[str, float]]:
        """What was logged so far, one dict per step (with 'time/env_steps'), for the given keys."""
        self.flush()
        rows: dict[int, dict[str, float]] = {}
        for key in (*keys, "time/env_steps"):
            for metric in self.client.get_metric_history(self.run_id, key):
                rows.setdefault(metric.step, {})[key] = metric.value
        return [rows[step] for step in sorted(rows) if "time/env_steps" in rows[step]]

    def evaluation_rows(self) -> list[tuple[int, float, float, float, int | None]]:
        """(env steps, mean, min, max, policy version) of every evaluation logged so far."""
        self.flush()
        mean, low, high, version = ({step: m.value for step, m in history.items()}
                                    for history in evaluation_histories(self.client, self.run_id))
        return [(step, mean[step], low[step], high[step], int(version[step]) if step in version else None)
                for step in sorted(mean)]

    def describe(self, markdown: str) -> None:
        """The run's description in the MLflow UI."""
        from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE

        self.client.set_tag(self.run_id, MLFLOW_RUN_NOTE, markdown)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def tag_later(self, tags: Mapping[str, str]) -> None:
        """Tags written by the writer thread, in order with the metrics (training does not wait on them;
        one a server lost does not get is not kept for a resume: the next one says it again)."""
        from mlflow.entities import RunTag

        self._write_batch(tags=[RunTag(key, value) for key, value in tags.items()])

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        if os.path.isdir(local_path):
            self.client.log_artifacts(self.run_id, local_path, artifact_path)
        else:
            self.client.log_artifact(self.run_id, local_path, artifact_path)

    def log_bytes(self, data: bytes, artifact_path: str, name: str, source: str | None = None) -> None:
        """`data` as the artifact `artifact_path/name`, written by the writer thread after what was
        logged before it; `source`: where the run keeps it (its storage key), for `unsent()`."""
        unsent = Unsent(films=((source, artifact_path, name),) if source else ())
        self._pending.append((self._writer.submit(self._log_bytes_now, data, artifact_path, name), unsent))

    def _log_bytes_now(self, data: bytes, artifact_path: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, name)
            with open(path, "wb") as handle:
                handle.write(data)
            self.client.log_artifact(self.run_id, path, artifact_path)

    def flush(self) -> None:
        """Wait until everything logged so far is written (raises ServerLost past the outage budget)."""
        self.send()
        while self._pending:
            self._pending[0][0].result()
            self._pending.popleft()

    def written_or_out(self) -> bool:
        """Wait until everything logged so far is written (True), or until the server is seen not
        to answer (False: what it has not got is `unsent()`)."""
        self.send()
        while self._pending:
            future = self._pending[0][0]
            while not future.done():
                if self.outage.going_on:
                    return False
                wait([future], timeout=0.2)
            if self.outage.going_on:
                return False
            future.result()
            self._pending.popleft()
        return True

    def finish(self, status: str) -> None:
        """End the MLflow run as FINISHED, FAILED or KILLED; with a server that is lost, nothing is
        asked of it (the run's end is not held up for another budget)."""
        if self.outage.lost is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)
            return
        try:
            self.flush()
        finally:
            self._writer.shutdown()
        self.client.set_terminated(self.run_id, status)


# MLflow's client tries a request that got no answer again for minutes on its own (7 retries, backoff
# factor 2), and waits 120 s for a reply: an outage would hold a call that long before the tracker's
# budget (tasks/tracking/outage.py) could count it. These keep each call short; the budget tries again.
MLFLOW_REQUEST_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                           "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def bounded_mlflow_requests() -> None:
    """MLflow's request retries and timeout kept short in this process (a user's own settings stay),
    and urllib3's line for each retry off the terminal: the tracker says an outage once."""
    for name, value in MLFLOW_REQUEST_DEFAULTS.items():
        os.environ.setdefault(name, value)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def source_tags() -> dict[str, str]:
    """Who started a run, from what and at which commit: MLflow's own context tags (user, entry
    point, its git repository), or the working folder's git commit where the entry point is in
    no repository."""
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils.git_utils import get_git_branch, get_git_commit, get_git_repo_url
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT, MLFLOW_GIT_REPO_URL

    tags = resolve_tags()
    if MLFLOW_GIT_COMMIT not in tags and (commit := get_git_commit(os.getcwd())):
        found = {MLFLOW_GIT_COMMIT: commit, MLFLOW_GIT_BRANCH: get_git_branch(os.getcwd()),
                 MLFLOW_GIT_REPO_URL: get_git_repo_url(os.getcwd())}
        tags |= {key: value for key, value in found.items() if value}
    return tags


@contextmanager
def s3_artifact_environment(storage_options: Mapping[str, Any]) -> Iterator[None]:
    """MLflow reaches S3 through boto3, configured by environment variables. Fill in those the
    storage options imply (endpoint, credentials) where the environment does not set them."""
    implied = {
        "MLFLOW_S3_ENDPOINT_URL": storage_options.get("endpoint_url"),
        "AWS_ACCESS_KEY_ID": storage_options.get("key"),
        "AWS_SECRET_ACCESS_KEY": storage_options.get("secret"),
        "AWS_SESSION_TOKEN": storage_options.get("token"),
    }
    added = {name: str(value) for name, value in implied.items() if value and name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@dataclass(frozen=True)
class Unsent:
    """What a tracker was given and has not written: metrics, films (their storage key, artifact
    folder and name) and params."""

    metrics: tuple[Metric, ...] = ()
    films: tuple[tuple[str, str, str], ...] = ()
    params: tuple[Param, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.metrics or self.films or self.params)

    def to_json(self) -> bytes:
        return json.dumps({"metrics": [[m.key, m.value, m.timestamp, m.step] for m in self.metrics],
                           "films": [list(film) for film in self.films],
                           "params": [[param.key, param.value] for param in self.params]}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Unsent:
        from mlflow.entities import Metric, Param

        kept = json.loads(data)
        return cls(tuple(Metric(key, float(value), int(timestamp), int(step)) for key, value, timestamp, step
                         in kept["metrics"]), tuple((key, folder, name) for key, folder, name in kept["films"]),
                   tuple(Param(key, value) for key, value in kept.get("params", [])))


class PatientClient:
    """An MlflowClient whose calls are tried again (`patiently`) while the server refuses a login it
    took, and while it does not answer, within the run's outage budget (`outage`)."""

    def __init__(self, client: MlflowClient, outage: Outage | None = None):
        self.inner, self.outage = client, outage

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        return functools.partial(patiently, attribute, outage=self.outage) if callable(attribute) else attribute


def patiently(call: Any, *args: Any, outage: Outage | None = None, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, tried again with backoff for up to LOGIN_RETRY_S while the tracking
    server answers 401 (MLflow's own client tries 5xx answers and refused connections again, for
    minutes, but not a refused login), and while it does not answer, until `outage` says it is lost."""
    if outage is not None:
        outage.check()
    deadline, pause, refused = time.monotonic() + LOGIN_RETRY_S, 0.5, None
    while True:
        try:
            result = call(*args, **kwargs)
        except Exception as error:
            if outage is not None and unanswered(error):
                time.sleep(min(OUTAGE_PAUSE_S, max(0.0, outage.failed(error))))  # raises once it is lost
                continue
            if not _refused_login(error) or time.monotonic() + pause > deadline:
                raise
            if refused is None:
                refused = time.monotonic()
                _logger.warning("the MLflow server refused the login it took (401); trying again for up to %.0f s",
                                LOGIN_RETRY_S)
            time.sleep(pause)
            pause = min(2 * pause, 5.0)
            continue
        if refused is not None:
            _logger.warning("the MLflow server took the login again after %.1f s", time.monotonic() - refused)
        if outage is not None:
            outage.answered()
        return result


def _refused_login(error: Exception) -> bool:
    from mlflow.exceptions import MlflowException
    from requests import HTTPError

    if isinstance(error, MlflowException):
        return error.get_http_status_code() == 401
    return isinstance(error, HTTPError) and error.response is not None and error.response.status_code == 401


def _now_ms() -> int:
    return int(time.time() * 1000)


def evaluation_histories(client: MlflowClient, run_id: str) -> list[dict[int, Metric]]:
    """The run's logged evaluations by env steps, as MLflow keeps them (value and timestamp): the
    greedy return's mean, min and max, and the policy version scored, in that order."""
    return [{metric.step: metric for metric in client.get_metric_history(run_id, key)}
            for key in ("eval/return_mean", "eval/return_min", "eval/return_max", "eval/policy_version")]
