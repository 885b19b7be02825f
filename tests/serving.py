"""A logged policy served by `mlflow models serve`, as a user serves one: a real HTTP server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from tests.conftest import free_port


@contextmanager
def served(model_uri: str, tracking_uri: str, folder: Path, python: Path = Path(sys.executable),
           settings: dict[str, str] | None = None) -> Iterator[str]:
    """The model served on a free loopback port until the block ends, by the mlflow of `python`'s
    environment, with `settings` in its environment (GYMFLOW_DECISION_LOG, ...); yields its
    /invocations URL."""
    port = free_port()
    server = subprocess.Popen(
        [str(python), "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
         "-h", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **(settings or {}), "MLFLOW_TRACKING_URI": tracking_uri,  # it starts `uvicorn` from PATH
             "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}, cwd=folder,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,  # with its uvicorn: a group
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "mlflow models serve did not answer in 120 s"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/invocations"
    finally:
        _stop_group(server)


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to mlflow and the uvicorn it started, as a service manager stops them; waits until
    both have ended (uvicorn finishes its requests and its process's exit handlers first)."""
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(server.pid, signal.SIGKILL)
    raise AssertionError("mlflow models serve's uvicorn did not end in 30 s of SIGTERM")
