"""A new local SQLite tracking store starts as a copy of an empty one, made once per MLflow version
in the user's cache: the tables and schema MLflow would make itself, its own Default experiment,
and one whole file whoever makes it first."""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from mlflow.tracking import MlflowClient

from gymflow.tasks.tracking.store import new_sqlite_file, tracking_client


def _schema_and_rows(database: Path) -> tuple[list, dict[str, list]]:
    """Each table's and index's definition (its lines in any order: MLflow's migrations write a
    table's constraints in an order of their own each time) and every table's rows but the experiments'."""
    with closing(sqlite3.connect(database)) as db:
        schema = sorted((kind, name, sorted(line.strip(" ,") for line in (sql or "").splitlines()))
                        for kind, name, sql in db.execute("SELECT type, name, sql FROM sqlite_master"))
        tables = [name for kind, name, _ in schema if kind == "table"]
        rows = {table: db.execute(f"SELECT * FROM '{table}'").fetchall() for table in tables if table != "experiments"}
    return schema, rows


def test_a_new_sqlite_store_is_the_one_mlflow_makes_with_its_own_default_experiment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for folder in ("ours", "mlflows"):
        (tmp_path / folder).mkdir()
    ours = tracking_client("sqlite:///ours/mlflow.db")  # relative to the working folder, as the default is
    theirs = MlflowClient(f"sqlite:///{tmp_path / 'mlflows' / 'mlflow.db'}")

    (template,) = (tmp_path / "cache" / "gymflow").glob("mlflow-*-empty.db")
    assert _schema_and_rows(tmp_path / "ours" / "mlflow.db") == _schema_and_rows(tmp_path / "mlflows" / "mlflow.db")
    default, made_by_mlflow = ours.get_experiment("0"), theirs.get_experiment("0")
    assert (default.name, default.artifact_location) == (made_by_mlflow.name, made_by_mlflow.artifact_location)
    assert str(template.parent) not in default.artifact_location
    assert [experiment.name for experiment in ours.search_experiments()] == ["Default"]

    run = ours.create_run(ours.create_experiment("gymflow")).info.run_id
    ours.log_metric(run, "return", 1.0)
    assert ours.get_metric_history(run, "return")[0].value == 1.0
    assert sorted(path.name for path in (tmp_path / "ours").iterdir()) == ["mlflow.db"]  # no copy left half-way


def test_runs_making_one_new_store_at_once_share_one_whole_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with ThreadPoolExecutor(4) as threads:
        clients = list(threads.map(tracking_client, [uri] * 4))
    experiment = clients[0].create_experiment("shared")
    assert all(client.get_experiment(experiment).name == "shared" for client in clients)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache", "mlflow.db"]
    assert sorted(path.name.startswith(".") for path in (tmp_path / "cache" / "gymflow").iterdir()) == [False]


def test_only_a_sqlite_file_not_there_yet_is_made_from_the_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.db").write_bytes(b"")
    assert new_sqlite_file(f"sqlite:///{tmp_path / 'new.db'}") == tmp_path / "new.db"
    assert new_sqlite_file("sqlite:///mlflow.db") == Path("mlflow.db")
    for uri in (f"sqlite:///{tmp_path / 'old.db'}", "sqlite:///:memory:", f"sqlite:///{tmp_path / 'x.db'}?timeout=5",
                "http://localhost:5000", "databricks", str(tmp_path / "mlruns"), f"file://{tmp_path / 'mlruns'}"):
        assert new_sqlite_file(uri) is None, uri
