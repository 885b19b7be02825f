"""How a job and its outcome cross a process boundary: as bytes both ways (cloudpickle's
`(function, spec)` in; the result, or the job's error as a plain-text `JobFailure`, out), so an
error of any type, or a result the other side cannot read, ends its call in one line instead of
leaving it unanswered. Dask workers' job hosts (hosts.py) and single mode's helper process
(helper.py) run jobs through `run_job`.

And a child process that talks in length-prefixed frames on its stdin and stdout (`start_child`
on the flow's side, `frames_out` on the child's): single mode's helper and the inference server.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

import cloudpickle

from gymflow.errors import JobFailed
from gymflow.presets.redaction import is_secret

_LENGTH = struct.Struct("!Q")  # a frame's length, before its bytes
CHILD_START_TIMEOUT_S = 60.0  # a child not ready by then is ended: the flow goes on without it


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


def start_child(module: str, credentials: bool = True) -> subprocess.Popen:
    """`python -m module`, talking in frames on its stdin and stdout, with the flow's import path
    (the user's env modules import there too), in a session of its own (a Ctrl-C in the terminal
    stops the flow, and the flow ends it). It exits when its stdin closes. `credentials` False: a
    child that reads no storage and records nothing gets none of the environment's credentials."""
    path = os.pathsep.join(entry for entry in sys.path if entry)
    environment = dict(os.environ) if credentials else without_credentials(os.environ)
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**environment, "PYTHONPATH": path}, start_new_session=True)


# What a child that reads no storage and records nothing (a learner rank) is given of the flow's
# environment, by name: where things are (paths, home, temporary folder, locale, time zone, the
# virtual env), how many threads and which kernels (OpenMP, BLAS, oneDNN), torch's, CUDA's, NCCL's and
# gloo's settings, how an env renders (MuJoCo's GL, a display), and gymflow's own. Anything else (a
# login, a database URL, a connection string, whatever it is named) stays with the flow.
CHILD_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TEMP", "TMP", "LANG", "LANGUAGE", "TZ",
               "TERM", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "DISPLAY", "WAYLAND_DISPLAY", "XDG_CACHE_HOME",
               "XDG_RUNTIME_DIR", "MUJOCO_GL", "PYOPENGL_PLATFORM", "SDL_VIDEODRIVER", "CUBLAS_WORKSPACE_CONFIG",
               "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"}
CHILD_PREFIXES = ("LC_", "PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "ONEDNN_", "DNNL_", "TORCH_",
                  "PYTORCH_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TP_", "GYMFLOW_")


def without_credentials(environment: Mapping[str, str]) -> dict[str, str]:
    """What a child that reads no storage and records nothing is given of `environment`: the names it
    needs (CHILD_NAMES, CHILD_PREFIXES), an allow-list, never a secret-named one among them. A deny-list
    let PREFECT_API_AUTH_STRING, PREFECT_API_DATABASE_CONNECTION_URL, MLFLOW_BACKEND_STORE_URI and
    AZURE_STORAGE_CONNECTION_STRING through."""
    return {name: value for name, value in environment.items()
            if (name in CHILD_NAMES or name.startswith(CHILD_PREFIXES)) and not is_secret(name)}


def read_frame_within(process: subprocess.Popen, seconds: float) -> bytes | None:
    """A child's next frame, or None if it exits or says nothing for `seconds` (it is killed then)."""
    frame: list[bytes | None] = [None]
    reader = threading.Thread(target=lambda: frame.__setitem__(0, read_frame(process.stdout)), daemon=True)
    reader.start()
    reader.join(seconds)
    if reader.is_alive():
        process.kill()
        reader.join()
    return frame[0]


def frames_out() -> IO[bytes]:
    """The child's side: its original stdout, for frames alone; what it prints goes to stderr."""
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing printed may land among the frames
    return frames
