"""Overrides as a typed flow parameter: every preset field, optional, with the preset model's
descriptions and bounds, so Prefect shows a form. Dotted keys ({"agent.lr": 3e-4}) are accepted
too and expanded, so the CLI's `--set agent.lr=3e-4` and `-p overrides='{"agent.lr": 3e-4}'`
mean the same."""

from __future__ import annotations

from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from gymflow.presets.model import Preset, field_models


class _Overrides(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _optional(info: Any, annotation: Any) -> tuple[Any, Any]:
    constrained = Annotated[(annotation, *info.metadata)] if info.metadata else annotation
    return constrained | None, Field(default=None, description=info.description)


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
    fields = {
        field_name: _optional(infos[field_name], Union[tuple(types)] if len(types) > 1 else types[0])  # noqa: UP007
        for field_name, types in annotations.items()
    }
    return create_model(name, __base__=_Overrides, **fields)


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
        if not isinstance(data, dict) or not any("." in key for key in data):
            return data
        nested: dict[str, Any] = {}
        for key, value in data.items():
            *sections, last = key.split(".")
            if _into_a_mapping(sections):  # env.kwargs.task: one key of the mapping, kept dotted
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
    for name, value in overrides.model_dump(exclude_unset=True).items():
        section = getattr(overrides, name, None)
        if isinstance(section, BaseModel):
            flat.update(_dotted(section, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def as_dotted(overrides: PresetOverrides | dict[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, PresetOverrides):
        return overrides.dotted()
    return dict(overrides)


__all__ = ["PresetOverrides", "as_dotted"]
