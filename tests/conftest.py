from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (a temporary server with its own SQLite database) for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch) -> Path:
    """An empty working folder; runs write their storage and MLflow store inside it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def local_overrides(workspace: Path) -> dict[str, str]:
    return {
        "storage.root": str(workspace / "data"),
        "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}",
    }


def written_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


os.environ.setdefault("MPLBACKEND", "Agg")
