"""docs/reference.md, generated from the preset model: the built-in presets, and every field a
preset takes with its default, bounds and description (pydantic's, as the Prefect form shows
them). The page is never written by hand:

    .venv/bin/python -m gymflow.presets.reference > docs/reference.md

tests/test_docs.py fails where the committed page differs from this one."""

from __future__ import annotations

from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gymflow.agents.algorithms import ALGORITHMS
from gymflow.presets.load import builtin_presets, load_preset
from gymflow.presets.model import Preset, field_models

HEADER = """# Reference: presets and their fields

Generated from the preset model (`.venv/bin/python -m gymflow.presets.reference > docs/reference.md`);
[usage.md](usage.md) is the guide. A field is set in a preset file (`agent: {lr: 0.0002}`), with
`--set agent.lr=0.0002`, or in a deployment run's `overrides`; a value outside its bounds is refused
in one line naming the field before any work starts.
"""
BOUNDS = ((Ge, "≥", "ge"), (Gt, ">", "gt"), (Le, "≤", "le"), (Lt, "<", "lt"))


def reference_page() -> str:
    """The whole page."""
    lines = [HEADER, "## Built-in presets", "", "| preset | algorithm | env | mode | what it is |",
             "|---|---|---|---|---|"]
    for name, description in builtin_presets().items():
        preset = load_preset(name)
        lines.append(f"| `{name}` | {preset.agent.algo} | `{preset.env.id}` | {preset.distribution.mode} | "
                     f"{_cell(description)} |")
    lines += ["", "## Run fields", "", *_table(_rows(Preset, "", skip={"agent"}))]
    for algo, algorithm in ALGORITHMS.items():
        config = algorithm.config
        lines += ["", f"## `agent.algo: {algo}`", "", *([_cell(_doc(config)), ""] if _doc(config) else []),
                  *_table(_rows(config, "agent.", skip={"algo"}))]
    return "\n".join(lines) + "\n"


def _table(rows: list[str]) -> list[str]:
    return ["| field | default | meaning |", "|---|---|---|", *rows]


def _rows(model: type[BaseModel], prefix: str, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """A row for each field of `model` under `prefix`; a section's fields after it (an optional
    section has a row of its own too: its default is none)."""
    rows = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        sections = field_models(info.annotation)
        required_section = sections and info.is_required()
        if sections and (info.default_factory is not None or required_section):
            for section in sections:  # a section always there: its fields alone
                rows += _rows(section, f"{prefix}{name}.")
            continue
        rows.append(f"| `{prefix}{name}` | `{_default(info)}` | {_cell(_meaning(info))} |")
        for section in sections:
            rows += _rows(section, f"{prefix}{name}.")
    return rows


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return repr(info.default_factory())
    return "required" if info.default is PydanticUndefined else str(info.default)


def _meaning(info: FieldInfo) -> str:
    said = " ".join((info.description or "").split())
    bounds = _bounds(info)
    return f"{said} ({bounds})" if bounds else said


def _bounds(info: FieldInfo) -> str:
    words = []
    for constraint in info.metadata:
        for kind, sign, attribute in BOUNDS:
            if isinstance(constraint, kind):
                words.append(f"{sign} {getattr(constraint, attribute)}")
        if isinstance(constraint, MinLen):
            words.append(f"at least {constraint.min_length} long")
        if isinstance(constraint, MaxLen):
            words.append(f"at most {constraint.max_length} long")
    return ", ".join(words)


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


if __name__ == "__main__":
    print(reference_page(), end="")
