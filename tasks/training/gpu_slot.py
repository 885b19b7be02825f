"""A learner on a GPU holds that GPU's Prefect global concurrency slot for as long as it trains,
so two runs (two deployments, a run and a sweep) never share one GPU unknowingly: the second
waits, saying so, until the first lets go. One limit per GPU of each host, `gpu-HOST-N`, made
with one slot the first time it is asked for (an administrator may give it more, e.g. for MIG
slices: `prefect gcl update gpu-HOST-0 --limit 2`). The slot is a lease that Prefect renews while
the run lives; a run killed outright frees it when the lease runs out (5 minutes)."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from gymflow.tasks.cluster.rounds import AnyLogger

FIRST_TRY_SECONDS = 2.0  # a free slot is taken within this; past it, the run says it waits


def slot_name(device: str, host: str | None = None) -> str | None:
    """`gpu-HOST-N` for a CUDA device (`cuda`, `cuda:N`); None for any other."""
    if not device.startswith("cuda"):
        return None
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    host = re.sub(r"[^A-Za-z0-9-]+", "-", host or socket.gethostname()).strip("-") or "host"
    return f"gpu-{host}-{index}"


@contextmanager
def gpu_slot(device: str, logger: AnyLogger, host: str | None = None) -> Iterator[str | None]:
    """Hold the slot of `device` (nothing for a CPU) while inside; yields its name."""
    name = slot_name(device, host)
    if name is None:
        yield None
        return
    _limit_exists(name)
    stack = ExitStack()
    try:
        stack.enter_context(concurrency(name, occupy=1, timeout_seconds=FIRST_TRY_SECONDS, strict=True))
    except TimeoutError:
        logger.warning("waiting for %s: another run trains on this GPU (Prefect UI: Concurrency)", name)
        stack.enter_context(concurrency(name, occupy=1, strict=True))
        logger.info("%s is this run's now", name)
    with stack:
        yield name


def _limit_exists(name: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # another run made it in the same instant
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
