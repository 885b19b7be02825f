"""A learner on a GPU holds that GPU's Prefect global concurrency slot: under a real Prefect API,
a second holder of the same device waits (and says so) until the first lets go; another GPU or a
CPU learner does not wait. The slot is a name; no GPU is needed to hold it."""

from __future__ import annotations

import threading
import time

from prefect.client.orchestration import get_client

from gymflow.tasks.training.gpu_slot import gpu_slot, slot_name


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

    with gpu_slot("cuda:0", _Said(), host="testhost") as name:
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
    assert said.lines[0].startswith("waiting for gpu-testhost-0: another run trains on this GPU")
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("gpu-testhost-0")
    assert limit.limit == 1 and limit.active_slots == 0
