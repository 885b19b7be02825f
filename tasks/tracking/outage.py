"""The outages of the servers the run records to, the MLflow server and the Prefect API, each on a
clock of its own against `tracking.outage_budget_s` (gymflow/outage.py): what counts as MLflow
not answering, and each server's Outage."""

from __future__ import annotations

import re

from gymflow.outage import Budget, Outage
from gymflow.presets.redaction import without_password

FIELD = "tracking.outage_budget_s"
_ANSWERED = re.compile(r"failed with error code (?P<status>\d{3}) ")


def unanswered(error: BaseException) -> bool:
    """Whether `error` is the server not answering (no reply, or a 5xx), not a refusal of the request."""
    from mlflow.exceptions import MlflowException, RestException
    from requests import ConnectionError as Refused
    from requests import HTTPError, Timeout

    if isinstance(error, (Refused, Timeout, ConnectionError, TimeoutError)):
        return True
    if isinstance(error, HTTPError):
        return error.response is None or error.response.status_code >= 500
    if isinstance(error, RestException):
        return error.get_http_status_code() >= 500
    if isinstance(error, MlflowException):  # MLflow's own wrapping of a request: no reply, or its status
        message = str(error)
        if answered := _ANSWERED.search(message):  # "failed with error code 401 != 200": it answered
            return int(answered["status"]) >= 500
        return message.startswith("API request to") and ("failed with exception" in message
                                                         or "failed with timeout exception" in message)
    return False


def mlflow_outage(tracking_uri: str, budget_s: float) -> Outage:
    return Outage(f"the MLflow server at {without_password(tracking_uri)}", Budget(budget_s, FIELD),
                  "tracking.tracking_uri")


def prefect_outage(api_url: str, budget_s: float) -> Outage:
    return Outage(f"the Prefect API at {without_password(api_url)}", Budget(budget_s, FIELD), "PREFECT_API_URL")
