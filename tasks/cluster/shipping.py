"""The user's code on a remote cluster's workers: the working-folder module an `env.id` of the
form `module:Class` names, and the files and folders `distribution.ship_paths` lists, sent to
every worker as a Dask worker plugin before the first job. The scheduler keeps the plugin, so a
worker that joins later (a replacement, a scale-up) gets the code before its first job too.

What is shipped is code only; what workers need installed (gymflow, its extras, the user's pip
packages) is not, and the run's pre-flight (tasks/cluster/rounds.py `check_workers`) names what a
worker lacks.
"""

from __future__ import annotations

import importlib
import io
import shutil
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from gymflow.errors import ClusterUnavailable
from gymflow.presets.model import Preset

SKIPPED = {"__pycache__", ".git", ".pytest_cache", ".mypy_cache", ".ipynb_checkpoints"}


class ShippedCode(WorkerPlugin):
    """Unpacks an archive of modules and packages into the worker's own folder and puts that
    folder first on its import path; modules of the same names imported before (an earlier
    run's) are forgotten, so the next import reads the new code."""

    name = "gymflow-shipped-code"  # one per cluster: a run's code replaces that of a run still going
    idempotent = False

    def __init__(self, archive: bytes, modules: Sequence[str]):
        self.archive, self.modules = archive, tuple(modules)

    def setup(self, worker) -> None:
        folder = self._folder(worker)
        remove_shipped(folder)
        folder.mkdir(parents=True)
        (folder / SHIPPED_MARKER).write_text("unpacked by gymflow's ShippedCode; removed with the run\n")
        with zipfile.ZipFile(io.BytesIO(self.archive)) as archive:
            archive.extractall(folder)
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        self._forget_modules()

    def teardown(self, worker) -> None:
        folder = self._folder(worker)
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
        self._forget_modules()
        with suppress(ClusterUnavailable):  # one not ours stays, as it was
            remove_shipped(folder)

    @staticmethod
    def _folder(worker) -> Path:
        return Path(worker.local_directory) / "gymflow-shipped-code"

    def _forget_modules(self) -> None:
        # sys.modules copied at once (list() holds the GIL throughout): the worker's other threads import meanwhile
        for name in [name for name in list(sys.modules) if name.partition(".")[0] in self.modules]:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()


SHIPPED_MARKER = ".gymflow-shipped"  # written first into the folder the code is unpacked in


def remove_shipped(folder: Path) -> None:
    """The folder of an earlier run's shipped code removed, where it is one (its marker is there);
    a folder of that name gymflow did not make is refused, untouched."""
    if not folder.exists():
        return
    if not (folder / SHIPPED_MARKER).is_file():
        raise ClusterUnavailable("distribution.ship_paths", f"{folder} on the worker was not made by gymflow (no "
                                 f"{SHIPPED_MARKER}); nothing removed; allowed: move it, or another worker folder")
    shutil.rmtree(folder, ignore_errors=True)


def code_to_ship(preset: Preset, working_folder: Path | None = None) -> list[Path]:
    """The paths a run on a remote cluster sends to its workers: `distribution.ship_paths`, and
    the module of a `module:Class` env id where it is a file or package of the working folder
    (an installed module must be installed on the workers too)."""
    if not preset.remote_cluster:
        return []  # a LocalCluster's workers import from the working folder themselves
    paths = [Path(path) for path in preset.distribution.ship_paths]
    if preset.distribution.ship_env_module and ":" in preset.env.id:
        module = working_folder_module(preset.env.id.partition(":")[0], working_folder or Path.cwd())
        if module is not None and module.resolve() not in {path.resolve() for path in paths}:
            paths.append(module)
    return paths


def working_folder_module(module: str, folder: Path) -> Path | None:
    """The file (`my_env.py`) or package folder (`my_pkg/`) of `module`'s top level in `folder`."""
    top = module.partition(".")[0]
    if (folder / f"{top}.py").is_file():
        return folder / f"{top}.py"
    if (folder / top).is_dir():
        return folder / top
    return None


def archive_of(paths: Sequence[Path]) -> bytes:
    """A zip of `paths`: a file under its own name, a folder under its name with what it holds
    (caches and version-control folders left out)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in paths:
            if path.is_file():
                archive.write(path, path.name)
                continue
            for file in sorted(path.rglob("*")):
                relative = file.relative_to(path.parent)
                if file.is_file() and not SKIPPED & set(relative.parts) and file.suffix != ".pyc":
                    archive.write(file, str(relative))
    return buffer.getvalue()


@contextmanager
def code_shipped(current_client: Callable[[], Client], paths: Sequence[Path]) -> Iterator[None]:
    """`paths` on every worker of the cluster, and on every worker that joins, while inside;
    taken off the workers (import path, modules, files) on the way out, through the client of the
    moment (`current_client()`: a run's scheduler link makes a new one when its scheduler was
    lost and another answers, and the old one is closed)."""
    if not paths:
        yield
        return
    ship_code(current_client(), paths)
    try:
        yield
    finally:
        with suppress(Exception):  # a cluster already gone keeps nothing
            current_client().unregister_worker_plugin(ShippedCode.name)


def ship_code(client: Client, paths: Sequence[Path]) -> None:
    """`paths` on every worker of `client`'s cluster and on every worker that joins it (a
    scheduler's plugin: a new scheduler needs it again)."""
    if paths:
        modules = [path.stem if path.is_file() else path.name for path in paths]
        client.register_plugin(ShippedCode(archive_of(paths), modules))
