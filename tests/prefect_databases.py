"""An empty Prefect database at this Prefect's newest migration, made once per Prefect version on
this machine and copied wherever a test's Prefect server starts on a new SQLite database (the
tests' session API, each test process's PREFECT_HOME, the deployments' servers). A server on a new
file runs Prefect's migrations itself: ~5 s of CPU on the 2-core VM, each time."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gymflow-tests"


def migrated_template() -> Path:
    """The migrated empty database of this Prefect version, made by the first test process that
    asks (the others wait for it, then copy it)."""
    import prefect

    template = _cache() / f"prefect-{prefect.__version__}-empty.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with open(template.parent / ".prefect-template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            with tempfile.TemporaryDirectory(dir=template.parent) as home:
                environment = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
                upgraded = subprocess.run([str(Path(sys.executable).with_name("prefect")), "server", "database",
                                           "upgrade", "-y"], env={**environment, "PREFECT_HOME": home,
                                                                  "PREFECT_SERVER_ANALYTICS_ENABLED": "0"},
                                          capture_output=True, text=True, timeout=300)
                assert upgraded.returncode == 0, upgraded.stdout[-2000:] + upgraded.stderr[-2000:]
                made = Path(home, "template.db")
                # one file, its write-ahead log folded in
                with closing(sqlite3.connect(Path(home, "prefect.db"))) as database:
                    database.execute("VACUUM INTO ?", (str(made),))
                os.replace(made, template)
    return template


def seed_prefect_database(path: Path) -> None:
    """A copy of the migrated empty database at `path`, unless a database is there already."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.seeding-{os.getpid()}")
    partial.write_bytes(migrated_template().read_bytes())
    try:
        os.link(partial, path)  # never over a database a server made meanwhile
    except FileExistsError:
        pass
    finally:
        partial.unlink()


@contextmanager
def harness_databases_seeded() -> Iterator[None]:
    """Prefect's test harness starts its server on a new database in a folder of its own
    (`mkdtemp()`, then `prefect-test.db` in it): the folder comes with the migrated database in it.
    Where a later Prefect names its file otherwise, its server migrates a new one, as before."""
    from unittest import mock

    from prefect.testing import utilities

    def seeded_folder(*args, **kwargs) -> str:
        folder = tempfile.mkdtemp(*args, **kwargs)
        seed_prefect_database(Path(folder, "prefect-test.db"))
        return folder

    with mock.patch.object(utilities, "mkdtemp", seeded_folder):
        yield
