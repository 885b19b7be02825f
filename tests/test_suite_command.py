"""The README's test command (tests/suite.py): how it splits pytest's arguments and joins its two
runs' exit codes."""

from tests.suite import DEFAULT_MARKERS, outcome, split_markers


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
