"""The MLflow client of a tracking URI. A new local SQLite store starts as a copy of an empty one,
made once per MLflow version in the user's cache: MLflow builds a new file by running each of its
schema migrations (~3 s a store on a slow CPU, 40% of a small run), which every run in a new
folder, every sweep and every test would pay."""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
from contextlib import closing, suppress
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

_SQLITE = "sqlite:///"
_MAKING = threading.Lock()  # MLflow's migrations (alembic) are not safe in two threads of a process at once


def tracking_client(tracking_uri: str) -> MlflowClient:
    """MLflow's client of `tracking_uri`, whose SQLite file (when it is one) exists and is current."""
    from mlflow.tracking import MlflowClient

    if (path := new_sqlite_file(tracking_uri)) is not None:
        start_from_empty_store(path)
    return MlflowClient(tracking_uri)


def new_sqlite_file(tracking_uri: str) -> Path | None:
    """The file a `sqlite:///` URI names when it does not exist yet; None for any other URI (a
    server, a folder, an existing file, an in-memory database or one with options)."""
    if not tracking_uri.startswith(_SQLITE) or "?" in tracking_uri:
        return None
    name = tracking_uri.removeprefix(_SQLITE)
    if name in ("", ":memory:") or Path(name).exists():
        return None
    return Path(name)


def start_from_empty_store(path: Path) -> None:
    """A copy of the empty store at `path`, unless a file is there by then (another run made it).
    Best effort: where no copy can be made (no cache folder, no hard links), MLflow makes the store."""
    with suppress(OSError, sqlite3.Error):
        _placed_whole(empty_store(), path)


def empty_store() -> Path:
    """MLflow's tables at its newest schema, without the Default experiment (each store makes its
    own: its row names the store's artifact folder), made on first use and kept in the cache."""
    import mlflow

    template = _cache_folder() / f"mlflow-{mlflow.__version__}-empty.db"
    with _MAKING:
        if not template.exists():
            made = _sibling(template)
            try:
                _migrate(made)
                _link_unless_there(made, template)
            finally:
                made.unlink(missing_ok=True)
    return template


def _migrate(path: Path) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"{_SQLITE}{path}", str(path.parent / "artifacts-never-written"))
    store.engine.dispose()
    with closing(sqlite3.connect(path)) as database, database:
        database.execute("DELETE FROM experiments WHERE experiment_id = 0")


def _placed_whole(template: Path, path: Path) -> None:
    """`template` copied to `path` in one step: a run opening `path` meanwhile sees no file or all of it."""
    copy = _sibling(path)
    try:
        shutil.copyfile(template, copy)
        _link_unless_there(copy, path)
    finally:
        copy.unlink(missing_ok=True)


def _link_unless_there(source: Path, target: Path) -> None:
    with suppress(FileExistsError):  # made meanwhile by another process or thread: theirs is as good
        os.link(source, target)


def _sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")


def _cache_folder() -> Path:
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gymflow"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
