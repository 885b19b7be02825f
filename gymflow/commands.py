"""How a person runs gymflow from where they are: the commands gymflow prints (resume, stack down,
`mlflow ui`) begin with this, so they run as printed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def gymflow_command() -> str:
    """`gymflow` where the shell finds this install's command; otherwise the command's path, relative to
    the working folder where it lies inside it (`.venv/bin/gymflow` after `make train`)."""
    return installed_command("gymflow")


def installed_command(name: str) -> str:
    """A command this install holds (`gymflow`, `mlflow`), as the user can type it from where they are."""
    script = Path(sys.executable).parent / name
    found = shutil.which(name)
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return name
    try:
        return os.path.relpath(script) if script.resolve().is_relative_to(Path.cwd().resolve()) else str(script)
    except ValueError:  # another drive
        return str(script)
