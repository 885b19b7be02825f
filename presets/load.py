"""Built-in presets, preset files, and dotted-key overrides, all checked before any work starts."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gymflow.agents.algorithms import ALGORITHMS
from gymflow.agents.configs import ReplayOptions
from gymflow.errors import InvalidPreset, did_you_mean
from gymflow.presets.model import Preset, field_models

_BUILTIN = resources.files("gymflow.presets") / "builtin"


def builtin_presets() -> dict[str, str]:
    """Built-in preset names, each with the first sentence of its description (its leading comment)."""
    names = {}
    for item in sorted(_BUILTIN.iterdir(), key=lambda p: p.name.removesuffix(".yaml")):
        if item.name.endswith(".yaml"):
            names[item.name.removesuffix(".yaml")] = _first_sentence(item.read_text())
    return names


def _first_sentence(text: str) -> str:
    """The first sentence of a YAML file's leading comment lines: up to the first period that ends
    a line or meets a space (not "e.g.", "i.e." or "et al.")."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("# ").strip())
    joined = "\n".join(comment)
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<! al)\.(?=\s|$)", joined)
    return " ".join((joined[: end.end()] if end else joined).split())


def read_preset_source(name_or_path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw mapping of a built-in preset name or a YAML file path; a preset that names a
    `base` (a built-in name or a path) is that preset's mapping with its own settings laid over it."""
    data = _read_one(name_or_path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise InvalidPreset("base", f"expected a built-in preset name or a .yaml path, not {base!r}")
    if base in _seen or base == name_or_path:
        raise InvalidPreset("base", f"{name_or_path!r} is its own base (through {' -> '.join((*_seen, base))})")
    return _laid_over(read_preset_source(base, (*_seen, name_or_path)), data)


def _read_one(name_or_path: str) -> dict[str, Any]:
    name_or_path = name_or_path.removeprefix("file://")  # a local file as a URL (a sweep's best configuration)
    builtin = _BUILTIN / f"{name_or_path}.yaml"
    if builtin.is_file():
        text = builtin.read_text()
    elif name_or_path.endswith((".yaml", ".yml")) and Path(name_or_path).is_file():
        text = Path(name_or_path).read_text()
    else:
        allowed = ", ".join(builtin_presets())
        raise InvalidPreset(
            "preset", f"unknown preset {name_or_path!r}{did_you_mean(name_or_path, builtin_presets())}; allowed: "
                      f"{allowed}, or a .yaml file path"
        )
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise InvalidPreset("preset", f"{name_or_path!r} must hold a YAML mapping")
    return data


def _laid_over(base: dict[str, Any], own: Mapping[str, Any], model: type[BaseModel] = Preset) -> dict[str, Any]:
    """`base` with `own`'s settings in place of its own: sections merge, values replace (a mapping
    value too: `env.kwargs` of another env are that env's whole kwargs)."""
    merged = copy.deepcopy(base)
    for key, value in own.items():
        field = model.model_fields.get(key)
        section = _nested_model(field, merged.get(key)) if field is not None else None
        if section is not None and isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _laid_over(merged[key], value, section)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# YAML 1.1 reads these as booleans; on the command line they are words (`tracking.video=off`), and a
# boolean field takes them as words too
_WORDS_NOT_BOOLEANS = ("on", "off", "yes", "no", "y", "n")


def parse_assignments(assignments: Sequence[str]) -> dict[str, Any]:
    """`key=value` strings from the command line, values read as YAML scalars or lists."""
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key.strip():
            raise InvalidPreset("--set", f"expected key=value, got {assignment!r}")
        word = raw.strip()
        overrides[key.strip()] = word if word.lower() in _WORDS_NOT_BOOLEANS else yaml.safe_load(raw) if word else ""
    return overrides


def load_preset(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> Preset:
    """Resolve a preset and its overrides into a validated Preset, or raise InvalidPreset."""
    data = read_preset_source(name_or_path)
    overrides = dict(overrides or {})
    if "agent.algo" in overrides:
        _switch_algorithm(data, overrides["agent.algo"])
    _switch_dataset_source(data, overrides)
    _switch_env(data, overrides)
    for key, value in overrides.items():
        _assign(data, key, value)
    return validate_preset_data(data)


def with_settings(data: Mapping[str, Any], settings: Mapping[str, Any]) -> Preset:
    """A stored preset's data with dotted `settings` laid over it (a population member's values
    after an exploit), validated."""
    data = dict(data)
    for key, value in settings.items():
        _assign(data, key, value)
    return validate_preset_data(data)


def validate_preset_data(data: Mapping[str, Any]) -> Preset:
    _refuse_replay_settings_for_on_policy(data.get("agent"))
    try:
        return Preset.model_validate(data)
    except ValidationError as error:
        raise one_line(error) from None


def _refuse_replay_settings_for_on_policy(agent: Any) -> None:
    """Replay settings on an agent without a replay memory get a reason, not 'unknown setting'."""
    if isinstance(agent, Mapping):
        for name in sorted(set(agent) & set(ReplayOptions.model_fields)):
            if agent.get("algo") in ALGORITHMS and ALGORITHMS[agent["algo"]].on_policy:
                raise _no_replay(agent["algo"], name)


def _no_replay(algo: str, name: str) -> InvalidPreset:
    off_policy = ", ".join(n for n, a in ALGORITHMS.items() if not a.on_policy)
    return InvalidPreset(
        f"agent.{name}",
        f"{algo} is on-policy and keeps no replay memory; replay settings need an off-policy agent ({off_policy})",
    )


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'agent': {'lr': 1e-3}} -> {'agent.lr': 1e-3}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _switch_algorithm(data: dict[str, Any], algo: Any) -> None:
    """A preset's agent settings that the new algorithm does not have belong to the old one:
    drop them, keep the shared ones that fit (lr, gamma, batch_size, ...)."""
    agent = data.get("agent")
    if not isinstance(agent, dict) or agent.get("algo") == algo or algo not in ALGORITHMS:
        return
    model = _nested_model(Preset.model_fields["agent"], {"algo": algo})
    assert model is not None
    kept = {key: value for key, value in agent.items() if key in model.model_fields} | {"algo": algo}
    while True:  # a shared name may mean another thing (PPO's entropy_coef is not SAC's): drop what does not fit
        try:
            model.model_validate(kept)
            break
        except ValidationError as error:
            kept.pop(str(error.errors()[0]["loc"][0]))
    data["agent"] = kept


def _switch_env(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Another env than the preset's is the user's task, not the preset's: the run is named after it and
    its algorithm (`myenv-ppo`), its target return is the one its Gymnasium spec gives (none for an
    entry point or a spec without one), and the preset's env kwargs (the other env's) are dropped; what
    the overrides set themselves stays."""
    env = data.get("env")
    new_id = overrides.get("env.id")
    if not isinstance(env, dict) or not isinstance(new_id, str) or new_id == env.get("id"):
        return
    agent = data.get("agent") if isinstance(data.get("agent"), dict) else {}
    algo = overrides.get("agent.algo", agent.get("algo"))
    if "name" not in overrides:
        data["name"] = f"{env_name(new_id)}-{algo}" if isinstance(algo, str) else env_name(new_id)
    if "schedule.target_return" not in overrides and isinstance(data.get("schedule"), dict):
        data["schedule"]["target_return"] = spec_target(new_id)
    if "env.kwargs" not in overrides:
        env.pop("kwargs", None)


def env_name(env_id: str) -> str:
    """A run name's part for an env: 'my_env:MyEnv' -> 'myenv', 'ALE/Breakout-v5' -> 'breakout',
    'Acrobot-v1' -> 'acrobot'."""
    name = env_id.rpartition(":")[2].rpartition("/")[2]
    return re.sub(r"-v\d+$", "", name).lower().replace("_", "-") or "env"


def spec_target(env_id: str) -> float | None:
    """The reward threshold a registered env's spec gives (None for an entry point, or no threshold)."""
    if ":" in env_id:
        return None
    import gymnasium as gym

    if env_id.startswith("ALE/"):
        return None  # Atari's specs give none
    try:
        return gym.spec(env_id).reward_threshold
    except gym.error.Error:
        return None  # an unknown id is refused by name when the env is made


def _switch_dataset_source(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """dataset.id (a Minari dataset), dataset.runs (gymflow runs) and dataset.decisions (a decision log)
    are kinds of source: naming one drops the preset's other, with the root and options that went with it."""
    dataset = data.get("dataset")
    if not isinstance(dataset, dict):
        return
    sources = ("id", "runs", "decisions")
    for named in sources:
        if f"dataset.{named}" not in overrides:
            continue
        for other in (source for source in sources if source != named):
            if f"dataset.{other}" not in overrides and dataset.get(other):
                for key in (other, "root", "options"):
                    if f"dataset.{key}" not in overrides:
                        dataset.pop(key, None)


def _assign(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Set data[a][b][c] = value for 'a.b.c', refusing keys the preset model does not have."""
    parts = dotted_key.split(".")
    model: type[BaseModel] | None = Preset
    node = data
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        if model is not None:
            fields = model.model_fields
            if part not in fields:
                if here == f"agent.{part}" and part in ReplayOptions.model_fields:
                    _refuse_replay_settings_for_on_policy({**data.get("agent", {}), part: value})
                allowed = ", ".join(sorted(fields))
                raise InvalidPreset(here, f"unknown setting{did_you_mean(part, fields)}; allowed here: {allowed}")
            model = _nested_model(fields[part], node.get(part))
        if depth == len(parts) - 1:
            node[part] = copy.deepcopy(value)
            return
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InvalidPreset(here, f"is a value, not a section; cannot set {dotted_key!r}")
        node = child


def _nested_model(field: Any, current: Any) -> type[BaseModel] | None:
    """The model a field holds, resolving the agent union by its 'algo' tag."""
    models = field_models(field.annotation)
    if len(models) <= 1:  # none, or an optional section (dataset)
        return models[0] if models else None
    algo = current.get("algo") if isinstance(current, Mapping) else None
    for candidate in models:
        if candidate.model_fields.get("algo") and candidate.model_fields["algo"].default == algo:
            return candidate
    return None


def one_line(error: ValidationError, within: str | None = None) -> InvalidPreset:
    """The first thing `error` refuses, naming its field (inside `within`, a flow parameter's name)."""
    first = error.errors()[0]
    location = [*([within] if within else []), *(str(part) for part in first["loc"])]
    # A discriminated union puts the tag ('ppo') into the location; users never wrote it.
    if len(location) > 1 and location[0] == "agent" and location[1] in ALGORITHMS:
        del location[1]
    field = ".".join(location) or "preset"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown setting"
    elif first["type"] == "missing":
        message = "required setting is missing"
    elif first["type"] == "value_error":  # a validator's own words, which name the value
        return InvalidPreset(field, message.removeprefix("Value error, "))
    if "input" in first and first["type"] not in ("missing", "extra_forbidden"):
        message = f"{message} (got {first['input']!r})"
    return InvalidPreset(field, message)
