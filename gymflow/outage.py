"""How long a server the run depends on (the MLflow server, the Prefect API, the object store)
has gone unanswered, against the run's budget for it (each server on a clock of its own).

A call that gets no answer (refused or cut connections, a timeout, a 5xx: the server down,
restarting, or without its database) starts the outage; the next call that is answered ends it.
Within the budget the caller tries again and the run trains on; once the outage has lasted the
budget, or at once where the server answers that what it held is gone, the server is lost: every
call from then on raises `ServerLost` at once, and the run stops at its next commit
(tasks/training/summary.py), or, for the object store, at the call that could not be made."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from gymflow.errors import ServerLost
from gymflow.presets.redaction import redacted_text

_logger = logging.getLogger(__name__)

STORE_PAUSE_S = 5.0  # the longest pause between tries of a call the object store did not answer


def store_attempt_timeouts(budget_s: float) -> dict[str, float]:
    """One attempt at the object store within its outage budget: a fifth of it for the reply (5-60 s),
    a tenth for the connection (2-10 s), so a store that accepts and never answers is lost within
    the budget and one attempt (`store_call_bound_s`)."""
    return {"connect_timeout": min(max(budget_s / 10, 2.0), 10.0), "read_timeout": min(max(budget_s / 5, 5.0), 60.0)}


def store_call_bound_s(budget_s: float) -> float:
    """How long past its outage budget a call to an object store that stopped answering goes on at
    most: the attempt under way (connection and reply) and the pause before it."""
    timeouts = store_attempt_timeouts(budget_s)
    return timeouts["connect_timeout"] + timeouts["read_timeout"] + STORE_PAUSE_S


@dataclass(frozen=True)
class Budget:
    """A server's outage budget: its seconds, the preset field that sets them, and what goes on
    while the server is out (said once, as the outage starts)."""

    seconds: float
    field: str
    meanwhile: str = "training goes on and what it records waits"


class Outage:
    """A server's current outage, shared by every thread that calls it. `where`: the server as what
    is said names it; `field`: the one its loss names."""

    def __init__(self, where: str, budget: Budget, field: str):
        self.where, self.budget, self.field = where, budget, field
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
            _logger.warning("%s answers again after %.0f s; what waited is done now", self.where,
                            time.monotonic() - since)

    def failed(self, error: BaseException, asked_at: float | None = None) -> float:
        """The seconds of the budget left after this failure of a call made at `asked_at` (its
        monotonic time; now where not given); raises ServerLost where none are left."""
        with self._lock:
            now = time.monotonic()
            if self._since is None:
                self._since = now if asked_at is None else min(asked_at, now)
                _logger.warning("%s does not answer (%s); %s, up to %s (%g s)", self.where, _reason(error),
                                self.budget.meanwhile, self.budget.field, self.budget.seconds)
            left = self._since + self.budget.seconds - now
            if left <= 0 and self.lost is None:
                self.lost = ServerLost(self.field, f"{self.where} has not answered for {self.budget.seconds:g} s "
                                       f"({self.budget.field}): {_reason(error)}")
        self.check()
        return left

    def gone(self, what: str) -> None:
        """The server answered that what the run holds there is gone: lost at once."""
        with self._lock:
            if self.lost is None:
                self.lost = ServerLost(self.field, f"{self.where} answered that {what}")


def _reason(error: BaseException) -> str:
    text = " ".join(redacted_text(str(error)).split())  # its URL may carry the login's password
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
