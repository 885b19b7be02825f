"""The README's test command (`make test`): the suite in two pytest runs.

1. Every test not marked `alone`, in `--workers` processes (pytest-xdist; `--dist loadfile`
   keeps a file's tests in one process, so a module's fixtures, such as a Prefect server, start
   once).
2. The tests marked `alone`, in one process: they bound how long a stop takes (10 s from a
   Ctrl-C, a SIGTERM or a Prefect cancellation), and beside another test's load one missed its
   bound (benchmarks/records/history.md, "The test suite in two tiers"). Both runs: 44.5-47.6 min on the slow 2-core
   kind, against 50 for the whole suite in one process.

Both use one temporary Prefect API (tests/shared_prefect_api.py), started beside them and stopped
after them (SHARED_API names it to their test processes).

The second run starts beside the first and collects; it makes its session's and modules' fixtures
(a server with its deployment, a clean run: ~30 s) once the first has reported set_up_mark()'s % of its
tests (tests/conftest.py, ALONE_SET_UP): an idle Prefect server costs ~1.5-2.2 CPU-s a minute, and
made at the start they idled through the whole first run (now through its last ~third). Each of its
tests begins once the first has ended (ALONE_AFTER). Its output follows the first's.

pytest's arguments pass through to both. A `-m EXPR` among them selects within both runs (the
default is pyproject's `not slow`). The exit code is the first run's failure, else the second's;
a run that collects nothing (pytest's 5) is not a failure unless neither collects anything.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MARKERS = "not slow"  # pyproject's addopts
NOTHING_COLLECTED = 5
# the second run's signal files, named in its environment (tests/conftest.py waits on them)
ALONE_AFTER = "GYMFLOW_TESTS_ALONE_AFTER"
ALONE_SET_UP = "GYMFLOW_TESTS_ALONE_SET_UP"
# both runs' one Prefect API (tests/shared_prefect_api.py): a file that holds its URL once it answers
SHARED_API = "GYMFLOW_TESTS_PREFECT_API"
# % of the first run's tests reported. pytest reports every 72 results (~11% of the default run's ~646 tests).
# In the default run the longest files run first (tests/conftest.py's LONGEST_FILES) and the many short tests
# last, so its 22% mark comes ~3 of its ~9 minutes before its end at full speed. In xdist's order (any other
# selection: the files with the most tests first) the longest files end the run: there 85%.
SET_UP_AT = 20
SET_UP_AT_MOST_TESTS_FIRST = 85
PROGRESS = re.compile(rb"\[\s*(\d{1,3})%\]")  # pytest's progress at the end of a line of results


def split_markers(args: list[str]) -> tuple[str, list[str]]:
    """The `-m` expression among pytest's arguments (the last, as pytest takes it), and the rest."""
    markers, rest, given = DEFAULT_MARKERS, [], iter(args)
    for arg in given:
        if arg == "-m":
            markers = next(given, DEFAULT_MARKERS)
        elif arg.startswith("-m") and not arg.startswith("--"):
            markers = arg[2:].lstrip("=")
        else:
            rest.append(arg)
    return markers, rest


def pytest_reporting(args: list[str], at: int, reached: Callable[[], None], env: dict[str, str] | None = None,
                     said: bytearray | None = None) -> int:
    """pytest with `args` (`env` added to its environment), its output passed through as it comes
    (and kept in `said`); `reached()` once its progress has reported `at` % of its tests (never,
    where it reports none: the caller acts at its end)."""
    print(f"$ pytest {shlex.join(args)}", flush=True)
    # -u: its progress written as it comes (not in blocks of a pipe's buffer); its own, not inherited
    with subprocess.Popen([sys.executable, "-u", "-m", "pytest", *args], stdout=subprocess.PIPE,
                          env={**os.environ, **(env or {})}) as process:
        tail, called = b"", False
        try:
            while chunk := os.read(process.stdout.fileno(), 65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                if said is not None:
                    said += chunk
                read = tail + chunk  # a mark split between two reads is whole here
                if not called and (progress_of(read) or 0) >= at:
                    called = True
                    reached()
                tail = read[-16:]
            return process.wait()
        except BaseException:  # as subprocess.call: the run ends with this one
            process.kill()
            raise


def progress_of(output: bytes) -> int | None:
    """The last progress pytest reported in `output` (its "[ 85%]" marks), in %."""
    marks = PROGRESS.findall(output)
    return int(marks[-1]) if marks else None


def failures_in(output: bytes) -> list[str]:
    """pytest's lines naming what failed (`-ra`'s FAILED and ERROR lines) and its last summary line."""
    lines = output.decode(errors="replace").splitlines()
    named = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    totals = [line for line in lines if line.startswith("=") and (" passed" in line or " failed" in line
                                                                   or " error" in line)]
    return [*named, *totals[-1:]]


def outcome(codes: list[int]) -> int:
    """One exit code for the runs: the first failure; 1 where no run collected a test."""
    if all(code == NOTHING_COLLECTED for code in codes):
        print("pytest collected no tests", file=sys.stderr)
        return 1
    return next((code for code in codes if code not in (0, NOTHING_COLLECTED)), 0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=2, help="test processes for the tests not marked alone")
    parser.add_argument("--set-up-at", type=int, default=None,
                        help="%% of the first run's tests reported when the second run makes its fixtures "
                             f"(default: {SET_UP_AT} in the default run, {SET_UP_AT_MOST_TESTS_FIRST} in any other)")
    options, pytest_args = parser.parse_known_args(argv)
    together, alone = pytest_runs(options.workers, pytest_args)
    # Python's bytecode written and read again, as by default, in every process the suite starts: where the
    # environment says not to write it (these machines' does), each test process compiled gymflow's modules
    # and pytest rewrote every test file anew (a collection: 9.7 CPU-s against 7.3; benchmarks/records/history.md, "The test suite in two tiers")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    set_up_at = set_up_mark(split_markers(pytest_args)[0]) if options.set_up_at is None else options.set_up_at
    # the migrated empty Prefect database the tests' servers start on (tests/prefect_databases.py), made
    # while the runs below collect: on a new machine it is ready before their first server
    template = subprocess.Popen([sys.executable, "-c", "from tests.prefect_databases import migrated_template; "
                                 "migrated_template()"], cwd=Path(__file__).parents[1])
    with tempfile.TemporaryDirectory(prefix="gymflow-suite-") as folder, \
            _shared_prefect_api(Path(folder, "prefect-api")) as api:
        set_up, go, log = Path(folder, "set-up"), Path(folder, "first-run-ended"), Path(folder, "alone.log")
        with log.open("wb") as output:
            # at the lowest priority: its collection and set-up take what the first run leaves of the
            # cores (its tests then run alone, where a priority changes nothing)
            second = subprocess.Popen([sys.executable, "-m", "pytest", *alone],
                                      env={**os.environ, ALONE_AFTER: str(go), ALONE_SET_UP: str(set_up), **api},
                                      stdout=output, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
            first_said = bytearray()
            try:
                first = pytest_reporting(together, set_up_at, set_up.touch, api, first_said)
            except BaseException:
                second.kill()
                raise
            finally:
                set_up.touch()
                go.touch()
            print(f"$ pytest {shlex.join(alone)}  (collected and set up beside the run above)", flush=True)
            code = outcome([first, _followed(second, log)])
            if first not in (0, NOTHING_COLLECTED):  # said again last: a log's tail shows it beside the second run's
                print("\nthe first run (the tests not marked alone), again:\n" + "\n".join(failures_in(first_said)),
                      flush=True)
    template.wait()  # long done: it failing fails the first server that needs it, which says why
    return code


@contextmanager
def _shared_prefect_api(url_file: Path) -> Iterator[dict[str, str]]:
    """One temporary Prefect API for both runs (tests/shared_prefect_api.py), started beside them:
    the environment that names it to their test processes. It stops once its stdin closes."""
    server = subprocess.Popen([sys.executable, "-m", "tests.shared_prefect_api", str(url_file)],
                              cwd=Path(__file__).parents[1], stdin=subprocess.PIPE)
    try:
        yield {SHARED_API: str(url_file)}
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _followed(process: subprocess.Popen, log: Path) -> int:
    """`process`'s output (written to `log`) on this one's as it comes, until it ends; its exit code."""
    with log.open("rb") as reading:
        while True:
            ended = process.poll() is not None
            sys.stdout.buffer.write(reading.read())
            sys.stdout.flush()
            if ended:
                return process.returncode
            time.sleep(0.5)


def keeps_conftests_order(markers: str) -> bool:
    """Whether the first run's processes take the files in tests/conftest.py's order (LONGEST_FILES,
    measured for the default run): in the default run only; `make test-all`'s long files are others."""
    return markers == DEFAULT_MARKERS


def set_up_mark(markers: str) -> int:
    """SET_UP_AT where the files come in tests/conftest.py's order, else SET_UP_AT_MOST_TESTS_FIRST."""
    return SET_UP_AT if keeps_conftests_order(markers) else SET_UP_AT_MOST_TESTS_FIRST


def pytest_runs(workers: int, pytest_args: list[str]) -> list[list[str]]:
    """The two runs' arguments: the tests not marked `alone` in `workers` processes (one where
    `workers` < 2), then those marked `alone` in one."""
    markers, rest = split_markers(pytest_args)
    order = ["--no-loadscope-reorder"] if keeps_conftests_order(markers) else []  # else xdist's: most tests first
    together = ["-n", str(workers), "--dist", "loadfile", *order] if workers > 1 else []
    return [[*together, "-m", f"({markers}) and not alone", *rest], ["-m", f"({markers}) and alone", *rest]]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
