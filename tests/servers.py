"""Servers of a test's own, on one port and one store each, killed and started again as an operator
(or a lost machine) would: a Prefect server (what it kept in memory, its leases, is gone when it
comes back), an MLflow tracking server, and an S3 API server (moto's: it keeps its objects in memory
alone, so one started again holds none, not even the bucket)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.prefect_databases import seed_prefect_database

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


class _Server:
    url = ""
    health = ""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def _started(self, command: list[str], environment: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(command, env={**os.environ, **(environment or {})}, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while not self._answers():
            assert self.process.poll() is None and time.monotonic() < deadline, f"{command[:3]} did not start"
            time.sleep(0.2)

    def kill(self) -> None:
        """Ended at once with every process of its session (its workers): lost with its machine."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _answers(self) -> bool:
        try:
            return httpx.get(self.health, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


class PrefectServer(_Server):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.database, self.port = folder / "prefect.db", free_port()
        seed_prefect_database(self.database)
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.health = f"{self.url}/health"

    def start(self) -> None:
        self._started([sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                       "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error"],
                      {"PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.database}",
                       "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"})


class MlflowServer(_Server):
    """`mlflow server` on a SQLite store of its own."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health = f"{self.url}/health"

    def start(self) -> None:
        self._started([MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                       "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
                       "--artifacts-destination", str(self.folder / "artifacts")])


class MotoServer(_Server):
    """moto's S3 server; `start` makes it answer with an empty store (no bucket)."""

    def __init__(self) -> None:
        super().__init__()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health = f"{self.url}/moto-api/"

    def start(self) -> None:
        self._started([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)])

    def options(self) -> dict[str, str]:
        """The storage options that reach it (moto takes any key)."""
        return {"endpoint_url": self.url, "key": "testing", "secret": "testing"}

    def with_bucket(self, bucket: str) -> MotoServer:
        import boto3

        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        return self
