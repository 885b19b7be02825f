"""Experiment definitions: the Preset model, built-in presets and overrides."""

from gymflow.errors import InvalidPreset
from gymflow.presets.load import builtin_presets, flatten, load_preset, parse_assignments
from gymflow.presets.model import Preset
from gymflow.presets.redaction import redacted

__all__ = ["InvalidPreset", "Preset", "builtin_presets", "flatten", "load_preset", "parse_assignments",
           "redacted"]
