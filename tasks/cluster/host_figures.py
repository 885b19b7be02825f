"""What a process's machine is doing, sampled where the process runs: its host's CPU and memory,
the process's own CPU and resident memory, and each GPU torch has initialised there (utilisation
where NVIDIA's management library is installed, memory reserved by torch). Rollout workers send a
sample with every shard they land; the flow logs them, with its own, as MLflow system metrics, one
node id a process (tasks/tracking/system_metrics.py)."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

import psutil

_MB = 1024 * 1024


@dataclass(frozen=True)
class HostFigures:
    """One sample, named as MLflow's own system metrics are."""

    cpu_utilization_percentage: float  # the host's, since this process's last sample
    system_memory_usage_megabytes: float
    system_memory_usage_percentage: float
    process_cpu_percentage: float  # this process's (100 = one core), since its last sample
    process_memory_rss_megabytes: float
    gpus: tuple[tuple[float | None, float], ...] = ()  # per GPU: utilisation % (None: unknown), memory MB

    def metrics(self) -> dict[str, float]:
        figures = {name: float(value) for name, value in vars(self).items() if name != "gpus"}
        for index, (utilisation, memory) in enumerate(self.gpus):
            figures[f"gpu_{index}_memory_usage_megabytes"] = memory
            if utilisation is not None:
                figures[f"gpu_{index}_utilization_percentage"] = utilisation
        return figures


_process: psutil.Process | None = None


def sample_host() -> HostFigures:
    """This process's sample (about 50 us; CPU figures are averages since the previous call)."""
    global _process
    if _process is None or _process.pid != os.getpid():  # a forked child samples itself
        _process = psutil.Process()
        _process.cpu_percent(None)
    memory = psutil.virtual_memory()
    return HostFigures(psutil.cpu_percent(None), (memory.total - memory.available) / _MB, memory.percent,
                       _process.cpu_percent(None), _process.memory_info().rss / _MB, _gpus())


_last_sent = -1e9


def sample_to_send(every_seconds: float = 2.0) -> HostFigures | None:
    """A rollout worker's sample for the shard it lands, at most one every `every_seconds` (the
    flow logs a node's figures every 10 s: sampling each of many small rounds would be waste)."""
    global _last_sent
    now = time.monotonic()
    if now - _last_sent < every_seconds:
        return None
    _last_sent = now
    return sample_host()


def _gpus() -> tuple[tuple[float | None, float], ...]:
    """The GPUs torch uses in this process (torch not imported, or no CUDA: none)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ()
    found = []
    for index in range(torch.cuda.device_count()):
        try:
            utilisation: float | None = float(torch.cuda.utilization(index))
        except Exception:  # noqa: BLE001 (pynvml missing or refusing: memory alone)
            utilisation = None
        found.append((utilisation, torch.cuda.memory_reserved(index) / _MB))
    return tuple(found)


def node_id(role: str, collected_by: str | None = None) -> str:
    """The node id a process's figures go under: `flow-HOST`, or a worker's `worker-HOST-PID`
    (`collected_by`: its shards' host:pid)."""
    if collected_by is None:
        return f"{role}-{socket.gethostname()}"
    host, _, pid = collected_by.rpartition(":")
    return f"{role}-{host}-{pid}"
