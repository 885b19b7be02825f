"""Denormal floats computed as zero on the CPU, on every thread torch computes with.

A weight whose gradient stays zero (a dead ReLU unit's) has Adam moments that decay geometrically
through float32's denormal range (below 1.2e-38): ~150 steps for the first moment, ~16,000 for the
second. An x86 core computes on a denormal through microcode, tens of times slower than on a normal
float. In halfcheetah-sac's learner on random transitions ~1,000 of the moments were denormal after
1,000 updates and ~6,400 after 3,000, and its updates a second fell round by round where SBX's held;
flushed, they hold too (docs/benchmarks.md, "Off-policy learners against SBX and SB3"). XLA, which
SBX learns with, flushes them by default.

`torch.set_flush_denormal` sets the calling thread's control register only, and a thread inherits
the register when it is created: OpenMP's pool (torch's intra-op threads, made at the first parallel
operation) keeps what it had. `flush_denormals` sets it on the calling thread and, through libgomp's
`GOMP_parallel`, on each of the pool's threads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

_EACH_THREAD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def flush_denormals() -> bool:
    """Denormals flushed to zero on this thread and on torch's OpenMP threads (this process's
    libgomp, where torch uses one). False where the CPU cannot (neither x86 with SSE3 nor ARM)."""
    if not torch.set_flush_denormal(True):
        return False
    gomp = _loaded_libgomp()
    if gomp is not None:
        on_each = _EACH_THREAD(lambda _: torch.set_flush_denormal(True) and None)
        gomp.GOMP_parallel(on_each, None, ctypes.c_uint(torch.get_num_threads()), ctypes.c_uint(0))
    return True


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's; a wheel may rename it, libgomp-<hash>.so.1);
    None where there is none (another OpenMP, or not Linux): the calling thread's flag must do."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line})
    return next((ctypes.CDLL(path) for path in paths if Path(path).name.startswith("libgomp")), None)
