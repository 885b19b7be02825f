"""Making and checking Gymnasium environments, and reproducible vector envs (small test envs
are in gymflow.testing.envs)."""

from gymflow.envs.make import EnvSpecError, check_env, make_env
from gymflow.envs.vector import EnvCursor, SeededVectorEnv

__all__ = ["EnvCursor", "EnvSpecError", "SeededVectorEnv", "check_env", "make_env"]
