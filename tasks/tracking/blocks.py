"""Storage credentials kept in a Prefect block (`storage.options_block`), read where a run starts:
the block's values are laid over the preset's `storage.options` in memory, so they reach the
storage and the rollout workers as options given in the preset do, and, as those, are redacted
wherever a preset is stored or logged. The preset, the flow's parameters and MLflow hold the
block's name alone."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gymflow.errors import InvalidPreset
from gymflow.presets.model import Preset
from gymflow.presets.validate import Experiment

_AWS_FIELDS = {"aws_access_key_id": "key", "aws_secret_access_key": "secret", "aws_session_token": "token"}


def with_block_options(experiment: Experiment) -> Experiment:
    """The experiment with its storage options block read into `storage.options` (unchanged
    without one); raises InvalidPreset naming the field when the block cannot be read."""
    if experiment.preset.storage.options_block is None:
        return experiment
    return replace(experiment, preset=preset_with_block_options(experiment.preset))


def preset_with_block_options(preset: Preset) -> Preset:
    storage = preset.storage
    if storage.options_block is None:
        return preset
    options = {**storage.options, **block_options(storage.options_block)}
    return preset.model_copy(update={"storage": storage.model_copy(update={"options": options})})


def block_options(name: str) -> dict[str, Any]:
    from prefect.blocks.core import Block

    try:
        block = Block.load(name)
    except Exception as error:  # noqa: BLE001 (Prefect's errors for an unknown type, a missing document, no API)
        raise InvalidPreset("storage.options_block", f"cannot read Prefect block {name!r}: "
                            f"{str(error).splitlines()[0] if str(error) else type(error).__name__}; allowed: "
                            "secret/NAME or aws-credentials/NAME of a block saved in this Prefect API") from None
    if hasattr(block, "aws_access_key_id"):  # prefect-aws's AwsCredentials
        options = {option: _plain(getattr(block, field)) for field, option in _AWS_FIELDS.items()
                   if getattr(block, field, None)}
        region = getattr(block, "region_name", None)
        return {**options, **({"client_kwargs": {"region_name": region}} if region else {})}
    value = block.get() if hasattr(block, "get") else None
    if not isinstance(value, dict):
        raise InvalidPreset("storage.options_block", f"block {name!r} holds no mapping of storage options; allowed: a "
                            "Secret whose value is {key: ..., secret: ..., endpoint_url: ...}, or AwsCredentials")
    return value


def _plain(value: Any) -> Any:
    return value.get_secret_value() if hasattr(value, "get_secret_value") else value
