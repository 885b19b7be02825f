"""The experience logged since the champion was made: the runs, found through MLflow, whose shards
a retraining flow's challenger can learn from offline (dataset.runs)."""

from __future__ import annotations

from dataclasses import dataclass

from mlflow.entities import Run, RunStatus
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from gymflow.errors import InvalidPreset
from gymflow.presets.load import flatten
from gymflow.presets.model import Preset
from gymflow.tasks.lake.episodes import worker_streams
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import open_storage, storage_location
from gymflow.tasks.tracking.models import ModelRef
from gymflow.tasks.tracking.store import tracking_client

RUN_ID_TAG = "gymflow.run_id"


@dataclass(frozen=True)
class LoggedExperience:
    """The runs to learn from, oldest first, and those passed over with the reason."""

    run_ids: list[str]
    passed_over: dict[str, str]  # gymflow run id: why its experience is not used


@task(name="find-logged-experience", cache_policy=NO_CACHE)
def find_logged_experience(preset: Preset, champion: ModelRef | None) -> LoggedExperience:
    """The runs of the preset's env that collected experience into its storage after `champion`'s
    version was registered (every such run when there is no champion yet), and are not running.
    Raises InvalidPreset (one line) when there is none to learn from."""
    client = tracking_client(preset.tracking.tracking_uri)
    since = int(client.get_model_version(champion.name, champion.version).creation_timestamp) if champion else 0
    storage = open_storage(storage_location(preset.storage))
    run_ids, passed_over = [], {}
    for run in _runs_started_after(client, since, preset.env.id):
        params, run_id = run.data.params, run.data.tags.get(RUN_ID_TAG)
        if run_id is None or params.get("schedule.total_env_steps") == "0":  # not gymflow's, or collected nothing
            continue
        if RunStatus.from_string(run.info.status) == RunStatus.RUNNING:
            passed_over[run_id] = "still running"
        elif params.get("storage.root") != preset.storage.root:
            passed_over[run_id] = f"its experience is under {params.get('storage.root')!r}"
        elif differing := _env_settings_differing(params, preset):
            passed_over[run_id] = f"its env differs: {', '.join(differing)}"
        elif not worker_streams(storage, RunLayout(run_id)):
            passed_over[run_id] = "no shards left (storage.keep_shards: all keeps them)"
        else:
            run_ids.append(run_id)
    if not run_ids:
        after = f"champion {champion.uri} was registered" if champion else "ever"
        raise InvalidPreset("experience", f"no run of {preset.env.id} has stored experience under "
                            f"{storage.url()} since {after}{_reasons(passed_over)}; allowed: 'collect'")
    return LoggedExperience(run_ids, passed_over)


def _env_settings_differing(params: dict[str, str], preset: Preset) -> list[str]:
    """The env settings (env.kwargs, env.hide, ...) a run's MLflow parameters give otherwise than
    `preset` (a setting the run did not log, from before it existed, counts as the same)."""
    ours = {key: str(value) for key, value in flatten({"env": preset.env.model_dump(mode="json")}).items()}
    return [f"{key}={params[key]}" for key, value in ours.items() if key in params and params[key] != value]


def _runs_started_after(client: MlflowClient, since_ms: int, env_id: str) -> list[Run]:
    """Every MLflow run of any experiment that started after `since_ms` on `env_id`, oldest first."""
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    quoted = env_id.replace("'", "\\'")
    query = f"attributes.start_time > {since_ms} and params.`env.id` = '{quoted}'"
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(experiments, query, order_by=["attributes.start_time ASC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _reasons(passed_over: dict[str, str]) -> str:
    return "".join(f" ({run_id}: {why})" for run_id, why in list(passed_over.items())[:3])
