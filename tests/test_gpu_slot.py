"""A learner on a GPU holds one of that GPU's slots: under a real Prefect API, a second holder of
the same device waits (saying who holds it) until the first lets go, for a bounded time; another GPU
or a CPU learner does not wait; a holder killed outright gives its slot back. The slot is a name; no
GPU is needed to hold it."""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
from prefect.settings import PREFECT_API_URL, temporary_settings

import gymflow.tasks.training.gpu_slot as slots
from gymflow.errors import ClusterUnavailable
from gymflow.tasks.training.gpu_slot import gpu_slot, slot_name
from tests.servers import PrefectServer


class _Said:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str, *args) -> None:
        self.lines.append(message % args)

    warning = info


def test_slot_names_are_one_per_gpu_of_each_host():
    assert slot_name("cuda", "node.a_1") == "gpu-node-a-1-0" and slot_name("cuda:3", "b") == "gpu-b-3"
    assert slot_name("cpu", "b") is None and slot_name("mps", "b") is None


def test_a_second_run_on_the_same_gpu_waits_for_the_first_and_says_so(prefect_api):
    said, order = _Said(), []

    def second() -> None:
        with gpu_slot("cuda:0", said, host="testhost") as name:
            order.append(("second holds", name, time.monotonic()))

    with gpu_slot("cuda:0", _Said(), host="testhost", run="first") as name:
        assert name == "gpu-testhost-0"
        waiting = threading.Thread(target=second)
        waiting.start()
        time.sleep(4.0)
        assert not order, "the second run took the GPU while the first held it"
        with gpu_slot("cuda:1", _Said(), host="testhost") as other, gpu_slot("cpu", _Said()) as none:
            assert other == "gpu-testhost-1" and none is None  # another GPU, or none: no wait
        released = time.monotonic()
    waiting.join(timeout=30)
    assert order and order[0][2] >= released
    assert said.lines[0].startswith(f"waiting for gpu-testhost-0: run first (pid {os.getpid()}, for ")
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("gpu-testhost-0")
    assert limit.limit == 1 and limit.active_slots == 0


HOLDS_A_SLOT = """
import logging, sys, time
from gymflow.tasks.training.gpu_slot import gpu_slot
with gpu_slot("cuda:0", logging.getLogger("holder"), host=sys.argv[1], run="killed-run"):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_slot_held_by_a_run_killed_outright_comes_back_and_a_wait_for_a_held_one_is_bounded(prefect_api):
    """SIGKILL, as the OOM killer does: the command's temporary Prefect API dies with the run and
    its lease with it, leaving the limit's count taken; the next run takes the slot at once."""
    host = f"killed-{uuid.uuid4().hex[:6]}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_A_SLOT, host], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    try:
        assert holder.stdout.readline().strip() == "holding"
        said = _Said()
        with pytest.raises(ClusterUnavailable, match=rf"^distribution.gpu_wait_s: gpu-{host}-0 was still held after "
                                                     rf"1 s, by run killed-run \(pid {holder.pid}, for \d+ s\)"):
            with gpu_slot("cuda:0", said, host=host, run="impatient", wait_s=1.0):
                pass
        (waiting,) = said.lines
        assert waiting.startswith(f"waiting for gpu-{host}-0: run killed-run (pid {holder.pid}, for ")
    finally:
        holder.kill()
        holder.wait()
    said, started = _Said(), time.monotonic()
    with gpu_slot("cuda:0", said, host=host, run="next", wait_s=30.0) as name, get_client(sync_client=True) as client:
        waited = time.monotonic() - started
        assert client.read_global_concurrency_limit_by_name(name).active_slots == 1
    assert waited < 15, f"the slot came back after {waited:.1f} s"
    assert said.lines == [f"{name}: a run that held it ended without letting go; its slot is given back"]
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(name).active_slots == 0


def test_a_gpu_given_no_slots_is_refused_in_one_line(prefect_api):
    name = slot_name("cuda:0", host := f"none-{uuid.uuid4().hex[:6]}")
    with gpu_slot("cuda:0", _Said(), host=host):
        pass  # the limit made, with one slot
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=0))
    with pytest.raises(ClusterUnavailable, match=rf"^distribution.learner_device: the Prefect limit {name} has 0 "
                                                 rf"slots, so no run may train on that GPU; allowed: `prefect gcl "
                                                 rf"update {name} --limit 1`$"):
        with gpu_slot("cuda:0", _Said(), host=host):
            pass


def test_a_link_planted_in_the_shared_folder_is_not_followed_and_a_foreign_folder_is_refused(
        prefect_api, tmp_path, monkeypatch):
    folder = tmp_path / "gpu-slots"
    monkeypatch.setattr(slots, "SLOTS_FOLDER", folder)
    host = f"planted-{uuid.uuid4().hex[:6]}"
    name = slot_name("cuda:0", host)
    with gpu_slot("cuda:0", _Said(), host=host):
        assert (folder / f"{name}.0.holder").exists()
    assert folder.stat().st_mode & 0o7777 == 0o1777  # sticky: nobody removes another user's files
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (folder / f"{name}.0.holder").symlink_to(victim)  # a link where the next holder writes its name
    with gpu_slot("cuda:0", _Said(), host=host) as held:
        assert held == name
    assert victim.read_text() == "mine"
    (folder / f"{name}.0.lock").unlink()
    (folder / f"{name}.0.lock").symlink_to(tmp_path / "made-through-the-link")
    with pytest.raises(ClusterUnavailable, match=rf"^distribution.learner_device: {folder / name}.0.lock is a link, "
                                                 r"which this run does not follow; allowed: remove it$"):
        with gpu_slot("cuda:0", _Said(), host=host):
            pass
    assert not (tmp_path / "made-through-the-link").exists()

    for planted in ("link", "open", "foreign")[:3 if os.geteuid() == 0 else 2]:
        other = tmp_path / f"other-{planted}"
        other.mkdir()
        other.chmod(0o777 if planted != "foreign" else 0o1777)  # open: anyone could swap the lock files
        if planted == "link":
            other = other.with_name("link-to-it")
            other.symlink_to(tmp_path / "other-link")
        if planted == "foreign":
            os.chown(other, 65534, 65534)  # made first by another user of the host
        monkeypatch.setattr(slots, "SLOTS_FOLDER", other)
        what = {"link": "a link", "open": "writable by others, not sticky",
                "foreign": "owned by (user nobody|uid 65534)"}[planted]
        with pytest.raises(ClusterUnavailable, match=rf"^distribution.learner_device: {other} \({what}\) could be "
                                                     rf"turned against this run; allowed: remove it, or have root"):
            with gpu_slot("cuda:0", _Said(), host=host):
                pass


def test_a_slot_held_through_a_prefect_server_restart_keeps_training_and_says_so_in_one_line(
        tmp_path, monkeypatch, caplog):
    """The server keeps leases in memory: after a restart the next renewal is refused (410 Gone). The
    run's training goes on (it used to be cancelled: a CancelledError in the holding thread), its GPU
    still its own by the lock file, and the terminal shows one line, not Prefect's retries and tracebacks."""
    import prefect.concurrency._leases as leases

    monkeypatch.setattr(leases, "_RENEWAL_FRACTION", 0.05)  # renewed every 3 s (the server's shortest lease: 60 s)
    monkeypatch.setattr(slots, "LEASE_SECONDS", 60.0)
    server, said, host = PrefectServer(tmp_path), _Said(), f"restart-{uuid.uuid4().hex[:6]}"
    server.start()
    try:
        with temporary_settings({PREFECT_API_URL: server.url}), caplog.at_level(logging.DEBUG):
            with gpu_slot("cuda:0", said, host=host, run="trains") as name:
                server.kill()
                server.start()
                deadline = time.monotonic() + 60
                while not said.lines and time.monotonic() < deadline:
                    time.sleep(0.2)  # training: a CancelledError would land here
                time.sleep(4.0)  # a renewal more: still training
            assert said.lines == [f"{name}: the Prefect server no longer answers for this run's lease on it (restarted, "
                                  "or out of reach); training goes on, the GPU still this run's by its lock file"]
            renewal = [record for record in caplog.records if record.threadName.startswith(slots.RENEWAL_THREAD)
                       and (record.levelno >= logging.WARNING or record.name.startswith("prefect"))]
            assert renewal == [], [record.getMessage() for record in renewal]
            again = _Said()
            with gpu_slot("cuda:0", again, host=host, run="next", wait_s=10) as taken:
                assert taken == name  # the count the lost lease left is given back by the next holder
            assert again.lines == [f"{name}: a run that held it ended without letting go; its slot is given back"]
    finally:
        server.kill()


def test_a_slot_s_files_are_made_for_every_user_and_another_user_s_unopenable_lock_is_one_line(monkeypatch):
    """Under umask 077 a lock file used to be made 0600, and another user's run died on a raw
    PermissionError opening it. Now this user's files are made 0644 whatever the umask; a lock file
    another user may not open counts as held, and the wait's end names it and its owner in one line
    (checked as uid 65534 where this is root)."""
    folder = Path(tempfile.mkdtemp(prefix="gymflow-slots-test-"))  # under /tmp: reachable by another uid
    try:
        folder.chmod(0o1777)
        monkeypatch.setattr(slots, "SLOTS_FOLDER", folder)
        name = slot_name("cuda:0", f"umask-{uuid.uuid4().hex[:6]}")
        previous = os.umask(0o077)
        try:
            with slots._slot_lock(name, 1, _Said(), "mine", wait_s=0):
                assert {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()} == {
                    f"{name}.0.lock": 0o644, f"{name}.0.holder": 0o644}
        finally:
            os.umask(previous)
        if os.geteuid() != 0:
            return  # the modes above are what let another user in; switching uid needs root
        (folder / f"{name}.0.lock").chmod(0o600)  # as an older gymflow left it, under umask 077
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # another user of the host, trying the same GPU
            os.close(read)
            try:
                os.setgid(65534)
                os.setuid(65534)
                with slots._slot_lock(name, 1, _Said(), "theirs", wait_s=0):
                    said = "took the slot"
            except ClusterUnavailable as error:
                said = f"ClusterUnavailable: {error}"
            except BaseException as error:  # noqa: BLE001 - what the test reports
                said = f"{type(error).__name__}: {error}"
            os.write(write, said.encode())
            os._exit(0)
        os.close(write)
        if not select.select([read], [], [], 60)[0]:  # a child that hangs (a lock some thread held at the fork)
            os.kill(child, 9)
        with os.fdopen(read) as answer:
            said = answer.read()
        os.waitpid(child, 0)
        lock = folder / f"{name}.0.lock"
        assert said.startswith(f"ClusterUnavailable: distribution.gpu_wait_s: {name} was still held after 0 s, "
                               f"by {lock} (user root's, mode 600: held by their run, or left by one); allowed: "), said
        assert "\n" not in said
    finally:
        shutil.rmtree(folder)
