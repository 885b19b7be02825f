"""The learner's ranks (distribution.learners > 1), from the flow's side: the flow's learner is
rank 0; ranks 1..N-1 are `python -m gymflow.tasks.training.learner_rank` children on the flow's
machine, each holding the same learner (agents/data_parallel.py shares each minibatch's rows out
and averages the gradients over a torch.distributed group).

What rank 0's learner is asked to do (learn, insert, train), every rank does: the call and its
rollouts go to each child as frames on its stdin (tasks/cluster/wire.py; JSON and npz, never a
pickle), then rank 0 does it itself, the children doing it alongside. A child first gets rank 0's
whole training state (and its replay memory), so it starts as rank 0 stands: after a resume, a
warm start or a heatup alike. The group rendezvous through a file in a folder of the flow's
user's own (0700); gloo listens on loopback.

A rank lost mid-call (killed, out of memory) breaks the group's next collective on rank 0: rank 0
puts back the training state it had before the call, starts the children again, gives them that
state, and makes the call again, so a SYNC run ends with the weights of a run that lost none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from gymflow.agents.batches import Rollout
from gymflow.agents.core import Learner, ReplayLearner
from gymflow.logs import AnyLogger
from gymflow.presets.model import Preset
from gymflow.tasks.cluster.host_figures import node_id
from gymflow.tasks.cluster.wire import read_frame_within, start_child, write_frame
from gymflow.tasks.storage.codec import decode_arrays, decode_state, encode_arrays, encode_state

RANK_MODULE = "gymflow.tasks.training.learner_rank"
START_TIMEOUT_S = 180.0  # a rank's imports and its learner, on a loaded machine
COLLECTIVE_TIMEOUT_S = 600.0  # a collective's wait for the slowest rank (they run the same work)
ATTEMPTS = 3  # a call made again on a group started again, at most this many times in all
STOP_WAIT_S = 10.0
Result = TypeVar("Result")


class RankLost(RuntimeError):
    """A learning rank was lost more often than a call is made again."""


@dataclass(frozen=True)
class RankSetup:
    """What a rank's child is told first: who it is, where the group meets, what it learns."""

    rank: int
    world: int
    store: str  # the rendezvous file
    device: str
    threads: int
    preset: dict[str, Any]  # the run's preset, its storage options left out (a rank touches no storage)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RankSetup:
        return cls(**json.loads(data))


@dataclass(frozen=True)
class LearnerCall:
    """One call every rank makes on its learner, with `blobs` frames of bytes after it."""

    op: Literal["sync", "learn", "insert", "train"]
    progress: float = 0.0
    streams: list[int] | None = None
    steps: int = 0
    blobs: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LearnerCall:
        return cls(**json.loads(data))


def make_group(store_path: str, rank: int, world: int, device: str) -> Any:
    """The ranks' process group: gloo over loopback on CPU, NCCL on GPUs."""
    import torch
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    store.set_timeout(timedelta(seconds=START_TIMEOUT_S))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # its sockets on loopback: the ranks share one host
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        return dist.ProcessGroupNCCL(store, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, options)


def rank_preset(preset: Preset) -> dict[str, Any]:
    """The preset a rank's child rebuilds its learner from: no storage options and no tracking URI
    (credentials may be among them, and a rank reads and writes no storage and records nothing)."""
    kept_out = {"storage": preset.storage.model_copy(update={"options": {}}), "tracking": type(preset.tracking)()}
    return preset.model_copy(update=kept_out).model_dump(mode="json")


def encode_rollouts(rollouts: Sequence[Rollout]) -> bytes:
    arrays = {f"{index}.{name}": value for index, rollout in enumerate(rollouts)
              for name, value in rollout._asdict().items() if value is not None}
    return encode_arrays(arrays)


def decode_rollouts(data: bytes) -> list[Rollout]:
    fields: dict[int, dict[str, np.ndarray]] = {}
    for key, value in decode_arrays(data).items():
        index, _, name = key.partition(".")
        fields.setdefault(int(index), {})[name] = value
    return [Rollout(**fields[index]) for index in sorted(fields)]


def training_state(learner: Learner) -> list[bytes]:
    """The learner's whole training state as frames (with its replay memory's, for a replay learner)."""
    tensors, tree = encode_state(learner.state_dict())
    if isinstance(learner, ReplayLearner):
        return [tensors, tree, encode_arrays(learner.replay.state_dict())]
    return [tensors, tree]


def load_training_state(learner: Learner, blobs: Sequence[bytes]) -> None:
    learner.load_state_dict(decode_state(blobs[0], blobs[1]))
    if isinstance(learner, ReplayLearner):
        learner.replay.load_state_dict(decode_arrays(blobs[2]))


@dataclass
class _Snapshot:
    """Rank 0's training state before a call, to put back if a rank is lost during it."""

    state: tuple[bytes, bytes]
    priorities: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, learner: Learner) -> _Snapshot:
        priorities = learner.replay.priorities() if isinstance(learner, ReplayLearner) else {}
        return cls(encode_state(learner.state_dict()), priorities)

    def restore(self, learner: Learner) -> None:
        learner.load_state_dict(decode_state(*self.state))
        if isinstance(learner, ReplayLearner):
            learner.replay.load_priorities(self.priorities)


class LearnerRanks:
    """Rank 0's side of the group: its children, started at once (their imports overlap the run's
    start), connected at the first call."""

    def __init__(self, learner: Learner, preset: Preset, devices: Sequence[str], logger: AnyLogger):
        self.learner, self.preset, self.devices, self.logger = learner, preset, list(devices), logger
        self.restarts = 0
        self._group: Any = None
        self._processes: dict[int, Any] = {}  # psutil's, by pid: CPU figures are since the previous sample
        self._folder, self._children = self._spawn()

    @property
    def world(self) -> int:
        return len(self.devices)

    def learn(self, rollouts: Sequence[Rollout], progress: float, streams: Sequence[int] | None = None
              ) -> dict[str, float]:
        """A SYNC iteration (a replay learner's: its insert, then its train steps)."""
        learner = self.learner
        if isinstance(learner, ReplayLearner):
            self.insert(rollouts)
            return self.train(learner.config.train_steps_per_iteration, progress)
        call = LearnerCall("learn", progress, None if streams is None else list(streams), blobs=1)
        return self._mirrored(call, [encode_rollouts(rollouts)], lambda: learner.learn(rollouts, progress, streams))

    def insert(self, rollouts: Sequence[Rollout]) -> None:
        assert isinstance(self.learner, ReplayLearner)
        learner = self.learner
        self._mirrored(LearnerCall("insert", blobs=1), [encode_rollouts(rollouts)], lambda: learner.insert(rollouts))

    def train(self, steps: int, progress: float) -> dict[str, float]:
        assert isinstance(self.learner, ReplayLearner)
        learner = self.learner
        return self._mirrored(LearnerCall("train", progress, steps=steps), [], lambda: learner.train(steps, progress))

    def figures(self) -> dict[str, dict[str, float]]:
        """Each child rank's process figures, as system metrics' nodes (`learner-HOST-PID`; its GPU's
        utilisation is the flow's node's `gpu_N_...`, a GPU's figures being the machine's)."""
        import psutil

        figures = {}
        for child in self._children:
            try:
                process = self._processes.setdefault(child.pid, psutil.Process(child.pid))
                figures[node_id("learner", f"{socket.gethostname()}:{child.pid}")] = {
                    "process_cpu_percentage": process.cpu_percent(None),
                    "process_memory_rss_megabytes": process.memory_info().rss / 2**20}
            except psutil.Error:  # gone: started again at the next call
                continue
        return figures

    def _mirrored(self, call: LearnerCall, blobs: list[bytes], here: Callable[[], Result]) -> Result:
        """`call` made by every rank: sent to the children, then made here; made again on a group
        started again where a rank is lost during it."""
        for attempt in range(1, ATTEMPTS + 1):
            before = _Snapshot.of(self.learner) if call.op != "insert" else None  # an insert is not collective
            try:
                self._connect()  # a rank lost while the group is made or takes rank 0's state: lost during the call
                self._send(call, blobs)
                return here()
            except RankLost:  # a rank that never started: its error is above, starting it again would not help
                raise
            except (RuntimeError, OSError) as error:
                lost = self._lost_rank(error)
                if lost is None:
                    raise
                self.logger.warning("learner rank %s lost during its %s (%s); the ranks start again from before it "
                                    "(attempt %d of %d)", lost, call.op, _first_line(error), attempt, ATTEMPTS)
                if before is not None:
                    before.restore(self.learner)
                self._restart()
        raise RankLost(f"distribution.learners: a learning rank was lost {ATTEMPTS} times in one {call.op}")

    def _connect(self) -> None:
        """The group, made once every child has started; every child given rank 0's state."""
        if self._group is not None:
            return
        from gymflow.agents.data_parallel import Ranks

        for rank, child in enumerate(self._children, start=1):
            if read_frame_within(child, START_TIMEOUT_S) is None:
                raise RankLost(f"distribution.learners: learner rank {rank} did not start (exit code "
                               f"{child.poll()}; its error is above)")
        self._group = make_group(self._store, 0, self.world, self.devices[0])
        self.learner.join(Ranks(0, self.world, self._group, self.devices[0]))
        blobs = training_state(self.learner)
        self._send(LearnerCall("sync", blobs=len(blobs)), blobs)

    def _send(self, call: LearnerCall, blobs: Sequence[bytes]) -> None:
        for child in self._children:
            write_frame(child.stdin, call.to_json())
            for blob in blobs:
                write_frame(child.stdin, blob)

    def _lost_rank(self, error: BaseException) -> int | None:
        """The rank whose loss `error` is (its child gone), or None where every child lives."""
        deadline = time.monotonic() + 2.0  # a killed child's exit is seen a moment after its socket closes
        while True:
            for rank, child in enumerate(self._children, start=1):
                if child.poll() is not None:
                    return rank
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    @property
    def _store(self) -> str:
        return _rendezvous(self._folder)

    def _spawn(self) -> tuple[str, list[subprocess.Popen]]:
        folder = tempfile.mkdtemp(prefix="gymflow-ranks-")  # 0700: the flow's user's alone
        store = _rendezvous(folder)
        children = []
        for rank in range(1, self.world):
            child = start_child(RANK_MODULE, credentials=False)  # a rank reads no storage, records nothing
            setup = RankSetup(rank, self.world, store, self.devices[rank], self.preset.distribution.learner_threads,
                              rank_preset(self.preset))
            write_frame(child.stdin, setup.to_json())
            children.append(child)
        return folder, children

    def _restart(self) -> None:
        self._stop_children()
        self.restarts += 1
        self._folder, self._children = self._spawn()

    def _stop_children(self) -> None:
        connected, self._group = self._group is not None, None
        self.learner.join(None)
        for child in self._children:
            try:
                child.stdin.close()
            except OSError:
                pass
        for child in self._children:
            try:
                child.wait(STOP_WAIT_S if connected else 0)  # one never connected waits in the group's making
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        shutil.rmtree(self._folder, ignore_errors=True)

    def close(self) -> None:
        """The children told to exit (their stdin closed) and waited for; the learner alone again."""
        self._stop_children()


def _rendezvous(folder: str) -> str:
    """The file the ranks' group meets through, in the group's own folder."""
    return str(Path(folder) / "rendezvous")


def _first_line(error: BaseException) -> str:
    """The error's first line without gloo's source location and advice."""
    line = (str(error).splitlines() or [type(error).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line).partition(". This is typically")[0][:200]
