"""The decision log a serving process keeps (tasks/lake/decision_log.py): every decision and outcome
of concurrent callers stored (count in = count stored), joined by request id, append-only shards
checked when read, and a store that fails costing the caller nothing but a counted drop."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gymflow.errors import GymflowError
from gymflow.tasks.lake.decision_log import Decision, DecisionLog, Outcome, read_logged
from gymflow.tasks.storage.objects import Storage, StorageLocation


def _decision(caller: int, index: int) -> Decision:
    return Decision(f"{caller}-{index}", np.full(3, index, np.float32), index % 2, np.log(0.5), "cartpole", 7, time.time())


def test_concurrent_callers_decisions_and_outcomes_are_all_stored_and_joined_by_request_id(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    log = DecisionLog(storage, "serving/cartpole", shard_records=64)

    def serve(caller: int) -> None:
        for index in range(300):
            log.decided(_decision(caller, index))
            if index % 10:  # every tenth decision's outcome never arrives
                log.observed(Outcome(f"{caller}-{index}", float(index), np.full(3, index + 1, np.float32),
                                     index % 50 == 49, time.time()))

    callers = [threading.Thread(target=serve, args=(caller,)) for caller in range(8)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    log.flush()
    assert log.written == {"decisions": 2_400, "outcomes": 2_160} and log.dropped == {"decisions": 0, "outcomes": 0}
    logged = read_logged(storage, "serving/cartpole")
    assert len(logged.actions) == 2_160 and logged.without_outcome == 240
    for request, observation, reward, following in zip(logged.request_ids, logged.observations, logged.rewards,
                                                       logged.next_observations):
        index = int(str(request).split("-")[1])
        assert observation[0] == index and reward == index and following[0] == index + 1
    assert set(logged.log_probabilities) == {np.log(0.5)} and set(logged.versions) == {7}
    assert len(storage.list("serving/cartpole/decisions")) == -(-2_400 // 64)  # full shards of 64, then the rest


def test_a_store_that_fails_costs_the_caller_nothing_but_counted_drops(tmp_path):
    class Refusing(Storage):
        def write(self, key: str, data: bytes) -> None:
            raise OSError("No space left on device")

    log = DecisionLog(Refusing(StorageLocation(str(tmp_path))), "serving/x", shard_records=10)
    for index in range(25):
        log.decided(_decision(0, index))  # never raises
    log.flush()
    assert log.dropped["decisions"] == 25 and log.written["decisions"] == 0


def test_a_shard_whose_content_is_not_what_was_written_is_refused_in_one_line(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    log = DecisionLog(storage, "serving/y")
    log.decided(_decision(0, 0))
    log.observed(Outcome("0-0", 1.0, np.zeros(3, np.float32), True, time.time()))
    log.flush()
    (key,) = storage.list("serving/y/decisions")
    (tmp_path / key).write_bytes((tmp_path / key).read_bytes()[:-3] + b"xyz")
    with pytest.raises(GymflowError, match=r"^decisions: .* does not hold what was written there$"):
        read_logged(storage, "serving/y")
    with pytest.raises(GymflowError, match="no logged decisions under"):
        read_logged(storage, "serving/none")
