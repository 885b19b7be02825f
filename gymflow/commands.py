"""How a person runs gymflow from where they are: the commands gymflow prints (resume, stack down)
begin with this, so they run as printed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def gymflow_command() -> str:
    """`gymflow` where the shell finds this install's command; otherwise the command's path, relative to
    the working folder where it lies inside it (`.venv/bin/gymflow` after `make train`)."""
    script = Path(sys.executable).parent / "gymflow"
    found = shutil.which("gymflow")
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return "gymflow"
    try:
        return os.path.relpath(script) if script.resolve().is_relative_to(Path.cwd().resolve()) else str(script)
    except ValueError:  # another drive
        return str(script)
