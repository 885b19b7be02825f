"""gymflow's flows as Prefect flows that say why they refused to run in gymflow's one line, naming
the field and what is allowed: as an event `prefect deployment run --watch` prints, in the run's
state message (the UI's) and in its log. Prefect checks a run's parameters before its body runs,
says what failed only in a multi-line message, and logs it where no flow run's log reaches (its
engine's logger, before the run's logger exists); and `--watch` shows no state message, and
logs only where the server streams them (Prefect's server does not by default).

What Prefect keeps of a run's parameters (its database, the UI, a retried run's input) has every
credential masked; a deployment run, whose parameters Prefect stored before the flow could see
them, is refused where they hold one, saying where a credential belongs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, get_type_hints

from prefect import Flow
from prefect.client.schemas.objects import FlowRun
from prefect.context import get_run_context
from prefect.exceptions import ParameterTypeError
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as this_flow_run
from prefect.states import State
from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticUserError

from gymflow.errors import GymflowError, InvalidPreset
from gymflow.presets.load import one_line
from gymflow.presets.overrides import as_dotted
from gymflow.presets.redaction import MASK, redacted
from gymflow.tasks.tracking.events import flow_run_refused

# Prefect's words at the start of the state message of a run whose parameters it refused
PARAMETERS_REFUSED = "Validation of flow parameters failed with error:"
OVERRIDES = "overrides"  # the parameter whose fields are named as the preset's (agent.lr), as the CLI's --set does


class CheckedFlow(Flow):
    """A flow whose parameter refusal is gymflow's one line (InvalidPreset) instead of Prefect's list."""

    def __init__(self, function: Callable[..., Any], **options: Any):
        super().__init__(function, **options)
        try:
            self.parameter_types = get_type_hints(function, include_extras=True)
        except (NameError, TypeError):  # a type only named for type checkers: Prefect's own message stands
            self.parameter_types = {}

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """The parameters as Prefect stores and shows them: credentials masked (the run itself
        is given them as they are)."""
        return redacted(super().serialize_parameters(parameters))

    def with_options(self, **options: Any) -> CheckedFlow:
        """The flow with other options (a run name: a sweep's trials), still masking and checking:
        Prefect makes a plain Flow of it, which stored a trial's credentials as they were."""
        changed = super().with_options(**options)
        changed.__class__ = type(self)
        changed.parameter_types = self.parameter_types
        return changed

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate_parameters(parameters)
        except ParameterTypeError:
            refusal = parameter_refusal(self.parameter_types, parameters)
            if refusal is None:  # not a value of a parameter's type (a block reference that does not resolve)
                raise
            _said(refusal)
            raise refusal from None


@contextmanager
def refusal_said() -> Iterator[None]:
    """Around a flow's checks of its input, before any work: a gymflow error raised there is sent
    as the run's `gymflow.flow-run.refused` event before the run fails."""
    try:
        yield
    except GymflowError as error:
        _said(error)
        raise


CREDENTIALS_BELONG = ("a deployment run's parameters are kept in Prefect's database and shown in its UI; "
                      "allowed: the credential in a Prefect Secret block (storage.options_block) or in the worker's "
                      "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_USERNAME/"
                      "MLFLOW_TRACKING_PASSWORD)")


def overrides_checked(overrides: Any) -> dict[str, Any]:
    """A flow's overrides as dotted keys; in a deployment run, refused (InvalidPreset naming the
    field) where one holds a credential: a value under a secret key, a URI's password, a secret
    assigned in free text, or `***` (a masked one, of no use either)."""
    changes = as_dotted(overrides)
    if get_run_context().flow_run.deployment_id:
        for field, value in changes.items():
            if redacted({field: value}) != {field: value} or MASK in repr(value):
                raise InvalidPreset(field, f"holds a credential: {CREDENTIALS_BELONG}")
    return changes


def _said(error: GymflowError) -> None:
    flow_run_id = this_flow_run.id  # in the run's context, or (while Prefect checks parameters) its worker's
    if flow_run_id:
        flow_run_refused(flow_run_id, error)


def parameter_refusal(hints: Mapping[str, Any], parameters: Mapping[str, Any]) -> InvalidPreset | None:
    """The first parameter whose value its type (in `hints`) refuses, in one line; None if none does."""
    for name, value in parameters.items():
        if name not in hints:
            continue
        try:
            TypeAdapter(hints[name]).validate_python(value)
        except ValidationError as error:
            return one_line(error, within=None if name == OVERRIDES else name)
        except PydanticUserError:  # a type pydantic cannot check alone: Prefect's own message stands
            continue
    return None


def say_a_refusal(flow: Flow, flow_run: FlowRun, state: State) -> None:
    """An on-failure hook: a run refused for its parameters says why in its own log, once."""
    if state.message and state.message.startswith(PARAMETERS_REFUSED):
        refusal = state.message.removeprefix(PARAMETERS_REFUSED).strip().removeprefix("InvalidPreset: ")
        flow_run_logger(flow_run, flow).error("gymflow: error: %s (the run did not start)", refusal)


def checked_flow(**options: Any) -> Callable[[Callable[..., Any]], CheckedFlow]:
    """`@flow(**options)`, as a CheckedFlow that says a refusal of its parameters in its log."""

    def decorate(fn: Callable[..., Any]) -> CheckedFlow:
        return CheckedFlow(fn, on_failure=[say_a_refusal], **options)

    return decorate
