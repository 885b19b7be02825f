"""The errors a user sees, one line each: the field or resource, and what is wrong with it.

Each kind of failure has its own type, so a caller can tell a bad preset value from a cluster
that is not there, a bucket that refuses, or a warm-start model that does not fit. Every type
survives pickling (Dask and Prefect carry exceptions between processes as pickles).
"""

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' did you mean 'X'?' where one of `choices` is near `word` (a typo), else ''; to end a refusal's
    first clause."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f"; did you mean {near[0]!r}?" if near else ""


class GymflowError(Exception):
    """A run that cannot start, found before any work is done; `field` names the preset field
    or parameter that leads to the problem."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")

    def __reduce__(self):  # pickle's default would call the class with the one-line message alone
        return type(self), (self.field, self.problem), self.__dict__


class InvalidPreset(GymflowError, ValueError):
    """A preset, override or flow parameter with a value that is not allowed."""


class ClusterUnavailable(GymflowError):
    """No Dask scheduler answered, or no worker offers what rollouts ask for."""


class PrefectUnavailable(GymflowError):
    """No Prefect API to run under: the temporary one this process starts would not start."""


class ServerRefused(GymflowError):
    """A tracking or orchestration server that does not answer, or refuses this user's login or
    what the run needs of it (a permission on its experiment)."""


class ServerLost(ServerRefused):
    """A server the run used that stopped answering for longer than its outage budget, or that
    answered that what it held is gone: the run stops at its next commit."""


class StorageRefused(GymflowError):
    """The storage root cannot be used: a missing bucket, refused credentials, an unreachable
    endpoint, a local path that is a file or not writable."""


class StorageFull(StorageRefused):
    """A write the storage root refused mid-run (no space left, over quota, read-only): the run
    stops; what it committed stays, and the line says how to continue it."""


class UnusableWarmStart(GymflowError):
    """The warm-start policy cannot be read, or does not fit the preset's network."""


class JobFailed(GymflowError):
    """A rollout, evaluation or check job raised on a Dask worker: `field` names the job and the
    worker, `problem` the cause; `trace` is the worker's traceback, for the run's log."""

    def __init__(self, field: str, problem: str, trace: str = ""):
        super().__init__(field, problem)
        self.trace = trace
        if trace:  # shown with the flow's traceback in the run's log (the Prefect UI), not in a terminal
            self.add_note(f"the worker's traceback:\n{trace}")

    def __reduce__(self):
        return type(self), (self.field, self.problem, self.trace), self.__dict__
