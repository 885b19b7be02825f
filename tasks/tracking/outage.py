"""How long a server the run records to (the MLflow server, the Prefect API) has gone unanswered,
against the run's budget (`tracking.outage_budget_s`, each server on a clock of its own).

A call that gets no answer (refused or cut connections, a timeout, a 5xx: the server down,
restarting, or without its database) starts the outage; the next call that is answered ends it.
Within the budget the caller tries again and the run trains on; once the outage has lasted the
budget, or at once where the server answers that what it held is gone, the server is lost: every
call from then on raises `ServerLost` at once, and the run stops at its next commit
(tasks/training/summary.py)."""

from __future__ import annotations

import logging
import re
import threading
import time

from gymflow.errors import ServerLost
from gymflow.presets.redaction import redacted_text, without_password

FIELD = "tracking.outage_budget_s"
_ANSWERED = re.compile(r"failed with error code (?P<status>\d{3}) ")
_logger = logging.getLogger(__name__)


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


class Outage:
    """A server's current outage, shared by every thread that calls it. `where`: the server as what
    is said names it; `field`: the one its loss names."""

    def __init__(self, where: str, budget_s: float, field: str):
        self.where, self.budget_s, self.field = where, budget_s, field
        self._lock = threading.Lock()
        self._since: float | None = None
        self.lost: ServerLost | None = None

    @property
    def going_on(self) -> bool:
        return self._since is not None or self.lost is not None

    def check(self) -> None:
        """Raise at once where the server is lost."""
        if self.lost is not None:
            raise self.lost

    def answered(self) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None and self.lost is None:
            _logger.warning("%s answers again after %.0f s; what waited is written now", self.where,
                            time.monotonic() - since)

    def failed(self, error: BaseException) -> float:
        """The seconds of the budget left after this failure; raises ServerLost where none are."""
        with self._lock:
            now = time.monotonic()
            if self._since is None:
                self._since = now
                _logger.warning("%s does not answer (%s); training goes on and what it records waits, up to "
                                "%s (%g s)", self.where, _reason(error), FIELD, self.budget_s)
            left = self._since + self.budget_s - now
            if left <= 0 and self.lost is None:
                self.lost = ServerLost(self.field, f"{self.where} has not answered for {self.budget_s:g} s ({FIELD}): "
                                       f"{_reason(error)}")
        self.check()
        return left

    def gone(self, what: str) -> None:
        """The server answered that what the run holds there is gone: lost at once."""
        with self._lock:
            if self.lost is None:
                self.lost = ServerLost(self.field, f"{self.where} answered that {what}")


def mlflow_outage(tracking_uri: str, budget_s: float) -> Outage:
    return Outage(f"the MLflow server at {without_password(tracking_uri)}", budget_s, "tracking.tracking_uri")


def _reason(error: BaseException) -> str:
    text = " ".join(redacted_text(str(error)).split())  # its URL may carry the login's password
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
