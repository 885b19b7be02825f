"""gymflow's flows as Prefect flows whose parameters a person got wrong are refused in gymflow's
one line, naming the field and what is allowed: in the run's state message and in its log, the
lines `prefect deployment run --watch` and the UI show. Prefect checks a run's parameters before
its body runs, says what failed only in a multi-line message, and logs it where no flow run's
log reaches (its engine's logger, before the run's logger exists)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_type_hints

from prefect import Flow
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ParameterTypeError
from prefect.logging.loggers import flow_run_logger
from prefect.states import State
from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticUserError

from gymflow.errors import InvalidPreset
from gymflow.presets.load import one_line

# Prefect's words at the start of the state message of a run whose parameters it refused
PARAMETERS_REFUSED = "Validation of flow parameters failed with error:"
OVERRIDES = "overrides"  # the parameter whose fields are named as the preset's (agent.lr), as the CLI's --set does


class CheckedFlow(Flow):
    """A flow whose parameter refusal is gymflow's one line (InvalidPreset) instead of Prefect's list."""

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate_parameters(parameters)
        except ParameterTypeError:
            refusal = parameter_refusal(self.fn, parameters)
            if refusal is None:  # not a value of a parameter's type (a block reference that does not resolve)
                raise
            raise refusal from None


def parameter_refusal(fn: Callable[..., Any], parameters: Mapping[str, Any]) -> InvalidPreset | None:
    """The first parameter of `fn` whose value its type refuses, in one line; None if none does."""
    try:
        hints = get_type_hints(fn, include_extras=True)
    except (NameError, TypeError):
        return None
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
