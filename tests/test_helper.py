"""Single mode's helper process (tasks/cluster/helper.py): jobs run there once it is ready, wait
for it while it starts (or run in the flow's process, by a caller waiting for them), run in the
flow's process after it died, and it never outlives the flow."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gymflow.errors import JobFailed
from gymflow.tasks.cluster.helper import HelperProcess
from gymflow.tasks.cluster.hosts import InProcessHosts
from gymflow.tasks.cluster.rounds import run_round

LOGGER = logging.getLogger("test_helper")


def _ready(helper: HelperProcess, within_s: float = 60.0) -> HelperProcess:
    deadline = time.monotonic() + within_s
    while not helper.ready:
        assert time.monotonic() < deadline, "the helper did not start"
        time.sleep(0.05)
    return helper


@pytest.fixture
def helper():
    instead = InProcessHosts()
    helper = HelperProcess(instead)
    yield helper
    helper.close()


def test_jobs_sent_while_the_helper_starts_wait_for_it_unless_a_waiting_caller_runs_them_here(helper):
    first, second = helper.call(_pid, None, slot=0), helper.call(_pid, None, slot=1)
    assert not helper.ready and not first.done() and not second.done()  # queued, not run on the calling thread
    assert helper.run_one_queued_here()  # the oldest, by a caller that would only wait for it
    assert first.future.result(timeout=0) == os.getpid()
    assert second.future.result(timeout=60) == _ready(helper).process.pid  # sent once the helper was ready
    assert not helper.run_one_queued_here()
    assert run_round(helper, _pid, [None, None], LOGGER) == [helper.process.pid] * 2
    assert helper.instead.jobs == [("_pid", 0)]


def test_the_helper_yields_a_core_to_the_learner(helper):
    from gymflow.tasks.cluster.helper import HELPER_NICENESS

    _ready(helper)
    assert run_round(helper, _niceness, [None], LOGGER) == [min(os.nice(0) + HELPER_NICENESS, 19)]


def test_a_helper_that_does_not_start_in_time_is_ended_and_its_queued_jobs_run_in_this_process(monkeypatch):
    from gymflow.tasks.cluster import helper as helper_module

    monkeypatch.setattr(helper_module, "CHILD_START_TIMEOUT_S", 0.2)  # far less than its imports take
    helper = HelperProcess(InProcessHosts())
    try:
        assert run_round(helper, _pid, [None], LOGGER) == [os.getpid()]
        assert helper.process.wait(10) == -signal.SIGKILL and not helper.ready
        assert run_round(helper, _pid, [None], LOGGER) == [os.getpid()]
    finally:
        helper.close()


def test_a_jobs_error_comes_back_in_one_line_naming_the_helper(helper):
    _ready(helper)
    with pytest.raises(JobFailed) as failed:
        run_round(helper, _fail, ["x"], LOGGER)
    assert str(failed.value) == (f"_fail job of slot 0 in the helper process (pid {helper.process.pid}): "
                                 "ValueError: invalid literal for int() with base 10: 'x'")
    assert "in _fail" in "".join(failed.value.__notes__)  # the helper's traceback rides along
    assert run_round(helper, _pid, [None], LOGGER) == [helper.process.pid]  # it goes on serving


def test_a_job_the_helper_died_under_runs_in_this_process_and_so_do_later_ones(helper):
    _ready(helper)
    call = helper.call(_pid_after_a_while_in_the_helper, os.getpid(), slot=0)
    time.sleep(0.5)
    helper.process.kill()
    deadline = time.monotonic() + 10
    while not call.done():
        assert time.monotonic() < deadline, "the call was left waiting for a dead helper"
        time.sleep(0.05)
    assert helper.settle(call, LOGGER).future.result() == os.getpid()
    assert not helper.ready
    assert run_round(helper, _pid, [None], LOGGER) == [os.getpid()]


def test_the_helper_ends_with_its_flow_even_when_the_flow_is_killed(tmp_path):
    script = tmp_path / "flow.py"
    script.write_text(
        "import sys, time\n"
        "from gymflow.tasks.cluster.helper import HelperProcess\n"
        "from gymflow.tasks.cluster.hosts import InProcessHosts\n"
        "helper = HelperProcess(InProcessHosts())\n"
        "print(helper.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    flow = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    helper_pid = int(flow.stdout.readline())
    flow.send_signal(signal.SIGKILL)
    flow.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(helper_pid) and psutil.Process(helper_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the helper outlived its killed flow"
        time.sleep(0.1)


def test_close_ends_the_helper_at_once_while_a_job_still_runs(helper):
    _ready(helper)
    helper.call(_pid_after_a_while_in_the_helper, os.getpid(), slot=0)
    started = time.monotonic()
    helper.close()
    assert time.monotonic() - started < 5
    assert helper.process.poll() is not None


def _niceness(_) -> int:
    return os.nice(0)


def _pid(_) -> int:
    return os.getpid()


def _fail(text: str) -> int:
    return int(text)


def _pid_after_a_while_in_the_helper(flow_pid: int) -> int:
    if os.getpid() != flow_pid:
        time.sleep(30)
    return os.getpid()
