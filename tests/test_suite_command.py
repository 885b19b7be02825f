"""The README's test command (tests/suite.py): how it splits pytest's arguments and joins its two
runs' exit codes."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import LONGEST_FILES, still_running
from tests.suite import (
    DEFAULT_MARKERS,
    SET_UP_AT,
    SET_UP_AT_MOST_TESTS_FIRST,
    outcome,
    progress_of,
    pytest_runs,
    set_up_mark,
    split_markers,
)


def test_a_marker_expression_among_pytests_arguments_selects_in_both_runs():
    assert split_markers(["-ra", "-m", "slow", "-k", "sweep"]) == ("slow", ["-ra", "-k", "sweep"])
    assert split_markers(["-mslow", "--durations=5"]) == ("slow", ["--durations=5"])
    assert split_markers(["-m", "e2e", "-m", "slow"]) == ("slow", [])  # the last, as pytest takes it
    assert split_markers(["--maxfail=1", "tests/test_stops.py"]) == (DEFAULT_MARKERS, ["--maxfail=1",
                                                                                       "tests/test_stops.py"])


def test_the_exit_code_is_the_first_failure_and_nothing_collected_fails_only_when_neither_run_collected():
    assert outcome([0, 0]) == 0
    assert outcome([5, 0]) == 0 and outcome([0, 5]) == 0  # every selected test is in one of the runs
    assert outcome([1, 0]) == 1 and outcome([0, 2]) == 2 and outcome([1, 2]) == 1
    assert outcome([5, 5]) == 1  # pytest's "no tests collected" is a failure for CI


def test_the_tests_not_marked_alone_run_in_two_processes_a_file_to_each_and_the_alone_ones_after_in_one():
    together, alone = pytest_runs(2, ["-ra", "-m", "slow or not slow"])
    assert together == ["-n", "2", "--dist", "loadfile", "-m", "(slow or not slow) and not alone", "-ra"]
    # the default run's files in tests/conftest.py's order (LONGEST_FILES, measured for it)
    assert pytest_runs(2, ["-ra"])[0] == ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "-m",
                                          f"({DEFAULT_MARKERS}) and not alone", "-ra"]
    assert alone == ["-m", "(slow or not slow) and alone", "-ra"]
    assert pytest_runs(0, [])[0] == ["-m", f"({DEFAULT_MARKERS}) and not alone"]  # PYTEST_WORKERS=0: one process
    # the second run's set-up mark follows the order: early where the short files come last
    assert (set_up_mark(DEFAULT_MARKERS), set_up_mark("slow or not slow")) == (SET_UP_AT, SET_UP_AT_MOST_TESTS_FIRST)


def test_the_longest_files_run_first_are_each_a_test_file_here():
    """A file renamed would lose its place in the order unseen (and might then end the run alone)."""
    assert [name for name in LONGEST_FILES if not Path(__file__).with_name(name).is_file()] == []
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)


def test_the_alone_run_is_set_up_late_in_the_first_run_and_its_tests_begin_once_the_first_has_ended(tmp_path):
    """The second run makes its module's fixture only once the first has reported --set-up-at % of
    its tests, and before the first has ended (the first run's last test ends only once the fixture
    is made); the second's test finds the first ended. Waits on files, not on times: the second
    runs at the lowest priority, beside whatever loads the machine. Both runs' tests use one
    Prefect API, which the suite stops after them."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "conftest.py").write_text("from tests.conftest import _after_the_first_run, prefect_api, "
                                          "_set_up_late_in_the_first_run, pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_first_a.py").write_text(textwrap.dedent("""
        import pathlib
        from prefect.settings import PREFECT_API_URL
        def test_before_the_mark(prefect_api):
            assert not (pathlib.Path(__file__).parent / "fixture-made").exists()
            (pathlib.Path(__file__).parent / "first-api").write_text(PREFECT_API_URL.value())
    """))
    (tmp_path / "test_first_b.py").write_text(textwrap.dedent("""
        import pathlib, time
        def test_a_while():
            here, deadline = pathlib.Path(__file__).parent, time.monotonic() + 120
            while not (here / "fixture-made").exists():
                assert time.monotonic() < deadline, "the second run made no fixture while the first went on"
                time.sleep(0.05)
            (here / "first-ended").touch()
    """))
    (tmp_path / "test_second.py").write_text(textwrap.dedent("""
        import pathlib, pytest
        here = pathlib.Path(__file__).parent
        @pytest.fixture(scope="module")
        def made():
            (here / "fixture-made").touch()
        @pytest.mark.alone
        def test_after_it(made, prefect_api):
            from prefect.settings import PREFECT_API_URL
            assert (here / "first-ended").exists()
            (here / "second-api").write_text(PREFECT_API_URL.value())
    """))
    done = subprocess.run([sys.executable, str(root / "tests" / "suite.py"), "--workers", "0", "--set-up-at", "50",
                           "-c", str(root / "pyproject.toml"), "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout.split("(collected and set up beside the run above)")[0], done.stdout
    assert "1 passed" in done.stdout.split("(collected and set up beside the run above)")[1], done.stdout
    assert done.stdout.index("test_first_a.py") < done.stdout.index("(collected and set up beside the run above)")
    api = (tmp_path / "first-api").read_text()
    assert api.startswith("http://127.0.0.1:") and (tmp_path / "second-api").read_text() == api  # one API
    with pytest.raises(httpx.ConnectError):  # stopped with the suite
        httpx.get(f"{api}/health", timeout=5)


def test_the_progress_pytest_reports_is_read_from_its_output():
    assert progress_of(b"tests/test_a.py ....                [ 12%]\n....   [ 89%]\n..") == 89
    assert progress_of(b"...   [100%]\n") == 100
    assert progress_of(b"collected 12 items\n....") is None
    assert progress_of(b"[ 89%]\n" + b"." * 100) == 89  # the last mark, however much output follows it


def test_a_process_that_ended_and_waits_to_be_reaped_is_not_still_running():
    """The suite's checks for what a run left behind count a zombie as ended: its parent (a busy
    test process, or process 1 for an orphan) may reap it seconds later."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        process, deadline = psutil.Process(ended.pid), time.monotonic() + 30
        while process.status() != psutil.STATUS_ZOMBIE:  # not reaped: nobody has waited for it yet
            assert time.monotonic() < deadline, process.status()
            time.sleep(0.05)
        assert not still_running(process)
        assert still_running(psutil.Process(sleeping.pid))
    finally:
        sleeping.kill()
        sleeping.wait()
        ended.wait()
    assert not still_running(process)  # reaped: gone
