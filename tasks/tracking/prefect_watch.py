"""The Prefect API a run reports to, watched: asked every WATCH_EVERY_S for the run's flow run, on
a request of its own (one try, ASK_TIMEOUT_S), against the run's outage budget
(`tracking.outage_budget_s`, tasks/tracking/outage.py).

Within the budget the run trains on (Prefect's own clients try their requests again; the progress
artifact is passed over while the API is out). Past it, or at once where the API answers that it
has no such flow run (its database lost), the run stops at its next commit in one line, and the
process ends within END_GRACE_S of that even where Prefect's engine would go on trying to report
the run's end to an API that is gone (gymflow.last_steps.end_within)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from gymflow.errors import ServerLost
from gymflow.last_steps import end_within
from gymflow.outage import Outage
from gymflow.tasks.tracking.outage import prefect_outage

_WATCHED: list[Outage] = []  # the outages of the runs this process watches


def api_out() -> bool:
    """Whether a Prefect API this process reports to is out (or lost): Prefect's own clients' lines
    about it (events not sent, services failing) say again what gymflow said once."""
    return any(outage.going_on for outage in _WATCHED)


WATCH_EVERY_S = 5.0
ASK_TIMEOUT_S = 5.0
END_GRACE_S = 60.0  # from the API's loss to the process's end, at the latest


class PrefectWatch:
    def __init__(self, api_url: str, flow_run_id: str, budget_s: float, resume_hint: str):
        self.url, self.flow_run_id, self.resume_hint = api_url.rstrip("/"), flow_run_id, resume_hint
        self.outage = prefect_outage(api_url, budget_s)
        self._login, self._verify = _login(), _verify()  # as Prefect's own client sends them, read once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gymflow-prefect-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        # one client for the whole watch: a new client a question built an SSL context each time (~60 ms
        # of CPU every WATCH_EVERY_S, in the run's process beside its learner)
        with httpx.Client(headers=self._login, timeout=ASK_TIMEOUT_S, verify=self._verify) as client:
            while not self._stop.wait(WATCH_EVERY_S):
                try:
                    self._ask(client)
                except ServerLost as lost:
                    end_within(END_GRACE_S, f"gymflow: error: {lost}; what was committed stays: {self.resume_hint} "
                                            "once the server answers")
                    return

    def _ask(self, client: httpx.Client) -> None:
        try:
            answer = client.get(f"{self.url}/flow_runs/{self.flow_run_id}")
        except httpx.HTTPError as error:  # no answer: refused, cut, timed out
            self.outage.failed(error)
            return
        if answer.status_code == 404:
            self.outage.gone(f"it has no flow run {self.flow_run_id} (its database lost or replaced)")
            self.outage.check()
        elif answer.status_code >= 500:
            self.outage.failed(httpx.HTTPStatusError(f"{answer.status_code} {answer.reason_phrase}",
                                                     request=answer.request, response=answer))
        else:
            self.outage.answered()


def _login() -> dict[str, str]:
    """The headers Prefect's own client sends: its API key, or a self-hosted server's basic auth."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    if api.key is not None:
        return {"Authorization": f"Bearer {api.key.get_secret_value()}"}
    if api.auth_string is not None:
        return {"Authorization": "Basic " + base64.b64encode(api.auth_string.get_secret_value().encode()).decode()}
    return {}


def _verify() -> bool | str:
    """An https API's certificate checked as Prefect's own client checks it."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    return False if api.tls_insecure_skip_verify else (api.ssl_cert_file or True)


@contextmanager
def prefect_watched(flow_run_id: str, budget_s: float, resume_hint: str) -> Iterator[Outage | None]:
    """The watch while inside (its outage: what the run's recorder checks at each commit); none
    for a run outside a flow run."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not flow_run_id or not url:
        yield None
        return
    watch = PrefectWatch(url, flow_run_id, budget_s, resume_hint)
    watch.start()
    _WATCHED[:] = [*_WATCHED[-7:], watch.outage]  # the newest runs' (a sweep's trials), not every run's since
    try:
        yield watch.outage
    finally:
        watch.stop()  # its outage stays watched: what the engine reports at the end meets the same API
