"""The flow's link to a Dask scheduler it does not own (`distribution.scheduler_address`), made
anew when that scheduler is lost: killed with its node, or restarted by a supervisor at the same
address.

Dask's client notices a closed connection at once and tries to reconnect for its connect timeout
(10 s), then closes itself; its futures, the run's job hosts (actors) among them, are gone
either way, and the workers of a new scheduler are new processes. The link waits up to
`distribution.scheduler_wait_s` for a scheduler to answer at the address: Dask's own reconnect,
which it lets end, then clients of its own (so it waits at least Dask's 10 s). It gives a new
scheduler what the run registered on the old one (the shipped code) and hands the client to the
job hosts, which start anew and send the jobs that were in flight again (tasks/cluster/hosts.py).
Past the wait the run stops in one line naming the address and the `gymflow resume` command:
what was committed stays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from distributed import Client
from distributed.client import ClosedClientError
from distributed.security import Security

from gymflow.errors import ClusterUnavailable
from gymflow.logs import AnyLogger

POLL_S = 0.25
CONNECT_ATTEMPT_S = 5.0  # one try of a new client; tried again until the run's wait is over

# What the client's calls raise while its scheduler is gone: a closed connection (OSError), a
# client that gave up (ClosedClientError), an empty identity while reconnecting (KeyError: 'workers').
SCHEDULER_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError, KeyError, ClosedClientError)


class DasksReconnectVerdict(logging.Filter):
    """Drops the client's "Failed to reconnect to scheduler after 10.00 seconds, closing client":
    the run goes on waiting, and says so itself (one line when lost, one when back or given up)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to reconnect to scheduler")


_dasks_verdict = DasksReconnectVerdict()
_links_open = 0  # the links that want the verdict dropped: two sweep members' runs share the filter
_links_lock = threading.Lock()


def _drop_dasks_verdict(links: int) -> None:
    """Count `links` (1: one more open, -1: one closed); the filter is on while any is open."""
    global _links_open
    with _links_lock:
        _links_open += links
        client_log = logging.getLogger("distributed.client")
        if _links_open > 0:
            client_log.addFilter(_dasks_verdict)  # once: a logger keeps one of each filter
        else:
            client_log.removeFilter(_dasks_verdict)


@dataclass(frozen=True)
class SchedulerAddress:
    """Where a run's scheduler answers, how to talk to it, and how long to wait for it when lost."""

    address: str
    security: Security | None
    wait_s: float


class SchedulerLink:
    """A client of the scheduler at an address, replaced when the scheduler is lost (see the module)."""

    def __init__(self, client: Client, at: SchedulerAddress, resume_hint: str, logger: AnyLogger,
                 on_new_scheduler: Callable[[Client], None] = lambda client: None):
        self.client, self.address, self.security, self.wait_s = client, at.address, at.security, at.wait_s
        self.resume_hint, self.logger = resume_hint, logger
        self.on_new_scheduler = on_new_scheduler
        self.scheduler_id = scheduler_id(client)
        self._made: list[Client] = []  # clients made here (the first is its owner's to close)
        _drop_dasks_verdict(+1)

    def answers(self) -> bool:
        """The client is connected to the scheduler it started with."""
        try:
            return self.client.status == "running" and scheduler_id(self.client) == self.scheduler_id
        except SCHEDULER_ERRORS:
            return False

    def reconnect(self) -> Client:
        """A client of a scheduler answering at the address now, waiting up to `wait_s` for one;
        raises a one-line `ClusterUnavailable` past it."""
        started = time.monotonic()
        self.logger.warning("the Dask scheduler at %s was lost; waiting up to %.0f s for one to answer there "
                            "(distribution.scheduler_wait_s)", self.address, self.wait_s)
        while (client := self._connected(started)) is None:
            time.sleep(POLL_S)
        self.client, self.scheduler_id = client, scheduler_id(client)
        self.on_new_scheduler(client)
        self.logger.warning("a Dask scheduler answers at %s again, after %.1f s: the run's jobs in flight are sent "
                            "again to its workers", self.address, time.monotonic() - started)
        return client

    def close(self) -> None:
        """Close the clients made here; the first one's owner closes it."""
        for client in self._made:
            with suppress(Exception):  # its scheduler may be gone for good
                client.close(timeout=5)
        _drop_dasks_verdict(-1)

    def _connected(self, started: float) -> Client | None:
        """The current client if Dask reconnected it, else a new one; None while none answers."""
        if self.client.status == "running":
            with suppress(*SCHEDULER_ERRORS):
                scheduler_id(self.client)
                return self.client
        left = started + self.wait_s - time.monotonic()
        # Dask's client still trying (its connect timeout), or closing itself after it gave up (its pending
        # connections, up to 5 s), is waited for: closing it over either cancels Dask's task and logs a traceback
        dasks_own = self.client.status in ("connecting", "closing")
        if dasks_own and left > 0:
            return None
        if not dasks_own:
            with suppress(Exception):
                self.client.close(timeout=1)
        if left <= 0:
            raise ClusterUnavailable(
                "distribution.scheduler_address",
                f"the Dask scheduler at {self.address} was lost and none answered there within "
                f"distribution.scheduler_wait_s ({self.wait_s:g} s); what was committed stays: {self.resume_hint}")
        try:
            # the process's default client, as the first one was: the hosts' actors talk through it
            client = Client(self.address, timeout=min(left, CONNECT_ATTEMPT_S), security=self.security)
        except (OSError, TimeoutError):
            return None
        self._made.append(client)
        return client


def scheduler_id(client: Client) -> str:
    """The scheduler's id (a new one for a restarted scheduler at the same address), asked of it."""
    return scheduler_identity(client, n_workers=0)["id"]


def scheduler_identity(client: Client, n_workers: int = -1) -> dict:
    """The scheduler's identity (its id, `n_workers` of its workers; -1: all), asked of it now:
    Dask's `scheduler_info` answers from its cache when the scheduler cannot be reached, listing
    workers that died with it. Raises one of SCHEDULER_ERRORS when it cannot be reached."""
    if client.status != "running" or client.scheduler is None:
        raise ClosedClientError(f"the Dask client is {client.status}")
    return client.sync(client.scheduler.identity, n_workers=n_workers)
