"""Experiment definitions: the Preset model, built-in presets and overrides."""

from gymflow.errors import InvalidPreset
from gymflow.presets.load import builtin_presets, flatten, load_preset, parse_assignments, redacted
from gymflow.presets.model import Preset

__all__ = ["InvalidPreset", "Preset", "builtin_presets", "flatten", "load_preset", "parse_assignments",
           "redacted"]
