"""A real S3 API server on loopback for tests and benchmarks: moto's server mode in a process of
its own, on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

# the team stack's (`gymflow stack`), where a user's S3 server is made the same way
from gymflow.flows.team_stack import SET_UP_REQUESTS, free_port, user_and_bucket

__all__ = ["SET_UP_REQUESTS", "free_port", "moto_on_loopback", "user_and_bucket"]


@contextmanager
def moto_on_loopback(env: dict[str, str] | None = None, start_timeout_s: float = 30) -> Iterator[str]:
    """A moto S3 server answering on 127.0.0.1 (`env` added to its environment); its endpoint URL.
    Ended on the way out."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)
