"""Batched inference beside the learner (`distribution.inference: learner`): rollout workers on the
learner's machine send their observations to one process that holds the acting versions on the
learner's device (a GPU), and get the network's outputs back; they step envs with their cores
alone and draw actions from the outputs with their own seeded RNG (Sample Factory's policy
workers, SEED RL's central inference).

The server is `python -m gymflow.tasks.cluster.inference`, started by the flow with an
`InferenceSetup` on its stdin; it listens on a Unix socket with an auth key and answers with the
counters of what it served (`InferenceServed`) when its stdin closes. Each request is one half of a
worker's envs (agents.rollout.collect_in_halves): a version and a batch of observations; whatever
requests are waiting when the server looks are computed in one forward per version. A worker on
another machine, one that cannot connect, or one whose server has gone, computes its outputs
itself (`RemoteOutputs`), so a run never depends on the server.
"""

from __future__ import annotations

import copy
import os
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np

from gymflow.tasks.cluster.messages import InferenceAddress
from gymflow.tasks.cluster.wire import read_frame, write_frame
from gymflow.tasks.storage.objects import StorageLocation

_REQUEST = struct.Struct("!qq")  # policy version, rows; the observations' bytes follow
_REPLY = struct.Struct("!8sq")  # the outputs' numpy dtype, columns (-1: the version cannot be served)
START_TIMEOUT_S = 60.0
VERSIONS_KEPT = 8  # networks kept on the device, the newest used: ASYNC chunks act with recent ones


@dataclass(frozen=True)
class InferenceSetup:
    """What the server needs to load and run a run's policy versions."""

    address: InferenceAddress
    storage: StorageLocation
    run_id: str
    agent: Any  # the agent's pydantic config
    observation_space: Any
    action_space: Any
    device: str  # the learner's: cuda, cuda:N or cpu


@dataclass(frozen=True)
class InferenceServed:
    """What a server did over its life: requests, rows and forwards, and its busy seconds."""

    requests: int = 0
    rows: int = 0
    forwards: int = 0
    busy_seconds: float = 0.0
    problem: str = ""  # why it stopped serving early, if it did

    def metrics(self) -> dict[str, float]:
        return {"inference/requests": float(self.requests), "inference/rows": float(self.rows),
                "inference/rows_per_forward": self.rows / self.forwards if self.forwards else 0.0,
                "inference/busy_seconds": self.busy_seconds}


def this_machine() -> str:
    """The host name and this boot's id: a Unix socket's path means the same socket only there."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class InferenceServer:
    """The flow's side: the server process, its address, and what it served once closed."""

    def __init__(self, setup: InferenceSetup, process: subprocess.Popen):
        self.setup, self.process = setup, process
        self.served: InferenceServed | None = None

    @property
    def address(self) -> InferenceAddress:
        return self.setup.address

    @classmethod
    def start(cls, storage: StorageLocation, run_id: str, agent: Any, spaces: tuple[Any, Any], device: str
              ) -> InferenceServer:
        """Start a server and wait until it listens; raises `InferenceUnavailable` if it cannot."""
        folder = tempfile.mkdtemp(prefix="gymflow-inference-")
        address = InferenceAddress(os.path.join(folder, "socket"), secrets.token_bytes(16), this_machine())
        setup = InferenceSetup(address, storage, run_id, agent, *spaces, device)
        path = os.pathsep.join(entry for entry in sys.path if entry)  # the user's env modules import there too
        process = subprocess.Popen([sys.executable, "-m", "gymflow.tasks.cluster.inference"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path},
                                   start_new_session=True)
        server = cls(setup, process)
        write_frame(process.stdin, cloudpickle.dumps(setup))
        ready = _read_within(process, START_TIMEOUT_S)
        if ready is None or ready != b"ready":
            server.close()
            reason = ready.decode(errors="replace") if ready else f"no answer in {START_TIMEOUT_S:.0f} s"
            raise InferenceUnavailable(f"the inference server on {device} did not start: {reason}")
        return server

    def close(self) -> InferenceServed:
        """End the server (its stdin closes) and read what it served."""
        if self.served is not None:
            return self.served
        try:
            self.process.stdin.close()
        except OSError:
            pass
        reply = _read_within(self.process, 10.0)
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        try:
            served = cloudpickle.loads(reply) if reply else None
        except Exception:  # noqa: BLE001 (a cut-off answer: the server died)
            served = None
        self.served = served if isinstance(served, InferenceServed) else InferenceServed(
            problem=f"the inference server exited with code {self.process.returncode}")
        Path(self.address.path).unlink(missing_ok=True)
        Path(self.address.path).parent.rmdir()
        return self.served


class InferenceUnavailable(RuntimeError):
    pass


def _read_within(process: subprocess.Popen, seconds: float) -> bytes | None:
    """The server's next frame, or None if it exits or says nothing for `seconds`."""
    frame: list[bytes | None] = [None]
    reader = threading.Thread(target=lambda: frame.__setitem__(0, read_frame(process.stdout)), daemon=True)
    reader.start()
    reader.join(seconds)
    if reader.is_alive():
        process.kill()
        reader.join()
    return frame[0]


class RemoteOutputs:
    """A worker's side (an `OutputsSource`): requests to its machine's server, answered in order;
    once the server cannot answer (gone, or the version retired there), the outputs of everything
    still asked for and everything after come from `policy.outputs`, on the worker's CPU."""

    def __init__(self, connection: Connection | None, version: int, policy: Any):
        self.connection, self.version, self.policy = connection, version, policy
        self.asked: deque[np.ndarray] = deque()
        self.remote_rows = 0

    def request(self, obs: np.ndarray) -> None:
        self.asked.append(obs)
        if self.connection is not None:
            try:
                self.connection.send_bytes(_REQUEST.pack(self.version, len(obs)) + np.ascontiguousarray(obs).tobytes())
            except OSError:
                self._give_up()

    def receive(self) -> np.ndarray:
        obs = self.asked.popleft()
        if self.connection is not None:
            try:
                reply = self.connection.recv_bytes()
                dtype, columns = _REPLY.unpack_from(reply)
                if columns >= 0:
                    self.remote_rows += len(obs)
                    body = np.frombuffer(reply, dtype=np.dtype(dtype.rstrip(b"\0").decode()), offset=_REPLY.size)
                    return body.reshape(len(obs), columns)
            except (OSError, EOFError):
                pass
            self._give_up()
        return self.policy.outputs(obs)

    def _give_up(self) -> None:
        """The server is gone for this worker: every later output is its own."""
        for address, connection in list(_CONNECTIONS.items()):
            if connection is self.connection:
                del _CONNECTIONS[address]
        self.connection.close()  # replies still owed on it are not read: a later chunk connects anew
        self.connection = None


_CONNECTIONS: dict[InferenceAddress, Connection] = {}  # a worker process's open connection to each server


def connect(address: InferenceAddress) -> Connection | None:
    """This process's connection to the server at `address`; None where it cannot be reached (another
    machine, a server that has gone)."""
    if address in _CONNECTIONS:
        return _CONNECTIONS[address]
    if address.machine != this_machine() or not os.path.exists(address.path):
        return None
    try:
        connection = Client(address.path, family="AF_UNIX", authkey=address.authkey)
    except (OSError, EOFError):
        return None
    _CONNECTIONS[address] = connection
    return connection


class _Versions:
    """The server's networks, one per policy version, loaded from storage as first asked for."""

    def __init__(self, setup: InferenceSetup):
        from gymflow.agents.algorithms import algorithm_of

        self.setup, self.algorithm = setup, algorithm_of(setup.agent)
        self.policies: OrderedDict[int, Any] = OrderedDict()

    def policy(self, version: int) -> Any | None:
        """The version's policy on the device; None if it cannot be read (retired)."""
        if version not in self.policies:
            try:
                self.policies[version] = self._load(version)
            except Exception:  # noqa: BLE001 (the worker computes that version's outputs itself)
                return None
            while len(self.policies) > VERSIONS_KEPT:
                self.policies.popitem(last=False)
        return self.policies[version]

    def _load(self, version: int) -> Any:
        from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
        from gymflow.tasks.storage.codec import decode_tensors
        from gymflow.tasks.storage.layout import RunLayout
        from gymflow.tasks.storage.objects import open_storage

        setup = self.setup
        blobs = read_policy(open_storage(setup.storage), RunLayout(setup.run_id), version, [POLICY_BLOB])
        if self.policies:
            network = copy.deepcopy(next(reversed(self.policies.values())).network)
        else:
            network = self.algorithm.network(setup.agent, setup.observation_space, setup.action_space)
            network = network.to(setup.device).eval()
        network.load_state_dict(decode_tensors(blobs[POLICY_BLOB]))
        return self.algorithm.policy(network, setup.agent, 0.0, 0)


class _Serving:
    """The server's loop: accept workers, answer what is waiting in one forward per version."""

    def __init__(self, setup: InferenceSetup, listener: Listener):
        from gymflow.envs.vector import observation_dtype

        self.versions, self.listener = _Versions(setup), listener
        self.obs_dtype = np.dtype(observation_dtype(setup.observation_space))
        self.obs_shape = setup.observation_space.shape
        self.connections: list[Connection] = []
        self.joined: list[Connection] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.counts = {"requests": 0, "rows": 0, "forwards": 0}
        self.busy = 0.0

    def accept(self) -> None:
        while not self.stopped.is_set():
            try:
                connection = self.listener.accept()
            except (OSError, EOFError):  # a client that failed the handshake, or the listener closed
                continue
            with self.lock:
                self.joined.append(connection)

    def serve(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                self.connections += self.joined
                self.joined.clear()
            if not self.connections:
                time.sleep(0.01)
                continue
            ready = wait(self.connections, timeout=0.05)
            if ready:
                started = time.perf_counter()
                self._answer(self._requests(ready))
                self.busy += time.perf_counter() - started

    def _requests(self, ready: list[Any]) -> dict[int, list[tuple[Connection, np.ndarray]]]:
        by_version: dict[int, list[tuple[Connection, np.ndarray]]] = {}
        for connection in ready:
            try:
                message = connection.recv_bytes()
            except (OSError, EOFError):  # the worker closed or died
                self.connections.remove(connection)
                continue
            version, rows = _REQUEST.unpack_from(message)
            obs = np.frombuffer(message, self.obs_dtype, offset=_REQUEST.size).reshape(rows, *self.obs_shape)
            by_version.setdefault(version, []).append((connection, obs))
        return by_version

    def _answer(self, by_version: dict[int, list[tuple[Connection, np.ndarray]]]) -> None:
        for version, asked in by_version.items():
            policy = self.versions.policy(version)
            if policy is None:
                replies = [_REPLY.pack(b"", -1)] * len(asked)
            else:
                outputs = policy.outputs(np.concatenate([obs for _, obs in asked]))
                self.counts["forwards"] += 1
                bounds = np.cumsum([0] + [len(obs) for _, obs in asked])
                replies = [_REPLY.pack(outputs.dtype.str.encode(), outputs.shape[1])
                           + np.ascontiguousarray(outputs[start:end]).tobytes()
                           for start, end in zip(bounds[:-1], bounds[1:])]
            for (connection, obs), reply in zip(asked, replies, strict=True):
                self.counts["requests"] += 1
                self.counts["rows"] += len(obs)
                try:
                    connection.send_bytes(reply)
                except OSError:
                    self.connections.remove(connection)

    def served(self, problem: str = "") -> InferenceServed:
        return InferenceServed(**self.counts, busy_seconds=self.busy, problem=problem)


def serve() -> None:
    """The server process: read the setup, listen, say `ready`, serve until stdin closes, then
    answer with what was served."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing printed may land among the frames
    setup: InferenceSetup = cloudpickle.loads(read_frame(sys.stdin.buffer))
    try:
        import torch

        torch.set_num_threads(1)  # the worker cores step envs; a GPU's forward needs one thread to launch
        listener = Listener(setup.address.path, family="AF_UNIX", authkey=setup.address.authkey)
        serving = _Serving(setup, listener)
    except Exception as error:  # noqa: BLE001 (said to the flow in its start's one line)
        write_frame(replies, f"{type(error).__name__}: {error}".encode())
        return
    write_frame(replies, b"ready")
    threading.Thread(target=serving.accept, name="inference-accept", daemon=True).start()
    server = threading.Thread(target=serving.serve, name="inference-serve", daemon=True)
    server.start()
    read_frame(sys.stdin.buffer)  # returns when the flow closes stdin (or exits)
    serving.stopped.set()
    server.join(5.0)
    write_frame(replies, cloudpickle.dumps(serving.served()))


if __name__ == "__main__":  # its answers must pickle as this module's types, not __main__'s
    from gymflow.tasks.cluster import inference

    inference.serve()
