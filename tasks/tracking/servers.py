"""The team's servers checked before any work: the MLflow tracking server a run records in (it
answers, it takes the user's login, it lets them into the run's experiment) and the Prefect server
the run is orchestrated by (it answers, it takes the login). Each refusal is one line naming the
server and what it refused (a wrong password used to surface as two tracebacks after Prefect had
started the run)."""

from __future__ import annotations

import time
from base64 import b64encode
from typing import Any

from gymflow.errors import ServerRefused
from gymflow.presets.redaction import without_password

CHECK_TIMEOUT_S = 10.0  # a server that answers nothing in this long is reported, not waited on
# a server that answers 503 (it is up, its database is not, for a restart's seconds) is asked again this long
# before the run is refused: a sweep's run starting as the team's database restarts waits, as one running does
UNAVAILABLE_WAIT_S = 30.0


def is_tracking_server(tracking_uri: str) -> bool:
    """An MLflow tracking server's URI (http or https), not a store of this machine's."""
    return tracking_uri.startswith(("http://", "https://"))


def basic_authorization(user_and_password: str) -> str:
    """The Authorization header's value for HTTP basic auth of "user:password"."""
    return "Basic " + b64encode(user_and_password.encode()).decode()


def check_tracking_server(tracking_uri: str, experiment: str) -> None:
    """Raise ServerRefused unless the MLflow server at `tracking_uri` (http or https; nothing to
    check for a local store) answers, takes the login the environment gives (MLFLOW_TRACKING_USERNAME
    and _PASSWORD, or _TOKEN) and lets that user into `experiment` (or it does not exist yet: the
    run makes it)."""
    if not is_tracking_server(tracking_uri):
        return
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    where, creds = f"the MLflow server at {without_password(tracking_uri)}", get_default_host_creds(tracking_uri)
    who = f"user {creds.username!r}" if creds.username else "a request without a login"
    waited_until = time.monotonic() + UNAVAILABLE_WAIT_S
    while True:
        try:
            answer = http_request(creds, "/api/2.0/mlflow/experiments/get-by-name", "GET", max_retries=0,
                                  timeout=CHECK_TIMEOUT_S, raise_on_status=False,
                                  params={"experiment_name": experiment})
        except (MlflowException, requests.RequestException, OSError) as error:
            raise ServerRefused("tracking.tracking_uri", f"{where} did not answer: {_reason(error)}") from None
        if answer.status_code != 503 or time.monotonic() > waited_until:
            break
        time.sleep(1.0)  # up but without its database for a moment (a restart, a failover): asked again
    if answer.status_code == 401:
        raise ServerRefused("tracking.tracking_uri", _refused_login(where, creds.username, "MLFLOW_TRACKING_USERNAME",
                                                                    "MLFLOW_TRACKING_PASSWORD"))
    if answer.status_code == 403:
        raise ServerRefused("tracking.experiment", f"{where} refused {who} access to experiment {experiment!r} "
                            "(403 Permission denied); ask its owner for EDIT permission, or name one of your own")
    if answer.status_code >= 400 and answer.status_code != 404:  # 404: no such experiment yet
        raise ServerRefused("tracking.tracking_uri", f"{where} answered {answer.status_code}: "
                            f"{answer.text.strip()[:200]}")
    if answer.status_code == 200:
        _check_writable(creds, answer.json()["experiment"], where, who)


def _check_writable(creds: Any, experiment: dict, where: str, who: str) -> None:
    """A run writes into its experiment: the user may, where the server takes the experiment's kind
    tag set again to the value it has (or to what the run would set, where it has none)."""
    from mlflow.utils.rest_utils import http_request

    from gymflow.tasks.tracking.tracker import EXPERIMENT_KIND, MODEL_TRAINING

    tags = {tag["key"]: tag["value"] for tag in experiment.get("tags", [])}
    answer = http_request(creds, "/api/2.0/mlflow/experiments/set-experiment-tag", "POST", max_retries=0,
                          timeout=CHECK_TIMEOUT_S, raise_on_status=False,
                          json={"experiment_id": experiment["experiment_id"], "key": EXPERIMENT_KIND,
                                "value": tags.get(EXPERIMENT_KIND, MODEL_TRAINING)})
    if answer.status_code == 403:
        raise ServerRefused("tracking.experiment", f"{where} lets {who} read experiment {experiment['name']!r} but "
                            "not run in it (403 Permission denied); ask its owner for EDIT permission, or name one "
                            "of your own")


def check_prefect_server(api_url: str, auth_string: str | None, api_key: str | None) -> None:
    """Raise ServerRefused unless the Prefect server at `api_url` answers and takes the login
    (PREFECT_API_AUTH_STRING "user:password" for a self-hosted server's basic auth, PREFECT_API_KEY
    for Prefect Cloud). Its /health answers anyone; /admin/version asks for the login (any other
    answer than 401 or 403 is the server's: a Cloud workspace may not serve it)."""
    import httpx

    headers = {}
    if auth_string:
        headers["Authorization"] = basic_authorization(auth_string)
    elif api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    where = f"the Prefect server at {without_password(api_url)}"
    try:
        answer = httpx.get(f"{api_url.rstrip('/')}/admin/version", headers=headers, timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise ServerRefused("PREFECT_API_URL", f"{where} did not answer: {_reason(error)}") from None
    if answer.status_code == 401:
        user = auth_string.partition(":")[0] if auth_string else None
        raise ServerRefused("PREFECT_API_AUTH_STRING", _refused_login(where, user, "PREFECT_API_AUTH_STRING"))
    if answer.status_code == 403:
        raise ServerRefused("PREFECT_API_KEY", f"{where} refused this login (403 Forbidden)")


def refusal_of(error: Exception, tracking_uri: str, experiment: str) -> ServerRefused | None:
    """A tracking server's refusal (401, 403) of what a run asked of it, as one line; None for any other error."""
    from mlflow.exceptions import MlflowException

    if not isinstance(error, MlflowException) or error.get_http_status_code() not in (401, 403):
        return None
    where = f"the MLflow server at {without_password(tracking_uri)}"
    said = error.message.partition("Response body: ")[2].strip(" '") or error.message
    return ServerRefused("tracking.experiment", f"{where} refused a change to experiment {experiment!r} "
                         f"({error.get_http_status_code()}: {' '.join(said.split())[:120]}); ask its owner for EDIT "
                         "permission, or name one of your own")


def _refused_login(where: str, user: str | None, *settings: str) -> str:
    if user:
        return f"{where} refused the login of user {user!r} (401 Unauthorized): check {settings[-1]}"
    return f"{where} asks for a login (401 Unauthorized): set {' and '.join(settings)}"


def _reason(error: BaseException) -> str:
    """The innermost cause's words, on one line (requests nests them three deep)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (" ".join(str(error).split()) or type(error).__name__)[:200]
