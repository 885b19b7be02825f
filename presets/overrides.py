"""Overrides as a typed flow parameter: every preset field, optional, with the preset model's
descriptions and bounds, so Prefect shows a form. Dotted keys ({"agent.lr": 3e-4}) are accepted
too and expanded, so the CLI's `--set agent.lr=3e-4` and `-p overrides='{"agent.lr": 3e-4}'`
mean the same."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from gymflow.presets.model import Preset, field_models


class _Overrides(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _optional(info: Any, annotation: Any) -> tuple[Any, Any]:
    if isinstance(annotation, type) and issubclass(annotation, _Overrides):  # a section: a form open at once
        optional = type(None) in get_args(info.annotation)  # dataset: None takes the preset's away
        return annotation | None if optional else annotation, Field(default_factory=annotation,
                                                                     description=info.description)
    constrained = Annotated[(annotation, *info.metadata)] if info.metadata else annotation
    return constrained | None, Field(default=None, description=info.description, json_schema_extra=_left_blank)


def _left_blank(schema: dict[str, Any]) -> None:
    """A field's schema as Prefect's form should show it: an empty input where the field may be
    left out (not a type to pick, with None picked), a choice with an empty entry. The form sends
    what was left empty as null, which the overrides read as unset (see `_dotted`)."""
    schema.pop("default", None)
    options = schema.get("anyOf", [])
    kept = [option for option in options if option != {"type": "null"}]
    if len(kept) != 1 or len(options) != 2 or "$ref" in kept[0] or kept[0].get("type") == "boolean":
        return  # a section to open, or a yes/no whose empty box would send false: None stays a choice
    del schema["anyOf"]
    schema.update(kept[0])
    if "enum" in schema:
        schema["enum"] = [*schema["enum"], None]
        schema.pop("type", None)


def _partial(name: str, *models: type[BaseModel]) -> type[BaseModel]:
    """A model with the fields of `models`, all optional. A name several models share keeps the
    first one's description and accepts any of their types (agent.algo: 'ppo', 'dqn', 'sac' or 'td3')."""
    infos: dict[str, Any] = {}
    annotations: dict[str, list[Any]] = {}
    for model in models:
        for field_name, info in model.model_fields.items():
            annotation = info.annotation
            if (section := _section(annotation)) is not None:  # a section, or an optional one (dataset)
                annotation = _partial(f"{section.__name__}Overrides", section)
            elif field_name == "agent":
                annotation = _partial("AgentOverrides", *get_args(annotation))
            infos.setdefault(field_name, info)
            if annotation not in annotations.setdefault(field_name, []):
                annotations[field_name].append(annotation)
    fields = {field_name: _optional(infos[field_name], _one_of(types)) for field_name, types in annotations.items()}
    return create_model(name, __base__=_Overrides, **fields)


def _one_of(types: list[Any]) -> Any:
    """The type that takes any of `types`; literals merged into one (agent.algo: one choice of eight names)."""
    if len(types) == 1:
        return types[0]
    if all(get_origin(kind) is Literal for kind in types):
        return Literal[tuple(value for kind in types for value in get_args(kind))]
    return Union[tuple(types)]  # noqa: UP007


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (`env: EnvConfig`, `dataset: DatasetConfig | None`), else None."""
    candidates = [annotation] if isinstance(annotation, type) else [arg for arg in get_args(annotation)
                                                                  if arg is not type(None)]
    if len(candidates) == 1 and isinstance(candidates[0], type) and issubclass(candidates[0], BaseModel):
        return candidates[0]
    return None


_PresetFields: type[BaseModel] = _partial("_PresetFields", Preset)


class PresetOverrides(_PresetFields):
    """Preset fields to override; unset fields keep the preset's values."""

    # Dotted keys ("agent.lr") must pass the Prefect server's schema check before they are
    # expanded here; an unknown key is then refused by the preset loader with the keys allowed.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _expand_dotted_keys(cls, data: Any) -> Any:
        if data is None:  # `improve(preset, None)`, `overrides: null`: no overrides, as before the form's default
            return {}
        if not isinstance(data, dict) or not any("." in key for key in data):
            return data
        nested: dict[str, Any] = {}
        for key, value in data.items():
            *sections, last = key.split(".")
            if value is None or _into_a_mapping(sections):  # kept dotted: a null set on purpose, or
                # env.kwargs.task, one key of a mapping
                nested[key] = value
                continue
            node = nested
            for section in sections:
                node = node.setdefault(section, {})
            node[last] = value
        return nested

    def dotted(self) -> dict[str, Any]:
        """{'agent.lr': 0.0003, ...} for the fields that were set; a mapping value stays one value
        ({'env.kwargs': {...}} replaces the preset's kwargs), a dotted key into one sets its one key
        ({'env.kwargs.task': 'walk'}, after any whole mapping)."""
        return _dotted(self)


def _into_a_mapping(sections: list[str]) -> bool:
    """Whether a dotted key's sections pass a preset field that is not a section (env.kwargs.task,
    agent.policies.adversary: a mapping setting), where the preset loader, not this model, reads the rest."""
    models: list[type[BaseModel]] = [Preset]
    for section in sections:
        if not models:
            return True
        infos = [model.model_fields[section] for model in models if section in model.model_fields]
        if not infos:
            return False  # an unknown key: the loader refuses it with the keys allowed
        models = [inner for info in infos for inner in field_models(info.annotation)]
    return not models



def _dotted(overrides: BaseModel, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    fields = type(overrides).model_fields
    for name, value in overrides.model_dump(exclude_unset=True).items():
        if value is None and name in fields and (prefix or not _takes_none(name)):
            continue  # a field Prefect's form sent empty; a null meant is a dotted key (or dataset: null)
        section = getattr(overrides, name, None)
        if isinstance(section, BaseModel):
            flat.update(_dotted(section, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _takes_none(field: str) -> bool:
    """Whether a preset's top-level field may be None (dataset: none to put in the replay memory)."""
    return type(None) in get_args(Preset.model_fields[field].annotation)


def as_dotted(overrides: PresetOverrides | dict[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, PresetOverrides):
        return overrides.dotted()
    return dict(overrides)


__all__ = ["PresetOverrides", "as_dotted"]
