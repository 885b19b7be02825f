"""What a served policy model does beside answering: explore as its deployment says and log each
decision (tasks/lake/decision_log.py), so what it did can be learned from and evaluated off-policy.

Set where it serves, in its environment (`mlflow models serve` passes it on) or as the model's
`model_config` (`mlflow.pyfunc.load_model(uri, model_config={...})`):

    GYMFLOW_DECISION_LOG=s3://bucket/serving/cartpole   (decision_log: a folder or a bucket's URL; off: none)
    GYMFLOW_EXPLORATION=epsilon=0.1                     (exploration: greedy, epsilon=E, noise=S)
    GYMFLOW_DECISION_FLUSH_S=5                          (decision_flush_s: how often shards are written)
    GYMFLOW_DECISION_RETENTION_DAYS=90                  (decision_retention_days: older shards deleted hourly)

With a decision log the model answers `{"actions": [...], "request_ids": [...]}`: the ids the
caller reports outcomes under (`open_decision_log(url).observed(Outcome(...))`).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

import numpy as np
from gymnasium import spaces

from gymflow.agents.exploration import Exploration, explored
from gymflow.errors import GymflowError
from gymflow.tasks.lake.decision_log import DecisionLog, open_decision_log

SETTINGS = {"decision_log": "GYMFLOW_DECISION_LOG", "exploration": "GYMFLOW_EXPLORATION",
            "decision_flush_s": "GYMFLOW_DECISION_FLUSH_S",
            "decision_retention_days": "GYMFLOW_DECISION_RETENTION_DAYS"}
MODEL_CONFIG = dict.fromkeys(SETTINGS, "")  # logged with the model, so MLflow passes a load's model_config on
OWN_USE = {"decision_log": "off", "exploration": "greedy"}  # gymflow scoring a model: greedy, logging nothing,
# whatever the environment it runs in sets for serving


@dataclass(frozen=True)
class ServingSettings:
    decision_log: str | None = None
    exploration: Exploration = Exploration()
    flush_every_s: float = 5.0
    retention_s: float | None = None  # None: kept for ever
    exploration_field: str = SETTINGS["exploration"]  # where the exploration was set: what a refusal names


def serving_settings(model_config: Mapping[str, object] | None) -> ServingSettings:
    """The deployment's settings: the model's config first, then the environment; a bad value is
    refused in one line naming where it came from and what is allowed."""
    configured = {key: value for key, value in (model_config or {}).items() if value not in (None, "")}
    given = {key: configured.get(key, os.environ.get(variable)) for key, variable in SETTINGS.items()}
    where = {key: f"model_config[{key!r}]" if key in configured else variable for key, variable in SETTINGS.items()}
    try:
        exploration = Exploration.parse(str(given["exploration"] or "greedy"))
    except ValueError as refused:
        raise GymflowError(where["exploration"], str(refused)) from None
    flush, days = given["decision_flush_s"], given["decision_retention_days"]
    every_s = _positive(flush, where["decision_flush_s"]) if flush not in (None, "") else 5.0
    retention_s = _positive(days, where["decision_retention_days"]) * 86_400 if days not in (None, "") else None
    log = str(given["decision_log"]) if given["decision_log"] and given["decision_log"] != "off" else None
    return ServingSettings(log, exploration, every_s, retention_s, where["exploration"])


def _positive(value: object, field: str) -> float:
    try:
        seconds = float(str(value))
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise GymflowError(field, f"{value!r} is not a number above 0")
    return seconds


class DecisionRecorder:
    """Explores around a policy's greedy actions and logs each decision it serves."""

    def __init__(self, settings: ServingSettings, label: str, action_space: spaces.Space):
        discrete = isinstance(action_space, spaces.Discrete)
        _check_fits(settings, discrete)
        self.settings = settings
        self.actions_n = int(action_space.n) if discrete else None
        self.bounds = None if discrete else (action_space.low, action_space.high)
        self.policy, self.version = label, _version(label)
        self.rng = np.random.default_rng()
        self.log: DecisionLog | None = None
        if settings.decision_log:
            self.log = open_decision_log(settings.decision_log)
            self.log.start(settings.flush_every_s, settings.retention_s)
            atexit.register(self.log.close)
            _exit_handlers_after_sigterm()

    def act(self, observations: np.ndarray, greedy: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The actions to serve for these greedy ones, and the request ids they were logged under."""
        acted = explored(greedy, self.settings.exploration, self.rng, self.actions_n, self.bounds)
        if self.log is None:
            return acted.actions, None
        rows = len(greedy)
        ids = _request_ids(rows)
        self.log.decided_together({
            "request_id": ids, "observation": np.array(observations), "action": acted.logged,  # a copy: the caller
            # may reuse its array
            "log_probability": acted.log_probabilities.astype(np.float64), "policy": np.full(rows, self.policy),
            "version": np.full(rows, self.version, np.int64), "at": np.full(rows, time.time())})
        return acted.actions, ids


def _exit_handlers_after_sigterm() -> None:
    """Make a SIGTERM end the process through its exit handlers (the log's `close`), after the server's
    own graceful shutdown. uvicorn (`mlflow models serve`) answers SIGTERM by finishing its requests,
    then raises SIGTERM again under the handler it found, the default one, which kills the process
    where it stands and loses what the log still buffers. Here the server's handler runs as before,
    then SIGTERM is blocked in the main thread: the raise stays pending, the server returns, and the
    interpreter exits, running atexit. Where no server handles SIGTERM, it exits through them at once."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers are the main thread's to set
    theirs = signal.getsignal(signal.SIGTERM)

    def handled(number: int, frame: FrameType | None) -> None:
        if not callable(theirs):
            raise SystemExit(128 + number)
        theirs(number, frame)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    signal.signal(signal.SIGTERM, handled)


def _check_fits(settings: ServingSettings, discrete: bool) -> None:
    """The deployment's exploration fits the policy's actions, and gives logged decisions a probability."""
    kind, field = settings.exploration.kind, settings.exploration_field
    if discrete and kind == "noise":
        raise GymflowError(field, "noise=S is for continuous actions; this policy's are discrete: greedy or epsilon=E")
    if not discrete and kind == "epsilon":
        raise GymflowError(field, "epsilon=E is for discrete actions; this policy's are continuous: greedy or noise=S")
    if not discrete and kind == "greedy" and settings.decision_log:
        raise GymflowError(field, "a continuous policy's decisions are logged with noise=S exploration "
                                  "(a greedy action has no density)")


def _request_ids(rows: int) -> np.ndarray:
    """[rows] random 128-bit ids, 32 hex digits each (as uuid4's hex, without its version bits)."""
    digits = os.urandom(16 * rows).hex()
    return np.array([digits[start:start + 32] for start in range(0, 32 * rows, 32)], dtype="<U32")


def _version(label: str) -> int:
    """The run's policy version a model's label names last (cartpole-v1-dqn-v12: 12; cartpole-ppo-v3-adversary,
    one of a group's policies: 3); 0 where it names none."""
    found = re.findall(r"-v(\d+)(?=-|$)", label)
    return int(found[-1]) if found else 0
