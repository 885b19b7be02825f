"""Experiment definitions: the Preset model, built-in presets and overrides."""

from presets.errors import InvalidPreset
from presets.load import builtin_presets, flatten, load_preset, parse_assignments, redacted
from presets.model import Preset

__all__ = ["InvalidPreset", "Preset", "builtin_presets", "flatten", "load_preset", "parse_assignments",
           "redacted"]
