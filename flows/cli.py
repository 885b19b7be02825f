"""The command line: `gymflow presets`, `gymflow show PRESET`, `gymflow run PRESET --set k=v`,
`gymflow resume RUN_ID --root ROOT`, `gymflow checkpoints RUN_ID --root ROOT`,
`gymflow sweep SPEC.yaml [--id SWEEP_ID]`, `gymflow export RUN_ID --to DATASETS_ROOT`."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from gymflow.commands import gymflow_command
from gymflow.errors import GymflowError

if TYPE_CHECKING:
    from gymflow.flows.sweep import SweepResult
    from gymflow.presets.model import DistributionConfig
    from gymflow.tasks.training.summary import RunSummary

T = TypeVar("T")


_collection_paused = False  # by `main`, for the imports of the process's command


def main(argv: Sequence[str] | None = None) -> int:
    """The `gymflow` command (argv None: the process's own arguments) or, given argv, the same
    command inside a process that goes on (the tests)."""
    global _collection_paused
    if argv is None:
        from gymflow.last_steps import allow_ending

        allow_ending()  # the command's own process: a run's deadline (a lost server) may end it
        # a log record a handler fails to send (Prefect's to an API that is out: "--- Error logging to
        # API ---" with the answer, at every batch) is dropped, as the logging docs advise in production;
        # the run's log file has every record, and gymflow says the API's outage once
        logging.raiseExceptions = False
        # No garbage collections while the command imports Prefect, torch, MLflow and the flow:
        # they scanned the ~0.8 M new objects over and over and freed nothing (0.6-1.1 s of a
        # run's ~4 s of imports on the 2-core VM); back on once they are in (`_collecting_again`)
        gc.disable()
        _collection_paused = True
    try:
        code = _command(argv)
    except BrokenPipeError:  # the reader of its output went away (`gymflow presets | head`): as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    if argv is not None:  # the caller goes on: a lost server's deadline, if one was armed, is not its end
        from gymflow.last_steps import cancel_end

        cancel_end()
    if argv is None:
        # the process ends next: the interpreter's collection of its whole heap on the way out
        # (torch, MLflow, Prefect, Dask: ~2 s) frees nothing anybody waits for
        gc.freeze()
    return code


def _collecting_again() -> None:
    """The garbage collector back on, if `main` paused it, with the objects the imports made
    frozen out of its scans (they live as long as the process)."""
    global _collection_paused
    if _collection_paused:
        gc.freeze()
        gc.enable()
        _collection_paused = False


def _command(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _working_folder_importable()
    if args.command in ("run", "resume", "sweep"):
        with _sigterm_as_ctrl_c():  # until `stopping_cleanly` takes both
            try:
                from gymflow.flows.stopping import temporary_api

                # started before the preset is checked (torch, Gymnasium) and the flow imported (MLflow):
                # the server's start-up then runs on the other core
                with temporary_api() as api_ready:
                    return _train(args, api_ready)
            except KeyboardInterrupt:  # during the imports and checks, before any run began
                print(f"\ngymflow: stopped during start-up: {NOTHING_MADE}", file=sys.stderr)
                return 130
            except Exception:  # the stop's KeyboardInterrupt turned into another error by the code it hit
                if not _stop_asked.is_set():  # (pydantic's serializer: PydanticSerializationError)
                    raise
                print(f"\ngymflow: stopped during start-up: {NOTHING_MADE}", file=sys.stderr)
                return 130
    from gymflow.presets import builtin_presets, parse_assignments

    if args.command == "presets":
        for name, description in builtin_presets().items():
            print(f"{name:<20} {description}")
        return 0
    if args.command != "show":  # a command that reads a run's data: garbage collected as it goes
        _collecting_again()
    if args.command == "checkpoints":
        return _checkpoints(args.run_id, args.root, parse_assignments(args.option))
    if args.command == "export":
        return _export(args)
    if args.command == "export-policy":
        return _export_policy(args)
    if args.command == "kube":
        return _kube(args)
    if args.command == "stack":
        return _stack(args)
    return _show(args.preset, args.set)


NOTHING_MADE = "no run began, nothing was written, nothing to resume"


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while inside (the main thread's; elsewhere nothing changes), as
    Ctrl-C does, and either is noted (`_stop_asked`): a stop during start-up is one line too, whatever
    error the interrupted code made of it. The handlers before are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _stop_starting)
    previous_interrupt = signal.signal(signal.SIGINT, _stop_starting)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)


_stop_asked = threading.Event()  # a Ctrl-C or SIGTERM came during start-up


def _stop_starting(signum: int, frame: object) -> None:
    _stop_asked.set()
    raise KeyboardInterrupt


def _train(args: argparse.Namespace, api_ready: Callable[[], None]) -> int:
    """`run`, `resume` or `sweep`, under the Prefect API that `api_ready` waits for."""
    from gymflow.presets import parse_assignments

    if args.command == "sweep":
        return _sweep(args.spec, args.id, api_ready, Output(verbose=args.verbose))
    if args.command == "resume":
        from gymflow.tasks.storage.objects import Storage, StorageLocation
        from gymflow.tasks.storage.records import read_run_record
        from gymflow.tasks.training.resume import stored_tracking_uri

        options = parse_assignments(args.option)
        try:
            storage = Storage(StorageLocation(args.root, options))
            read_run_record(storage, args.run_id)
            stored_tracking_uri(storage, args.run_id)  # a password it cannot have is refused here
        except GymflowError as error:
            print(f"gymflow: error: {error}", file=sys.stderr)
            return 2
        learners = {} if args.learners is None else {"distribution.learners": args.learners}
        return _run("cartpole-ppo", {"storage.root": args.root, "storage.options": options, **learners},
                    Output(args.quiet, args.verbose), api_ready,
                    Launch({"resume": args.run_id}, f"{gymflow_command()} resume {args.run_id} --root {args.root}"))
    try:
        overrides = parse_assignments(args.set)
        from gymflow.presets.validate import resolve_experiment
        from gymflow.tasks.storage.objects import check_storage, storage_location
        from gymflow.tasks.tracking.servers import check_tracking_server

        experiment = resolve_experiment(args.preset, overrides)
        if experiment.preset.storage.options_block is None:  # a block's credentials: checked once the API answers
            check_storage(storage_location(experiment.preset.storage))
        check_tracking_server(experiment.preset.tracking.tracking_uri, experiment.preset.tracking.experiment)
        if experiment.preset.dataset is not None:  # a dataset that is not there: refused before Prefect starts
            from gymflow.tasks.training.run import find_dataset

            find_dataset(experiment)
    except GymflowError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2
    from gymflow.tasks.storage.layout import new_run_id

    run_id = new_run_id(experiment.preset.name)  # named here, so a stopped run's line can say how to resume it
    return _run(args.preset, overrides, Output(args.quiet, args.verbose), api_ready,
                Launch({"warm_start": args.warm_start, "run_id": run_id},
                       f"{gymflow_command()} resume {run_id} --root {experiment.preset.storage.root}"),
                experiment.preset.distribution)


def _show(preset: str, assignments: list[str]) -> int:
    from gymflow.presets import parse_assignments

    try:
        from gymflow.presets.validate import resolve_experiment

        experiment = resolve_experiment(preset, parse_assignments(assignments))
    except GymflowError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(experiment.preset.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _kube(args: argparse.Namespace) -> int:
    """The manifests a team applies to run the preset on Kubernetes, checked, in args.out."""
    from gymflow.extras import KUBE, extra_missing
    from gymflow.presets import parse_assignments
    from gymflow.tasks.cluster.kube import KubeTarget, check, manifests, write

    if missing := extra_missing("`gymflow kube`", "kube", KUBE):
        print(f"gymflow: error: {missing}", file=sys.stderr)
        return 2
    target = KubeTarget(args.image, args.name, args.namespace, args.worker_cpu, args.worker_memory,
                        args.learner_cpu, args.learner_memory, args.learner_gpus)
    try:
        from gymflow.presets.validate import resolve_experiment

        files = manifests(resolve_experiment(args.preset, parse_assignments(args.set)).preset, target)
        check(files)
    except GymflowError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2
    for path in write(files, Path(args.out)):
        print(path)
    return 0


def _stack(args: argparse.Namespace) -> int:
    """`stack up`: a team's servers on this machine for a trial, their addresses and each user's
    settings printed; `stack down`: all of it ended, by pid, and its folder removed."""
    import shlex

    from gymflow.flows import team_stack as stack

    folder = Path(args.folder)
    if args.action == "down":
        try:
            others = stack.stop(folder)
        except stack.StackError as error:
            print(f"gymflow: error: {error}", file=sys.stderr)
            return 2
        print(f"stack under {folder.resolve()}: stopped, its folders removed")
        if others:  # a pid saved long ago that another process has taken since: not signalled
            print(f"  left alone: {', '.join(others)} (their pids belong to other processes now)")
        return 0
    users = tuple(name for name in args.users.split(",") if name)
    try:
        started = stack.start(folder, users, args.dask_workers, say=lambda line: print(f"  {line}", flush=True))
    except stack.StackError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2
    print(f"stack under {started.folder} (`{gymflow_command()} stack down --folder {args.folder}` ends it):\n"
          f"  PostgreSQL     127.0.0.1:{started.postgres_port}\n  Prefect        {started.prefect_api_url}\n"
          f"  MLflow         {started.mlflow_url} (users: {', '.join(users)}; admin: {stack.ADMIN})\n"
          f"  S3 (moto)      {started.s3_endpoint} bucket {started.bucket}\n"
          f"  Dask           {started.scheduler_address}")
    for user in users:
        print(f"\n# as {user}:")
        for name, value in started.environment(user).items():
            print(f"export {name}={shlex.quote(value)}")
    settings = " ".join(f"--set {shlex.quote(setting)}" for setting in started.settings("USER"))
    print(f"\n# then, e.g.:\n{gymflow_command()} run cartpole-ppo {settings} --set tracking.experiment=USER")
    return 0


def _working_folder_importable() -> None:
    """`env.id: my_env:MyEnv` finds my_env.py in the working folder, as `python -m` would; the
    run's LocalCluster workers start with this import path too."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


@dataclass(frozen=True)
class Output:
    """What the terminal shows: the progress bar (not `quiet`); all log lines (`verbose`), or
    gymflow's own, warnings and errors, the whole log going to `gymflow-logs/NAME.log`."""

    quiet: bool = False
    verbose: bool = False


def _under_prefect(load: Callable[[], Callable[[], T]], stopped: str, api_ready: Callable[[], None],
                   distribution: DistributionConfig | None = None, log: tuple[str, Output] | None = None,
                   unbegun: str | None = None) -> T | int:
    """Run a flow once the Prefect API answers (`api_ready` waits for this process's temporary
    one): `load()` imports it meanwhile and returns the call; the run's LocalCluster, where
    `distribution` asks for one, starts beside them. Ctrl-C or SIGTERM stops it within seconds
    (flows/stopping.py). `log`: the log file's name (a run's or a sweep's id) and what the console shows.
    `unbegun`: what a stop or a refusal before that run (or sweep) began leaves (its log removed, where it made
    it); None: the log always stays. Returns what the flow returned, or an exit code."""
    from gymflow import last_steps
    from gymflow.flows.console import gymflow_errors_in_one_line_on_the_console
    from gymflow.flows.stopping import stopping_cleanly

    with stopping_cleanly() as stop_asked, _cluster_beside(distribution) as cluster_ready:
        run_log = _RunLog.of(log, unbegun)
        try:
            call = load()
            _collecting_again()
            gymflow_errors_in_one_line_on_the_console()
            run_log.open()
            api_ready()
            cluster_ready()
            result = call()
            print(run_log.said, end="", file=sys.stderr)
            return result
        except GymflowError as error:
            return run_log.ended(f"gymflow: error: {error}", 2)
        except Exception as error:
            if stop_asked.is_set():  # the stop's KeyboardInterrupt turned into another error by the code it hit
                return _stopped(run_log, stopped, unbegun)
            # Prefect's engine failing on its way out (its report of the run's end answered 500), after
            # a server was lost (the line already armed) or not
            line = last_steps.pending_line() or _prefect_failed(error, stopped)
            if line is None:
                raise
            return run_log.ended(line, 2)
        except KeyboardInterrupt:
            return _stopped(run_log, stopped, unbegun)


def _stopped(run_log: _RunLog, stopped: str, unbegun: str | None) -> int:
    """The one line a stop ends with: before the run began, or after."""
    if not run_log.begun():
        return run_log.ended(f"gymflow: stopped during start-up: {unbegun}", 130)
    return run_log.ended(f"gymflow: stopped. {stopped}", 130)


@dataclass
class _RunLog:
    """A command's log file (`gymflow-logs/NAME.log`) and what its end does with it: kept, and named,
    once the run began (or where it was there before: a resumed run's); removed where a refusal or a
    stop came before any work."""

    name: str | None
    verbose: bool
    unbegun: str | None  # what a stop before the work began leaves; None: the log always stays
    kept: bool
    file: Path | None = None

    @classmethod
    def of(cls, log: tuple[str, Output] | None, unbegun: str | None) -> _RunLog:
        from gymflow.flows.console import LOG_FOLDER

        if log is None:
            return cls(None, False, unbegun, True)
        return cls(log[0], log[1].verbose, unbegun, Path(LOG_FOLDER, f"{log[0]}.log").exists())

    def open(self) -> None:
        from gymflow.flows.console import log_to_file_and_console

        if self.name is not None:
            self.file = log_to_file_and_console(self.name, self.verbose)

    @property
    def said(self) -> str:
        return f"gymflow: the whole log is in {self.file}\n" if self.file else ""

    def begun(self) -> bool:
        from gymflow.work import has_begun

        return self.unbegun is None or (self.name is not None and has_begun(self.name))

    def ended(self, line: str, code: int) -> int:
        """`line` said last (a lost server's deadline does not say it again); the log named above it where
        it stays, removed where nothing began. Returns `code`."""
        from gymflow import last_steps
        from gymflow.flows.console import forget_log

        if self.file is not None and not self.kept and not self.begun():
            forget_log(self.file)
        else:
            print(self.said, end="", file=sys.stderr)
        print(line, file=sys.stderr)
        last_steps.said(line)
        return code


def _prefect_failed(error: Exception, stopped: str) -> str | None:
    """The one line for the Prefect API's answer that failed the run's report (a 5xx to its flow run's
    state, a dropped connection), with what can be continued; None for any other error."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL

    if not isinstance(error, (PrefectHTTPStatusError, httpx.HTTPError)):
        return None
    answer = " ".join(str(error).split()).partition(" - For more information")[0][:300]
    return f"gymflow: error: PREFECT_API_URL: the Prefect API at {PREFECT_API_URL.value()} failed the run's " \
           f"report ({type(error).__name__}: {answer}). {stopped}"


def _cluster_beside(distribution: DistributionConfig | None) -> AbstractContextManager[Callable[[], None]]:
    """The run's LocalCluster starting beside the imports; none (and no Dask import) in single mode."""
    if distribution is None or distribution.mode == "single":
        return nullcontext(lambda: None)
    from gymflow.tasks.cluster.client import local_cluster_started_beside

    return local_cluster_started_beside(distribution)


@dataclass(frozen=True)
class Launch:
    """How a command-line run starts (improve's warm_start and run_id, or resume), and the command
    that continues it if it is stopped."""

    start: Mapping[str, str | None]
    resume_with: str

    @property
    def run_id(self) -> str:
        return str(self.start.get("run_id") or self.start.get("resume"))


def _run(preset: str, overrides: dict, output: Output, api_ready: Callable[[], None], launch: Launch,
         distribution: DistributionConfig | None = None) -> int:
    """Train, with a progress bar."""

    def load() -> Callable[[], RunSummary]:
        from gymflow.flows.improve import improve
        from gymflow.tasks.training.learning import import_run_machinery

        import_run_machinery()
        _without_mlflow_chatter()

        return lambda: _with_progress_bar(lambda: improve(preset, overrides, **launch.start), output.quiet)

    unbegun = (f"run {launch.run_id} is as it was; `{launch.resume_with}` continues it" if "resume" in launch.start
               else NOTHING_MADE)
    summary = _under_prefect(load, f"What was committed stays: `{launch.resume_with}` continues the run",
                             api_ready, distribution, (launch.run_id, output), unbegun)
    if isinstance(summary, int):
        return summary
    from gymflow.tasks.training.delivery import delivered_words

    target = summary.target_return
    verdict = "ended" if target is None else \
        f"{'reached' if summary.solved else 'did not reach'} its target ({target:g})"
    spent = (f"{summary.env_steps:,} env steps" if summary.gradient_steps is None
             else f"{summary.gradient_steps:,} gradient steps offline")
    print(
        f"run {summary.run_id} {verdict}; {delivered_words(summary)} after {spent} ({summary.wall_seconds:.1f} s)"
        f"\n  MLflow run: {summary.mlflow_run_id}, at {summary.mlflow_page}"
        f"{_flow_run_page(summary.flow_run_id)}"
        f"\n  checkpoints and shards: {summary.storage_url}"
    )
    return 0


def _flow_run_page(flow_run_id: str) -> str:
    """The line with the flow run's page in Prefect's UI, where a server that outlives the run holds it
    (PREFECT_API_URL); a run's temporary API ends with it: "" (`prefect server start` shows its runs)."""
    if not os.environ.get("PREFECT_API_URL") or not flow_run_id:
        return ""
    from gymflow.tasks.tracking.pages import flow_run_page

    return f"\n  Prefect flow run: {flow_run_page(flow_run_id)}"


# MLflow's INFO lines of its own housekeeping in the run's terminal: a new tracking database's tables
# ("Creating initial MLflow database tables...", "Updating database tables"), and the logged model's
# input example checked against its signature: nothing a person acts on
MLFLOW_CHATTER = ("mlflow.store.db.utils", "mlflow.pyfunc", "mlflow.models.model", "alembic.runtime.migration")


def _without_mlflow_chatter() -> None:
    for name in MLFLOW_CHATTER:
        logging.getLogger(name).setLevel(logging.WARNING)


def _sweep(spec_path: str, sweep_id: str | None, api_ready: Callable[[], None], output: Output) -> int:
    """Run (or continue, with --id) a sweep; its runs log their progress, the sweep its runs'."""
    from gymflow.presets.sweep import check_sweep, read_sweep_spec
    from gymflow.tasks.storage.layout import new_sweep_id

    try:
        spec = read_sweep_spec(spec_path)
        checked = check_sweep(spec)
        if spec.pbt is not None:  # builds the learners: torch, for this check alone
            from gymflow.tasks.sweep.pbt import check_perturbable

            check_perturbable(checked)
        asked_for, sweep_id = sweep_id is not None, sweep_id or new_sweep_id(checked.base.name)  # for the stop line
    except GymflowError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2

    def load() -> Callable[[], SweepResult]:
        from gymflow.flows.sweep import sweep

        _without_mlflow_chatter()
        return lambda: sweep(spec, sweep_id)

    continues = f"`{gymflow_command()} sweep {spec_path} --id {sweep_id}` continues the sweep"
    unbegun = f"sweep {sweep_id} is as it was; {continues}" if asked_for else "no sweep began, nothing was written"
    result = _under_prefect(load, f"{continues}; finished runs are kept, interrupted ones resume", api_ready,
                            log=(sweep_id, output), unbegun=unbegun)
    if isinstance(result, int):
        return result
    trained = "member intervals" if spec.pbt is not None else "runs"
    print(f"sweep {result.sweep_id}: {len(result.ranking)} {'members' if spec.pbt else 'configurations'}, "
          f"{result.runs_trained} {trained} trained by this start, {result.wall_seconds:.0f} s")
    if result.ranking:
        print(yaml.safe_dump(result.ranking, sort_keys=False), end="")
    if result.best_preset_url:  # a local folder's as a path: `gymflow run` and `show` take either
        print(f"best configuration as a preset: {result.best_preset_url.removeprefix('file://')}")
    return 0


def _with_progress_bar(train: Callable[[], RunSummary], quiet: bool) -> RunSummary:
    """Progress on a bar in a terminal (log lines printed above it); piped, or --quiet, the log lines
    alone tell it."""
    from rich.console import Console

    from gymflow.flows.console import printed_above
    from gymflow.tasks.tracking.progress import showing_progress

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return train()
    bar = progress_bar(console)

    class BarView:
        task_id = None

        def update(self, done: int, total: int, unit: str, status: str) -> None:
            if self.task_id is None:
                self.task_id = bar.add_task("train", total=total, status="", unit=unit)
            bar.update(self.task_id, completed=min(done, total), status=status)

        def finish(self, done: int, total: int, unit: str, status: str) -> None:
            """Whole at the run's end: a run stopped early (its target reached) is shown done at its own count."""
            self.update(done, total, unit, status)
            bar.update(self.task_id, total=min(done, total) or total, completed=min(done, total) or total)

    with bar, printed_above(bar.console), showing_progress(BarView()):
        return train()


def progress_bar(console: Any) -> Any:
    """A run's bar, in one line of any terminal 80 columns wide or wider: the bar, the count, the time
    left, then what the run is doing, cut with an ellipsis where the line ends."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Column

    return Progress(
        BarColumn(bar_width=16),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} {task.fields[unit]}", table_column=Column(no_wrap=True)),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
        console=console,
        expand=True,
    )


def _checkpoints(run_id: str, root: str, options: dict) -> int:
    """Check every checkpoint version of a run against its manifest; name the one a resume loads."""
    from gymflow.tasks.storage.checkpoints import (
        CheckpointError,
        committed_versions,
        read_checkpoint,
        read_newest_valid_checkpoint,
    )
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    storage = Storage(StorageLocation(root, options))
    layout = RunLayout(run_id)
    versions = committed_versions(storage, layout)
    if not versions:
        print(f"gymflow: error: no checkpoints under {storage.url(layout.checkpoints)}", file=sys.stderr)
        return 2
    for version in versions:
        try:
            blobs = read_checkpoint(storage, layout, version)
            print(f"v{version:06d}  ok       {sum(len(b) for b in blobs.values()):>10,} bytes in {len(blobs)} blobs")
        except CheckpointError as error:
            print(f"v{version:06d}  REFUSED  {error}")
    try:
        loaded = read_newest_valid_checkpoint(storage, layout)
    except CheckpointError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 1
    print(f"newest loadable version: v{loaded.version:06d}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """A run's experience as a Minari dataset under the datasets root `--to`."""
    from gymflow.presets import parse_assignments
    from gymflow.tasks.lake.export import DatasetRequest, export_run
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    dataset_id = args.id or f"gymflow/{args.run_id}{'-' + args.group if args.group else ''}-v0"
    try:
        source = Storage(StorageLocation(args.root, parse_assignments(args.option)))
        destination = Storage(StorageLocation(args.to, parse_assignments(args.to_option)))
        report = export_run(source, args.run_id, destination, DatasetRequest(dataset_id, args.format, args.group),
                            progress=lambda episodes, steps: print(f"  {episodes:,} episodes, {steps:,} steps",
                                                                   flush=True))
    except GymflowError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2
    whose = "" if report.group is None else f" of agent group {report.group}"
    print(f"exported {report.episodes:,} episodes{whose} ({report.steps:,} steps) of {report.workers} rollout workers "
          f"to {report.url}")
    if report.retired_before:
        kept = ", ".join(f"worker {worker} from {first}" for worker, first in report.retired_before.items())
        print(f"  the first shards were retired (storage.keep_shards: needed); exportable: {kept}, each env from "
              "its first whole episode there (storage.keep_shards: all keeps every shard)")
    print(f"  load it: MINARI_DATASETS_PATH={args.to} python -c \"import minari; "
          f"print(minari.load_dataset('{dataset_id}'))\"")
    return 0


def _export_policy(args: argparse.Namespace) -> int:
    """A run's policy as an ONNX file at `--to`."""
    from gymflow.presets import parse_assignments
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.training.policy_export import export_policy

    try:
        storage = Storage(StorageLocation(args.root, parse_assignments(args.option)))
        exported = export_policy(storage, args.run_id, args.version, args.to, args.policy)
    except GymflowError as error:
        print(f"gymflow: error: {error}", file=sys.stderr)
        return 2
    print(f"exported v{exported.version} of run {args.run_id} ({exported.chosen}) to {exported.path} as ONNX "
          f"({exported.size:,} bytes): input 'observations' [batch, ...], output 'actions'")
    print(f"  run it: python -c \"import onnxruntime; print(onnxruntime.InferenceSession('{exported.path}')"
          ".get_inputs()[0])\"")
    return 0


VERBOSE = "every log line in the terminal too (Prefect's task runs, libraries' INFO lines); always in gymflow-logs/"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gymflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("presets", help="list the built-in presets")
    for name, help_text in (("run", "train a preset"), ("show", "print a preset with its overrides applied")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("preset", help="a built-in preset name (see `gymflow presets`) or a YAML file")
        command.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override a preset field by dotted key, e.g. --set agent.lr=3e-4 (repeatable)",
        )
        if name == "run":
            command.add_argument("--quiet", action="store_true", help="no progress bar")
            command.add_argument("--verbose", action="store_true", help=VERBOSE)
            command.add_argument("--warm-start", metavar="POLICY", help=(
                "start from this policy: an MLflow model URI (models:/NAME@champion), the path of a policy's "
                "safetensors file, or learner:RUN_ID[@vN] (a run's whole learner, in the same storage)"))
    command = commands.add_parser("sweep", help="search preset fields over configurations x seeds, and rank them")
    command.add_argument("spec", help="a sweep spec YAML (docs/sweeps.md, Sweeps)")
    command.add_argument("--id", help="the sweep's id: continue that sweep where it stopped, or start it with this id")
    command.add_argument("--verbose", action="store_true", help=VERBOSE)
    for name, help_text in (
        ("resume", "continue a run whose flow died, from its last valid checkpoint"),
        ("checkpoints", "verify a run's checkpoints against their manifests"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("run_id", help="the run id, e.g. cartpole-ppo-20261121-112038-28cdab")
        command.add_argument("--root", default="gymflow-data", help="the storage root the run is under (storage.root)")
        command.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                             help="a storage option, e.g. --option endpoint_url=http://127.0.0.1:9000")
        if name == "resume":
            command.add_argument("--quiet", action="store_true", help="no progress bar")
            command.add_argument("--verbose", action="store_true", help=VERBOSE)
            command.add_argument("--learners", type=int, metavar="N", help=(
                "learn on N ranks from here on (distribution.learners; default: as the run did): a checkpoint "
                "resumes under any number"))
    _export_arguments(commands.add_parser("export", help="write a run's experience as a Minari dataset"))
    _export_policy_arguments(commands.add_parser(
        "export-policy", help="write a run's policy as an ONNX file (served without torch or gymflow: docs/deploy.md)"))
    command = commands.add_parser("stack", help="start (up) or end (down) a team's servers on this machine for a "
                                                "trial: PostgreSQL, Prefect, MLflow with logins, S3, Dask")
    command.add_argument("action", choices=("up", "down"))
    command.add_argument("--folder", default="gymflow-stack", help="where its databases, logs and state are kept")
    command.add_argument("--users", default="alice,bob", help="the MLflow users made, comma-separated")
    command.add_argument("--dask-workers", type=int, default=2, help="the Dask workers started")
    _kube_arguments(commands.add_parser("kube", help="write the Kubernetes manifests that run a preset "
                                                     "(docs/cluster.md, Kubernetes)"))
    return parser


def _kube_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("preset", help="a built-in preset name or a YAML file; its storage.root must be s3://")
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset field")
    command.add_argument("--image", required=True, help="gymflow's image, built from the repository's Dockerfile")
    command.add_argument("--name", default="gymflow", help="the DaskCluster's name")
    command.add_argument("--namespace", default="default")
    command.add_argument("--worker-cpu", default="1", help="each rollout worker pod's CPUs")
    command.add_argument("--worker-memory", default="2Gi", help="each rollout worker pod's memory")
    command.add_argument("--learner-cpu", default="4", help="the flow run's (the learner's) CPUs")
    command.add_argument("--learner-memory", default="8Gi", help="the flow run's memory")
    command.add_argument("--learner-gpus", type=int, default=0, help="GPUs for the learner (nvidia.com/gpu)")
    command.add_argument("--out", default="kube", help="the folder the manifests are written to")


def _export_policy_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("run_id", help="the run id, e.g. cartpole-ppo-20261121-112038-28cdab")
    command.add_argument("--to", required=True, metavar="FILE", help="the .onnx file to write")
    command.add_argument("--format", choices=("onnx",), default="onnx", help="the file's format")
    command.add_argument("--version", type=int, help="the policy version (default: the one the run delivered)")
    command.add_argument("--policy", metavar="NAME", help="one of the agent groups' separate policies "
                         "(agent.policies): each is a graph of its own")
    command.add_argument("--root", default="gymflow-data", help="the storage root the run is under (storage.root)")
    command.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                         help="a storage option of --root, e.g. --option endpoint_url=http://127.0.0.1:9000")


def _export_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("run_id", help="the run id, e.g. cartpole-dqn-20261121-112038-28cdab")
    command.add_argument("--to", required=True, metavar="DATASETS_ROOT",
                         help="a Minari datasets root: a folder, or a URL such as s3://bucket/x")
    command.add_argument("--id", help="the dataset id (default gymflow/RUN_ID-v0), as minari.load_dataset names it")
    command.add_argument("--format", choices=("hdf5", "arrow"), default="hdf5", help="Minari's storage format")
    command.add_argument("--group", help="a PettingZoo run's agent group whose episodes to write (default: its only "
                                         "group), e.g. adversary")
    command.add_argument("--root", default="gymflow-data", help="the storage root the run is under (storage.root)")
    command.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                         help="a storage option of --root, e.g. --option endpoint_url=http://127.0.0.1:9000")
    command.add_argument("--to-option", action="append", default=[], metavar="KEY=VALUE",
                         help="a storage option of --to")


if __name__ == "__main__":
    sys.exit(main())
