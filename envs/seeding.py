"""Every seed in a run derives from the run seed and a few names and numbers."""

from __future__ import annotations

import zlib

import numpy as np


def derive_seed(*parts: int | str) -> int:
    """A 32-bit seed that depends only on `parts`, e.g. derive_seed(run_seed, "rollout", v, w)."""
    words = [zlib.crc32(part.encode()) if isinstance(part, str) else int(part) for part in parts]
    return int(np.random.SeedSequence(words).generate_state(1)[0])
