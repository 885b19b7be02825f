"""How a command-line run stops: Ctrl-C or SIGTERM ends it within seconds, with nothing left running.

Left to itself, Prefect starts its temporary API server inside the terminal's process group, so
Ctrl-C reaches the server too: it dies first, and the run's last state reports and Prefect's
exit-time log drain then retry a server that is gone. A SIGTERM (`timeout`, a supervisor) ends
the process without running any exit handler, leaving that server behind as an orphan.

So here:
- `temporary_api()` starts the temporary server itself, in a session of its own (Ctrl-C does not
  reach it), while gymflow's imports load, and stops it last, after Prefect's exit-time drains;
  the server watches this process and ends when it dies, SIGKILL included (flows/tethered.py);
- `stopping_cleanly()` takes SIGTERM as Ctrl-C (KeyboardInterrupt: the flow run is marked
  crashed, the Dask cluster closed, the MLflow run marked failed on the way out; what was
  committed stays, for `gymflow resume`), and a second signal, or a stop that takes more than
  `STOP_GRACE_S`, ends the process at once with every process it started;
- a stop raised where Python cannot raise (a gc callback, a `__del__`: "Exception ignored in")
  is raised again (`StopRedelivery`).

A deployment run is not gymflow's process: a Prefect worker cancels it by sending SIGTERM to
its process group, and Prefect's engine raises TerminationSignal in the flow. The run's Dask
workers ignore that signal (tasks/cluster/local_worker.py) and leave when the flow closes the
cluster, and `cancellable()` ends the rest within seconds (see there).
"""

from __future__ import annotations

import _thread
import atexit
import contextvars
import gc
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import TYPE_CHECKING, Any
from uuid import UUID

from gymflow.errors import PrefectUnavailable
from gymflow.last_steps import allow_ending, take_last_steps
from gymflow.stops import ask_stop, stoppable

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

STOP_GRACE_S = 8.0
SAME_STOP_S = 0.5  # a second signal this soon is the same stop sent twice (to the process and to its group)
API_START_TIMEOUT_S = 60.0
API_START_ATTEMPTS = 3


class TemporaryApi:
    """A Prefect API server of this process's own, on a free loopback port."""

    def __init__(self, port: int = 0) -> None:
        # The server is handed a socket already bound: a port chosen, released and bound again
        # seconds later (the server's imports) may be taken meanwhile, by another run's Dask workers.
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", port))
        self.port = self.socket.getsockname()[1]
        self.errors = tempfile.TemporaryFile()  # the server's stderr: why it would not start, if it does not
        self.process = self._start()
        # at exit the server is asked to stop and left to finish alone (its graceful stop took 0.3-0.4 s
        # of every command's end): it is tethered to this process, and ended 5 s after it if still running.
        # Registered before Prefect's drains, so it runs after them
        atexit.register(self.stop, wait=False)

    def _start(self) -> subprocess.Popen:
        prefect_folder = importlib.util.find_spec("prefect").submodule_search_locations[0]  # found, not imported
        # no UI, and no telemetry: a machine without internet access would log an error for it
        environment = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                       "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "0"}
        return subprocess.Popen(
            [sys.executable, "-m", "gymflow.flows.tethered", str(os.getpid()),  # it ends when this process dies
             "gymflow.flows.api_server", str(self.port),  # uvicorn, which asks itself its slow first question
             "--app-dir", os.path.dirname(prefect_folder), "--factory",
             "prefect.server.api.server:create_app", "--fd", str(self.socket.fileno()),
             "--log-level", "critical", "--lifespan", "on"],
            env=environment, start_new_session=True, stdout=subprocess.DEVNULL, stderr=self.errors,
            pass_fds=(self.socket.fileno(),),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + API_START_TIMEOUT_S
        attempts = 1
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                # Two runs started at once share Prefect's database; its migrations at start-up can meet
                # SQLite's lock (an OperationalError), and the server exits (status 3). Start it again, a
                # moment apart. Any other cause (a database a newer Prefect migrated) will not pass.
                if attempts == API_START_ATTEMPTS or "OperationalError" not in self._output():  # not SQLite's lock
                    raise self._refusal()
                attempts += 1
                self.errors.seek(0)
                self.errors.truncate()
                time.sleep(random.uniform(0.5, 2.0))
                self.process = self._start()
                deadline = time.monotonic() + API_START_TIMEOUT_S  # each start migrates and imports anew
                continue
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise PrefectUnavailable("Prefect API", f"the temporary Prefect API did not answer within "
                                                f"{API_START_TIMEOUT_S:.0f} s; {_instead}")

    def _output(self) -> str:
        self.errors.seek(0)
        return self.errors.read().decode(errors="replace")

    def _refusal(self) -> PrefectUnavailable:
        """Why the server exited, in one line: the last error its output names, and its database."""
        import prefect
        from prefect.settings import get_current_settings

        lines = self._output().splitlines()
        errors = [line for line in lines if line[:1].isalpha() and "Error" in line.partition(":")[0]]
        cause = errors[-1] if errors else f"it exited with {self.process.returncode}"
        url = get_current_settings().server.database.connection_url
        url = url.get_secret_value() if url else ""
        where = url if url.startswith("sqlite") else "the one PREFECT_API_DATABASE_CONNECTION_URL names"
        return PrefectUnavailable("Prefect API", f"the temporary Prefect API would not start: {cause} (database: "
                                                 f"{where}; Prefect {prefect.__version__}); {_instead}")

    def stop(self, wait: bool = True) -> None:
        """Ask the server to stop, killed if it has not after 5 s; with `wait`, until it has (without:
        the kill from a thread of its own, so a caller that goes on keeps no server)."""
        if self.process.poll() is None:
            self.process.terminate()
            if wait:
                self._killed_after(5)
            else:
                threading.Thread(target=self._killed_after, args=(5,), name="gymflow-api-stop", daemon=True).start()
        self.socket.close()
        self.errors.close()

    def _killed_after(self, seconds: float) -> None:
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:  # a server still starting, or slow to shut down under load
            self.process.kill()
            self.process.wait()


def _server_checked() -> None:
    """The configured Prefect server answers and takes the login (ServerRefused in one line if not)."""
    from prefect.settings import get_current_settings

    from gymflow.tasks.tracking.servers import check_prefect_server

    api = get_current_settings().api
    check_prefect_server(api.url, api.auth_string.get_secret_value() if api.auth_string else None,
                         api.key.get_secret_value() if api.key else None)


_instead = ("allowed: a PREFECT_HOME whose database this Prefect can use (a database a newer Prefect migrated "
            "cannot be), or PREFECT_API_URL of a running Prefect server")


@contextmanager
def temporary_api() -> Iterator[Callable[[], None]]:
    """Where no Prefect API is configured (PREFECT_API_URL, a profile), a temporary one of this
    process's own for what runs inside. Yields the wait for it to answer: the caller's imports
    load while it starts. A configured server's wait asks it whether it takes the login."""
    if os.environ.get("PREFECT_API_URL"):
        yield _server_checked
        return
    # started before Prefect's settings are read (importing them takes ~1 s), and stopped at once,
    # still importing, where a profile or a settings file names an API after all
    api = TemporaryApi()
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        get_current_settings,
        temporary_settings,
    )

    if get_current_settings().api.url:
        api.stop()
        yield _server_checked
        return
    waited = threading.Event()

    def wait_ready() -> None:
        waited.set()
        api.wait_ready()

    # No flow-run heartbeats: they tell a server that outlives a run whether the run is still alive,
    # and this one ends with the run; their thread, sleeping in 1 s steps, held each run's end up to 1 s
    try:
        with temporary_settings(updates={PREFECT_API_URL: api.url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield wait_ready
    finally:
        if not waited.is_set():  # refused before any work (bad input): no flow's logs to send it at exit
            api.stop(wait=False)


# The signal a swallowed stop is raised again by: one no sender outside uses, so that a
# redelivery is never read as the user's second Ctrl-C (which ends the run at once).
REDELIVERY_SIGNAL = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


class StopRedelivery:
    """A stop that a signal handler raised where Python swallows exceptions (a gc callback, a
    `__del__`, a weakref callback: it prints "Exception ignored in" and goes on) is raised again.
    `sys.unraisablehook` sees the handler's stop swallowed; a thread of its own then signals the
    main thread with `REDELIVERY_SIGNAL` (a handler run inside the hook would be lost for good),
    whose handler raises the stop again (`raise_stop`), until one is not swallowed. Seen for real:
    Dask's GC diagnosis callback (in the flow's process, beside the scheduler) took a Ctrl-C in 1
    of 13 runs of `gymflow run`, which went on until the grace period ended it uncleanly."""

    def __init__(self, raise_stop: Callable[[], None], stops: tuple[type[BaseException], ...]) -> None:
        self.raise_stop, self.stops = raise_stop, stops
        self.raised = self.pending = self.in_hook = self.closed = False  # raised: by the signal handler
        self.wanted = threading.Event()

    def _hook(self, unraisable: Any) -> None:
        self.in_hook = True
        try:
            if self.raised and isinstance(unraisable.exc_value, self.stops):  # the handler's stop, no other
                self.pending = True
                self.wanted.set()
            else:
                self._previous_hook(unraisable)
        finally:
            self.in_hook = False

    def _redelivered(self, signum: int, frame: object) -> None:
        if self.pending and self.in_hook:
            self.wanted.set()
        elif self.pending:
            self.pending = False
            self.raise_stop()

    def _redeliver(self) -> None:
        while self.wanted.wait() and not self.closed:
            self.wanted.clear()
            time.sleep(random.uniform(0.001, 0.02))  # out of the hook by then; never in step with a periodic callback
            if self.pending:
                _thread.interrupt_main(REDELIVERY_SIGNAL)  # its handler runs at the main thread's next step

    @contextmanager
    def watching(self) -> Iterator[StopRedelivery]:
        """Watch for the stop swallowed while inside (main thread only: it sets a signal handler)."""
        previous_handler = signal.signal(REDELIVERY_SIGNAL, self._redelivered)
        self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._hook
        threading.Thread(target=self._redeliver, name="gymflow-stop-redelivery", daemon=True).start()
        try:
            yield self
        finally:
            sys.unraisablehook = self._previous_hook
            signal.signal(REDELIVERY_SIGNAL, previous_handler)
            self.closed = True
            self.wanted.set()


@contextmanager
def stopping_cleanly() -> Iterator[threading.Event]:
    """SIGTERM as Ctrl-C; a second signal or an overlong stop ends everything at once. Yields the event
    set once a stop was asked: the code the KeyboardInterrupt hit may have turned it into another error
    (pydantic's serializer, mid-import of Prefect, into PydanticSerializationError)."""
    stopping = threading.Event()
    redelivery = StopRedelivery(_raise_keyboard_interrupt, (KeyboardInterrupt,))

    first: list[float] = []

    def interrupt(signum: int, frame: object) -> None:
        if stopping.is_set():
            if time.monotonic() - first[0] < SAME_STOP_S:  # `timeout`'s to the process, then to its group
                return
            _exit_now(f"signal {signum} again")
        stopping.set()
        ask_stop()  # a sweep's runs, in Prefect's task threads, end at their next step
        first.append(time.monotonic())
        watchdog = threading.Timer(STOP_GRACE_S, _exit_now, args=(f"still stopping after {STOP_GRACE_S:.0f} s",))
        watchdog.daemon = True
        watchdog.start()
        _say_in_a_handler("\ngymflow: stopping (again to stop at once)\n")
        gc.freeze()  # the process ends after the stop: no collection of its whole heap at exit (1-3 s)
        redelivery.raised = True
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with stoppable(), redelivery.watching():
            yield stopping
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say_in_a_handler(line: str) -> None:
    """A line on stderr from a signal handler: written to the file descriptor, not through `sys.stderr`,
    whose buffer raises "reentrant call" where the handler interrupted a write of the main thread's own (a
    log line), and not through print, which a flow turns into a log line (log_prints)."""
    with suppress(OSError):
        os.write(2, line.encode())


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def _exit_now(why: str) -> None:
    """End this process and every process it started, now."""
    import psutil

    _say_in_a_handler(f"gymflow: {why}: ending the run's processes\n")  # from a handler, or the watchdog
    take_last_steps()  # what is not a child process: a SLURM run's queued jobs
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 2
    while any(still_running(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # a killed child whose parent was killed too waits for process 1 to reap it: ended
    os._exit(130)


def still_running(process: Any) -> bool:
    """Not ended, nor ended and waiting to be reaped (a zombie): a killed child whose parent was
    killed too waits for process 1, which reaps orphans late here (a zombie was seen after 10 s)."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


CANCEL_POLL_S = 1.0


def deployment_of_this_run() -> str | None:
    """The deployment this flow run was started from, if any, as the run's context holds it
    (Prefect's `prefect.runtime.deployment.id` reads the flow run from the API again, on a client
    of its own: 0.1-0.2 s of every run's start)."""
    from prefect.context import get_run_context

    deployment_id = get_run_context().flow_run.deployment_id
    return str(deployment_id) if deployment_id else None


@contextmanager
def cancellable(flow_run_id: str, deployment_id: str | None) -> Iterator[None]:
    """A Prefect cancellation of this deployment run ends it within seconds.

    The worker learns of a cancellation from an events websocket, or, when that connection is
    lost (it happens on a loaded machine), by polling every 10 s; then it SIGTERMs the process
    group, and marks the run Cancelled only after the whole group is gone (it looks every 3 s) and
    after importing the flow's module again to look for cancellation hooks (5 s with gymflow's
    imports). So the run watches its own state too (every `CANCEL_POLL_S`) and, once Cancelling,
    stops itself with the SIGTERM Prefect's engine turns into TerminationSignal; once the flow has
    closed its cluster and MLflow run (what this wraps), it marks itself Cancelled, and its
    process skips the collection of its whole heap at exit (1-3 s). Prefect cancels only
    deployment runs: other runs are not watched. A deployment run's process (a worker's) is the run's
    own: a lost server's deadline may end it (gymflow.last_steps).
    """
    from prefect.exceptions import TerminationSignal

    if deployment_id:
        allow_ending()

    watching = threading.Event()
    engine_handler = signal.getsignal(signal.SIGTERM)
    first_only = _FirstSigtermOnly(engine_handler)
    if deployment_id and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, first_only)
        watching.set()
        context = contextvars.copy_context()  # the flow's Prefect settings, for the thread's client
        threading.Thread(target=context.run, args=(_stop_when_cancelling, flow_run_id, watching),
                         name="gymflow-cancellation", daemon=True).start()
    try:
        with first_only.redelivery.watching() if watching.is_set() else nullcontext():
            yield
    except TerminationSignal:
        watching.clear()
        _mark_cancelled_if_cancelling(flow_run_id)
        gc.freeze()  # the process ends next: nothing left for a collection to free
        raise
    finally:
        if watching.is_set():
            watching.clear()
            signal.signal(signal.SIGTERM, engine_handler)


class _FirstSigtermOnly:
    """Prefect's SIGTERM handling, once (and again only for a stop swallowed where Python cannot
    raise, `redelivery`): the run stops on its own SIGTERM and the worker's comes after it, which
    must not cut the flow's clean-up (cluster, MLflow run) short. A run that hangs anyway is
    SIGKILLed by the worker 30 s later."""

    def __init__(self, engine_handler: Any) -> None:
        from prefect.exceptions import TerminationSignal

        self.engine_handler = engine_handler
        self.redelivery = StopRedelivery(self._stop, (TerminationSignal, SystemExit))

    def __call__(self, signum: int, frame: Any) -> None:
        if self.redelivery.raised:
            return  # the worker's SIGTERM, after the run's own
        self.redelivery.raised = True
        self._stop()

    def _stop(self) -> None:
        if callable(self.engine_handler):
            self.engine_handler(signal.SIGTERM, None)  # Prefect's raises TerminationSignal
        else:
            raise SystemExit(128 + signal.SIGTERM)


def _stop_when_cancelling(flow_run_id: str, watching: threading.Event) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        while watching.is_set():
            time.sleep(CANCEL_POLL_S)
            try:
                state = client.read_flow_run(UUID(flow_run_id)).state
            except Exception:  # the API busy or restarting: look again next time
                continue
            if watching.is_set() and state is not None and state.type == StateType.CANCELLING:
                os.kill(os.getpid(), signal.SIGTERM)  # this process only: its Dask workers are closed by the flow
                return


def _mark_cancelled_if_cancelling(flow_run_id: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(flow_run_id)).state
        if state is not None and state.type == StateType.CANCELLING:
            cancelled = Cancelled(message="Cancelled; what was committed stays for `gymflow resume`")
            result = client.set_flow_run_state(UUID(flow_run_id), cancelled)
            if result.status == SetStateStatus.ACCEPT and result.state is not None:
                _show_the_engine(result.state)
            print("gymflow: cancelled; the run's cluster and MLflow run are closed", file=sys.stderr, flush=True)


def _show_the_engine(final: State) -> None:
    """Prefect's engine forces a Crashed state on a TerminationSignal its runner did not announce
    (this one is the run's own, from `_stop_when_cancelling`, when it sees Cancelling before the
    worker does) unless its copy of the flow run is already final: give it the Cancelled state."""
    from prefect.context import get_run_context

    get_run_context().flow_run.state = final
