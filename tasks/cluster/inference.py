"""Batched inference beside the learner (`distribution.inference: learner`): rollout workers on the
learner's machine send their observations to one process that holds the acting versions on the
learner's device (a GPU), and get the network's outputs back; they step envs with their cores
alone and draw actions from the outputs with their own seeded RNG (Sample Factory's policy
workers, SEED RL's central inference).

The server is `python -m gymflow.tasks.cluster.inference`, a child that talks in frames
(tasks/cluster/wire.py's `start_child`), started by the flow with an `InferenceSetup` on its
stdin; it listens on a Unix socket with an auth key and answers with the counters of what it
served (`InferenceServed`) when its stdin closes. Each request is one half of a worker's envs
(agents.rollout.collect_in_halves): a version and a batch of observations; whatever requests are
waiting when the server looks are computed in one forward per version. A worker on another
machine, one that cannot connect, or one whose server has gone, computes its outputs itself
(`RemoteOutputs`, tasks/cluster/inference_client.py: the workers' side), so a run never depends
on the server: a request the server cannot answer (a malformed one, a forward that raised) gets an
error reply, a worker waits at most `REPLY_TIMEOUT_S` for a reply, a client with a wrong key is
turned away without stopping the others, and a server that keeps failing stops serving, saying
why once.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge, wait
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np

from gymflow.tasks.cluster.inference_client import NOT_SERVED, REPLY, REQUEST, this_machine
from gymflow.tasks.cluster.messages import InferenceAddress
from gymflow.tasks.cluster.wire import (
    CHILD_START_TIMEOUT_S,
    frames_out,
    read_frame,
    read_frame_within,
    start_child,
    write_frame,
)
from gymflow.tasks.storage.objects import StorageLocation

FAILURES_IN_A_ROW = 3  # forwards that raised one after another before the server stops serving
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
    failed: int = 0  # requests answered with an error (the workers computed those outputs themselves)
    refused: int = 0  # clients turned away: a wrong key, or gone during the handshake
    problem: str = ""  # the first error it met while serving, and whether it stopped serving for it

    def metrics(self) -> dict[str, float]:
        return {"inference/requests": float(self.requests), "inference/rows": float(self.rows),
                "inference/rows_per_forward": self.rows / self.forwards if self.forwards else 0.0,
                "inference/busy_seconds": self.busy_seconds}


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
        process = start_child("gymflow.tasks.cluster.inference")
        server = cls(setup, process)
        write_frame(process.stdin, cloudpickle.dumps(setup))
        ready = read_frame_within(process, CHILD_START_TIMEOUT_S)
        if ready is None or ready != b"ready":
            server.close()
            reason = ready.decode(errors="replace") if ready else f"no answer in {CHILD_START_TIMEOUT_S:.0f} s"
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
        reply = read_frame_within(self.process, 10.0)
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
        from gymflow.agents.networks import network_of_version
        from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
        from gymflow.tasks.storage.codec import decode_tensors
        from gymflow.tasks.storage.layout import RunLayout
        from gymflow.tasks.storage.objects import open_storage

        setup = self.setup
        blobs = read_policy(open_storage(setup.storage), RunLayout(setup.run_id), version, [POLICY_BLOB])
        newest = next(reversed(self.policies.values())).network if self.policies else None
        network = network_of_version(decode_tensors(blobs[POLICY_BLOB]), newest, lambda: self.algorithm.network(
            setup.agent, setup.observation_space, setup.action_space).to(setup.device))
        return self.algorithm.policy(network, setup.agent, 0.0, 0)


class _Serving:
    """The server's loop: admit workers, answer what is waiting in one forward per version. A request
    it cannot answer gets `NOT_SERVED`; after `FAILURES_IN_A_ROW` forwards that raised, or an error
    of the loop itself, it stops serving: its socket and connections close, so every worker computes
    its own outputs from then on."""

    def __init__(self, setup: InferenceSetup, listener: Listener):
        from gymflow.envs.vector import observation_dtype

        self.versions, self.listener, self.authkey = _Versions(setup), listener, setup.address.authkey
        self.path = setup.address.path
        self.obs_dtype = np.dtype(observation_dtype(setup.observation_space))
        self.obs_shape = tuple(setup.observation_space.shape)
        self.obs_bytes = self.obs_dtype.itemsize * int(np.prod(self.obs_shape, dtype=np.int64))
        self.connections: list[Connection] = []
        self.joined: list[Connection] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.counts = {"requests": 0, "rows": 0, "forwards": 0, "failed": 0, "refused": 0}
        self.failures_in_a_row = 0
        self.busy = 0.0
        self.problem = ""

    def accept(self) -> None:
        """Take each client's connection; its handshake runs on a thread of its own, so a client with
        a wrong key, or one that never finishes the handshake, holds up no other."""
        while not self.stopped.is_set():
            try:
                connection = self.listener.accept()
            except OSError:  # the listener closed
                return
            threading.Thread(target=self._admit, args=(connection,), name="inference-admit", daemon=True).start()

    def _admit(self, connection: Connection) -> None:
        try:
            deliver_challenge(connection, self.authkey)
            answer_challenge(connection, self.authkey)
        except (OSError, EOFError, AuthenticationError):
            connection.close()
            with self.lock:
                self.counts["refused"] += 1
            return
        with self.lock:
            self.joined.append(connection)

    def serve(self) -> None:
        try:
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
        except Exception as error:  # noqa: BLE001 (a fault of the loop: the workers carry on without it)
            self._stop_serving(f"stopped serving: {type(error).__name__}: {error}")

    def _requests(self, ready: list[Any]) -> dict[int, list[tuple[Connection, np.ndarray]]]:
        by_version: dict[int, list[tuple[Connection, np.ndarray]]] = {}
        for connection in ready:
            try:
                message = connection.recv_bytes()
            except (OSError, EOFError):  # the worker closed or died
                self.connections.remove(connection)
                continue
            obs = self._observations(message)
            if obs is None:
                self._not_served(connection, f"a malformed request ({len(message)} bytes)")
                continue
            version, _ = REQUEST.unpack_from(message)
            by_version.setdefault(version, []).append((connection, obs))
        return by_version

    def _observations(self, message: bytes) -> np.ndarray | None:
        """A request's observations; None if its size does not match its row count."""
        if len(message) < REQUEST.size:
            return None
        _, rows = REQUEST.unpack_from(message)
        if rows < 1 or len(message) - REQUEST.size != rows * self.obs_bytes:
            return None
        return np.frombuffer(message, self.obs_dtype, offset=REQUEST.size).reshape(rows, *self.obs_shape)

    def _answer(self, by_version: dict[int, list[tuple[Connection, np.ndarray]]]) -> None:
        for version, asked in by_version.items():
            policy = self.versions.policy(version)
            if policy is None:  # retired: the worker computes that version's outputs itself
                replies = [NOT_SERVED] * len(asked)
            else:
                try:
                    outputs = policy.outputs(np.concatenate([obs for _, obs in asked]))
                except Exception as error:  # noqa: BLE001 (out of memory, a CUDA error: answered, not fatal)
                    self._forward_failed(asked, error)
                    continue
                self.failures_in_a_row = 0
                self.counts["forwards"] += 1
                bounds = np.cumsum([0] + [len(obs) for _, obs in asked])
                replies = [REPLY.pack(outputs.dtype.str.encode(), outputs.shape[1])
                           + np.ascontiguousarray(outputs[start:end]).tobytes()
                           for start, end in zip(bounds[:-1], bounds[1:])]
            for (connection, obs), reply in zip(asked, replies, strict=True):
                self.counts["requests"] += 1
                self.counts["rows"] += len(obs)
                self._send(connection, reply)

    def _forward_failed(self, asked: list[tuple[Connection, np.ndarray]], error: Exception) -> None:
        self.failures_in_a_row += 1
        for connection, _ in asked:
            self._not_served(connection, f"a forward raised {type(error).__name__}: {error}")
        if self.failures_in_a_row >= FAILURES_IN_A_ROW:
            self._stop_serving(f"stopped serving after {FAILURES_IN_A_ROW} failed forwards in a row")

    def _not_served(self, connection: Connection, why: str) -> None:
        self.counts["failed"] += 1
        self._note(why)
        self._send(connection, NOT_SERVED)

    def _send(self, connection: Connection, reply: bytes) -> None:
        try:
            connection.send_bytes(reply)
        except OSError:
            if connection in self.connections:
                self.connections.remove(connection)

    def _note(self, problem: str, stopping: bool = False) -> None:
        """Its first problem, and its stop, are each said once: on the run's terminal (this process's
        stderr is the flow's) and in what it served."""
        if stopping:
            self.problem = f"{self.problem}; {problem}" if self.problem else problem
            print(f"inference server: {problem}; the rollout workers act on their CPU from now on",
                  file=sys.stderr, flush=True)
        elif not self.problem:
            self.problem = problem
            print(f"inference server: {problem}; the workers compute the outputs it did not serve",
                  file=sys.stderr, flush=True)

    def _stop_serving(self, why: str) -> None:
        self._note(why, stopping=True)
        self.stopped.set()
        with suppress(OSError):
            self.listener.close()  # removes its socket: no worker connects again
        with self.lock:
            for connection in self.connections + self.joined:
                connection.close()  # a worker waiting on it reads its end at once
            self.connections.clear()
            self.joined.clear()

    def served(self) -> InferenceServed:
        return InferenceServed(**self.counts, busy_seconds=self.busy, problem=self.problem)


def serve() -> None:
    """The server process: read the setup, listen, say `ready`, serve until stdin closes, then
    answer with what was served."""
    replies = frames_out()
    setup: InferenceSetup = cloudpickle.loads(read_frame(sys.stdin.buffer))
    try:
        import torch

        torch.set_num_threads(1)  # the worker cores step envs; a GPU's forward needs one thread to launch
        # no authkey here: each client's handshake runs on its own thread (_Serving._admit)
        listener = Listener(setup.address.path, family="AF_UNIX")
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
    with suppress(OSError):
        listener.close()
    write_frame(replies, cloudpickle.dumps(serving.served()))


if __name__ == "__main__":  # its answers must pickle as this module's types, not __main__'s
    from gymflow.tasks.cluster import inference

    inference.serve()
