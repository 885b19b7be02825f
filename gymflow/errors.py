"""The errors a user sees, one line each: the field or resource, and what is wrong with it.

Each kind of failure has its own type, so a caller can tell a bad preset value from a cluster
that is not there, a bucket that refuses, or a warm-start model that does not fit.
"""


class GymflowError(Exception):
    """A run that cannot start, found before any work is done; `field` names the preset field
    or parameter that leads to the problem."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class InvalidPreset(GymflowError, ValueError):
    """A preset, override or flow parameter with a value that is not allowed."""


class ClusterUnavailable(GymflowError):
    """No Dask scheduler answered, or no worker offers what rollouts ask for."""


class StorageRefused(GymflowError):
    """The storage root cannot be used: a missing bucket, refused credentials, an unreachable
    endpoint, a local path that is a file or not writable."""


class UnusableWarmStart(GymflowError):
    """The warm-start policy cannot be read, or does not fit the preset's network."""
