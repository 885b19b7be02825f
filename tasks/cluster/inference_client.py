"""The rollout worker's side of inference beside the learner (tasks/cluster/inference.py is the
server's): a rollout's requests to its machine's server, answered in order, and what it computes
itself once the server cannot answer; the wire format both sides speak.

A request is one half of a worker's envs: a version and a batch of observations. A reply is the
outputs' dtype and columns, then their bytes; columns -1 (`NOT_SERVED`) says the server did not
serve it (a version retired there, a malformed request, a forward that raised), and the worker
computes those outputs itself. A worker waits at most `REPLY_TIMEOUT_S` for a reply, and at most
`CONNECT_TIMEOUT_S` to connect (a server that never accepts, or never finishes the handshake). A
rollout that ends with replies still owed to it (it raised between a request and its reply) drops
its connection, so the next rollout on that thread never reads them as its own.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import threading
from collections import deque
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import numpy as np

from gymflow.tasks.cluster.messages import InferenceAddress

REQUEST = struct.Struct("!qq")  # policy version, rows; the observations' bytes follow
REPLY = struct.Struct("!8sq")  # the outputs' numpy dtype, columns (-1: not served, the worker computes them)
NOT_SERVED = REPLY.pack(b"", -1)
# the longest a worker waits for one reply: a forward takes milliseconds, a version's first load from
# storage a second or two; past it the server counts as gone for this worker process
REPLY_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # a server on this machine accepts and shakes hands in milliseconds


@functools.cache  # a process never changes machine: read once
def this_machine() -> str:
    """The host name and this boot's id: a Unix socket's path means the same socket only there."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class RemoteOutputs:
    """A worker's side (an `OutputsSource`): requests to its machine's server, answered in order;
    once the server cannot answer (gone, silent for `REPLY_TIMEOUT_S`, or it did not serve a
    request), the outputs of everything still asked for and everything after come from
    `policy.outputs`, on the worker's CPU."""

    def __init__(self, connection: Connection | None, version: int, policy: Any):
        self.connection, self.version, self.policy = connection, version, policy
        self.asked: deque[np.ndarray] = deque()
        self.remote_rows = 0

    def __enter__(self) -> RemoteOutputs:
        return self

    def __exit__(self, *_: object) -> None:
        """The rollout is over: replies still owed on the connection would reach the next rollout
        of this thread as its own, so a connection that owes any is dropped (and made anew)."""
        if self.asked and self.connection is not None:
            self._give_up(server_gone=False)

    def request(self, obs: np.ndarray) -> None:
        self.asked.append(obs)
        if self.connection is not None:
            try:
                self.connection.send_bytes(REQUEST.pack(self.version, len(obs)) + np.ascontiguousarray(obs).tobytes())
            except OSError:
                self._give_up(server_gone=True)

    def receive(self) -> np.ndarray:
        obs = self.asked.popleft()
        if self.connection is not None:
            try:
                if not self.connection.poll(REPLY_TIMEOUT_S):
                    self._give_up(server_gone=True)  # silent: hung, or stopped by a signal
                    return self.policy.outputs(obs)
                reply = self.connection.recv_bytes()
                dtype, columns = REPLY.unpack_from(reply)
                if columns >= 0:
                    self.remote_rows += len(obs)
                    body = np.frombuffer(reply, dtype=np.dtype(dtype.rstrip(b"\0").decode()), offset=REPLY.size)
                    return body.reshape(len(obs), columns)
            except (OSError, EOFError):
                self._give_up(server_gone=True)
                return self.policy.outputs(obs)
            self._give_up(server_gone=False)  # not served (a retired version, a failed forward)
        return self.policy.outputs(obs)

    def _give_up(self, server_gone: bool) -> None:
        """The server answers no more of this rollout: every later output is its own. Where the
        server is gone or silent, no later rollout of this process asks it again."""
        _forget(self.connection, unreachable=server_gone)
        self.connection = None


# a worker process's open connections: one per server and thread, as a job host runs rollouts on a
# pool of threads and a connection's replies come back in its requests' order
_CONNECTIONS: dict[tuple[InferenceAddress, int], Connection] = {}
_UNREACHABLE: set[InferenceAddress] = set()  # servers gone or silent for this process
_CONNECTIONS_LOCK = threading.Lock()


def connect(address: InferenceAddress) -> Connection | None:
    """This thread's connection to the server at `address`; None where it cannot be reached (another
    machine, a server that has gone or stopped answering). Connections to servers that have gone
    (a finished run's) are closed on the way."""
    key = (address, threading.get_ident())
    with _CONNECTIONS_LOCK:
        if key in _CONNECTIONS:  # every rollout of a run asks: no file system look then
            return _CONNECTIONS[key]
        _close_finished_runs_connections()  # a new connection: those to gone servers go first
        if address in _UNREACHABLE or address.machine != this_machine() or not os.path.exists(address.path):
            return None
    connection = _connected(address)
    if connection is None:
        return None
    with _CONNECTIONS_LOCK:
        _CONNECTIONS[key] = connection
    return connection


def _connected(address: InferenceAddress) -> Connection | None:
    """A connection to the server, its handshake done, within CONNECT_TIMEOUT_S; None where it
    does not answer in time or refuses the key. Multiprocessing's own `Client` waits for good on a
    listener that never accepts."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(address.path)
            sock.settimeout(None)  # blocking again: the handshake's reads are bounded by the socket's own timeout
            bounded = struct.pack("ll", int(CONNECT_TIMEOUT_S), 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bounded)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bounded)
            connection = Connection(sock.detach())
        except OSError:
            return None
    try:
        answer_challenge(connection, address.authkey)
        deliver_challenge(connection, address.authkey)
        unbounded = socket.socket(fileno=os.dup(connection.fileno()))
        with unbounded:  # later waits are the rollout's own (`poll`), not the socket's
            unbounded.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
            unbounded.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
        return connection
    except (OSError, EOFError, AuthenticationError):
        connection.close()
        return None


def _close_finished_runs_connections() -> None:
    """A finished run's server removed its socket: its connections here are closed."""
    for key in [key for key in _CONNECTIONS if not os.path.exists(key[0].path)]:
        _CONNECTIONS.pop(key).close()
    _UNREACHABLE.intersection_update({address for address in _UNREACHABLE if os.path.exists(address.path)})


def _forget(connection: Connection, unreachable: bool) -> None:
    with _CONNECTIONS_LOCK:
        for key, open_connection in list(_CONNECTIONS.items()):
            if open_connection is connection:
                del _CONNECTIONS[key]
                if unreachable:
                    _UNREACHABLE.add(key[0])
    connection.close()  # replies still owed on it are not read: a later rollout connects anew
