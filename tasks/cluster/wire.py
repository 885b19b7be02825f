"""How a job and its outcome cross a process boundary: as bytes both ways (cloudpickle's
`(function, spec)` in; the result, or the job's error as a plain-text `JobFailure`, out), so an
error of any type, or a result the other side cannot read, ends its call in one line instead of
leaving it unanswered. Dask workers' job hosts (hosts.py) and single mode's helper process
(helper.py) run jobs through `run_job`; the helper is this module's `serve`, its jobs and answers
length-prefixed frames on its stdin and stdout."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import struct
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import cloudpickle

from gymflow.errors import JobFailed
from gymflow.imports import uncollected

_LENGTH = struct.Struct("!Q")  # a frame's length, before its bytes
# single mode's helper: where it and the learner both want a core (the Prefect API wanting the
# other), the learner gets it. Alternating runs, the benchmark's ratio: DQN 1.07 against 1.09, PPO
# 1.03 against 1.04 (docs/benchmarks.md)
HELPER_NICENESS = 5


@dataclass(frozen=True)
class JobFailure:
    """A job's own exception as plain text, so it is not mistaken for a lost worker and always
    gets back: an exception that crossed as itself, of a type the flow's side could not unpickle
    (a constructor pickle cannot call, a module only the worker has), left its call waiting forever."""

    cause: str  # one line: "ModuleNotFoundError: No module named 'my_env'", or a gymflow error's own line
    trace: str  # the worker's traceback

    @classmethod
    def of(cls, error: BaseException) -> JobFailure:
        return cls(one_line_cause(error), "".join(traceback.format_exception(error)))

    def raised_by(self, where: str) -> JobFailed:
        """The one-line error the caller raises: `where` (the job and its host), then the cause."""
        return JobFailed(where, self.cause, self.trace)


def settle_reply(future: concurrent.futures.Future, where: str, reply: bytes) -> None:
    """Settle a job's call from its reply: the job's result, or a one-line `JobFailed` (the job's
    own error, or a result this process cannot read: of a type only the worker can import)."""
    try:
        outcome = cloudpickle.loads(reply)
    except Exception as error:  # noqa: BLE001 (whatever stops the reply being read ends the call)
        future.set_exception(JobFailed(where, f"its result cannot be read here: {one_line_cause(error)}"))
        return
    if isinstance(outcome, JobFailure):
        future.set_exception(outcome.raised_by(where))
    else:
        future.set_result(outcome)


def run_job(job: bytes) -> bytes:
    """Run one job sent as bytes; its result, or its error as a `JobFailure`, as bytes."""
    try:
        function, spec = cloudpickle.loads(job)
        outcome = function(spec)
    except Exception as error:  # noqa: BLE001 (any error of the job goes back to the caller, as text)
        outcome = JobFailure.of(error)
    try:
        return cloudpickle.dumps(outcome)
    except Exception as error:  # noqa: BLE001 (a result that cannot be pickled is the job's error)
        return cloudpickle.dumps(JobFailure.of(error))


def one_line_cause(error: BaseException) -> str:
    """gymflow's errors say `field: problem` themselves; any other is `Type: message`, on one line."""
    text = " ".join(str(error).split())
    return text if hasattr(error, "field") and hasattr(error, "problem") else f"{type(error).__name__}: {text}"


def describe_job(function: Callable[[Any], Any], spec: Any, slot: int) -> str:
    """`rollout job runs/x/shards/v3-w1`, `evaluation job of slot 0`: what a log line calls a job."""
    key = getattr(spec, "shard_key", None)  # a rollout names its shard
    return f"{function.__name__.removeprefix('run_')} job {key or f'of slot {slot}'}"


def write_frame(stream: IO[bytes], data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> bytes | None:
    """The next frame, or None at the end of the stream (or a frame cut short by an exit)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    data = stream.read(length)
    return data if len(data) == length else None


def serve() -> None:
    """The helper's side: say it is ready (an empty frame), then run each job read from stdin and
    answer each on the original stdout."""
    if hasattr(os, "nice"):  # not on Windows
        os.nice(HELPER_NICENESS)
    with uncollected(freeze=True):  # the helper keeps what it imports for its life
        from gymflow.tasks.cluster.jobs import import_job_machinery

        import_job_machinery()

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a job's prints must not land among the replies
    write_frame(replies, b"")  # ready
    jobs = sys.stdin.buffer
    while (job := read_frame(jobs)) is not None:
        write_frame(replies, run_job(job))
    # the helper ends next, and the flow waits for it: no collection of its whole heap (torch,
    # Gymnasium) on the way out (~0.5 s), as the command line's own exit
    gc.freeze()


if __name__ == "__main__":  # the helper: its jobs' failures must pickle as this module's types, not __main__'s
    from gymflow.tasks.cluster import wire

    wire.serve()
