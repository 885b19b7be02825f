"""A file written whole, readable as `mode` says from its first byte: never half-written, never
world-readable for a moment, never through a link planted at its name."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_whole(path: Path, text: str, mode: int = 0o600) -> None:
    """`text` in `path`: a temporary file beside it made with `mode` (O_EXCL, O_NOFOLLOW), then moved in place."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)
    os.replace(temporary, path)
