"""Where a person sees a run in MLflow's UI: the run's page in the model-training view, and the
experiment's runs with their returns as columns (a saved view gymflow keeps on each experiment it
records in, listed under the runs table's "Views"). Every link gymflow prints is one of these."""

from __future__ import annotations

import json

from gymflow.commands import installed_command
from gymflow.tasks.tracking.servers import is_tracking_server

# MLflow 3's UI opens experiments in its GenAI view unless a link asks for model training
_MODEL_TRAINING = "workflowType=machine_learning"
# A saved view of the runs table is the experiment tag mlflow.sharedViewState.<id>; its state is the
# table's (selected columns as MLflow names them: `metrics.`<key>``); a link opens it with viewStateShareKey
RUNS_BY_RETURN = "gymflow-returns"
SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
BEST_RETURN = "summary/best_return"
RETURN_COLUMNS = ("summary/final_return", BEST_RETURN, "eval/return_mean")
# The run's return as its first tag, which a run's page shows above the fold: the newest evaluation's while
# it trains, the delivered version's once it is delivered
RETURN_TAG = "gymflow.return"
NOT_EVALUATED = "not evaluated yet"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store


def runs_by_return_view(now_ms: int) -> tuple[str, str]:
    """The saved view's experiment tag: the runs table with the return columns, the preset and the models."""
    returns = [f"metrics.`{key}`" for key in RETURN_COLUMNS]
    columns = [*returns, "tags.`gymflow.preset`", "attributes.`Models`"]
    # the returns right after the run's name: the table is narrow beside MLflow's assistant panel
    order = ["attributes.`Run Name`", *returns, "runDateAndNestInfo", "duration", *columns[len(returns):]]
    # each return column's whole name (`summary/final_return`), and the two runs' returns beside a run's name (its
    # preset and time) in the table's first screen, which MLflow's assistant panel narrows to ~700 px at 1280
    widths = {"attributes.`Run Name`": 190} | dict.fromkeys(returns, 135)
    state = {"selectedColumns": columns, "columnOrder": order, "columnWidths": widths,
             "orderByKey": f"metrics.`{BEST_RETURN}`", "orderByAsc": False}  # the best runs first
    envelope = {"name": "gymflow: returns", "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)}
    return SAVED_VIEW_PREFIX + RUNS_BY_RETURN, json.dumps(envelope)


def run_page(experiment_id: str, mlflow_run_id: str) -> str:
    return f"#/experiments/{experiment_id}/runs/{mlflow_run_id}?{_MODEL_TRAINING}"


def runs_page(experiment_id: str) -> str:
    return f"#/experiments/{experiment_id}/runs?viewStateShareKey={RUNS_BY_RETURN}&{_MODEL_TRAINING}"


def ui_url(tracking_uri: str, page: str) -> str:
    """A page's address: on the tracking server, or on `mlflow ui` serving a local store."""
    base = tracking_uri.rstrip("/") if is_tracking_server(tracking_uri) else LOCAL_UI
    return f"{base}/{page}"


def served_by(tracking_uri: str) -> str:
    """What to add after a page's address: the command that serves a local store's UI ("" where a
    tracking server serves its own)."""
    if is_tracking_server(tracking_uri):
        return ""
    serve = f"`{installed_command('mlflow')} ui --backend-store-uri {tracking_uri}`"
    if not mlflow_ui_installed():  # gymflow alone: MLflow's client; its UI is the ui extra, the full package
        return f" (once `{installed_command('pip')} install 'mlflow>=3'` adds MLflow's UI and {serve} serves it)"
    return f" (once {serve} serves it)"


def mlflow_ui_installed() -> bool:
    """Whether MLflow's web UI is installed (the full `mlflow` package, gymflow's ui extra), not its
    client alone (`mlflow-skinny`, what gymflow needs to record runs)."""
    from importlib import metadata

    try:
        metadata.version("mlflow")
    except metadata.PackageNotFoundError:
        return False
    return True


def where_to_see(tracking_uri: str, page: str) -> str:
    """A page's address for a person, with the command that serves it where the store is local."""
    return ui_url(tracking_uri, page) + served_by(tracking_uri)


def return_words(mean_return: float, version: int, best: float, delivered: bool = False) -> str:
    """The return tag's value, short enough for the run page's tag chip (4 significant digits):
    `478.1, v7 delivered` (the best evaluated version is the one delivered), or `41.6 at v231, best 478.1`
    while the run trains."""
    if delivered:
        return f"{mean_return:.4g}, v{version} delivered"
    return f"{mean_return:.4g} at v{version}, best {best:.4g}"


def flow_run_page(flow_run_id: str) -> str:
    """A flow run's page in the Prefect UI of the API this process reports to."""
    from prefect.settings import get_current_settings

    return f"{get_current_settings().ui_url}/runs/flow-run/{flow_run_id}"
