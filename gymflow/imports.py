"""Big imports without the garbage collector's scans."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def uncollected(freeze: bool = False) -> Iterator[None]:
    """No garbage collections inside. A process's big imports (Prefect, torch, MLflow, the
    algorithms: ~0.5-0.8 M new objects) made the collector scan the new objects over and over
    and free nothing: a fifth of the imports' time on the 2-core VM. On leaving, the collector is
    as it was; with `freeze`, what was made inside is frozen out of its later scans (for a
    process that keeps its imports for its life)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if collecting:
            gc.enable()
