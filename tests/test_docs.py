"""The docs work as written: every `gymflow ...` command in README.md and docs/ is one the command
line takes (its subcommand and flags), and every YAML block that is a preset, a piece of one or a
sweep spec validates (a piece laid over cartpole-ppo). Extracted from the markdown, so an example
with a field or flag that does not exist fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from gymflow.flows.cli import _parser
from gymflow.presets.load import builtin_presets, load_preset, read_preset_source, validate_preset_data
from gymflow.presets.model import Preset
from gymflow.presets.sweep import check_sweep, sweep_spec

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _blocks(language: str) -> list[tuple[str, str]]:
    return [(f"{page.name}#{number}", body) for page in PAGES
            for number, (lang, body) in enumerate(_BLOCK.findall(page.read_text())) if lang == language]


def _commands() -> list[tuple[str, str]]:
    """Each `gymflow` command line of the bash blocks, its continuation lines joined, its comment cut."""
    found = []
    for where, body in _blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip())
            words = shlex.split(line, posix=True) if line and not line.startswith("#") else []
            if words and Path(words[0]).name == "gymflow" and "|" not in words:
                found.append((where, line))
    return found


@pytest.mark.parametrize(("where", "line"), _commands(), ids=[f"{w}:{line[:40]}" for w, line in _commands()])
def test_each_gymflow_command_in_the_docs_is_one_the_command_line_takes(where, line):
    words = shlex.split(line)[1:]
    try:
        _parser().parse_args(words)
    except SystemExit:
        pytest.fail(f"{where}: `{line}` is not a command gymflow takes")


def _yaml_examples() -> list[tuple[str, dict]]:
    examples = []
    for where, body in _blocks("yaml"):
        data = yaml.safe_load(body)
        if isinstance(data, dict) and ("space" in data or set(data) - {"base"} <= set(Preset.model_fields)):
            examples.append((where, data))
    return examples


@pytest.mark.parametrize(("where", "data"), _yaml_examples(), ids=[where for where, _ in _yaml_examples()])
def test_each_preset_or_sweep_spec_in_the_docs_validates(where, data, tmp_path):
    if "space" in data:
        check_sweep(sweep_spec(data))
        return
    if "base" in data:  # a preset file of its own, over a built-in one
        (tmp_path / "preset.yaml").write_text(yaml.safe_dump(data))
        load_preset(str(tmp_path / "preset.yaml"))
        return
    base = read_preset_source("cartpole-ppo")
    merged = {**base, **{key: {**base.get(key, {}), **value} if isinstance(value, dict) else value
                         for key, value in data.items()}}
    if "agent" in data and data["agent"].get("algo", base["agent"]["algo"]) != base["agent"]["algo"]:
        merged["agent"] = data["agent"]  # another algorithm: its own settings alone
    validate_preset_data(merged)


MY_ENV = """from gymnasium.envs.classic_control import CartPoleEnv


class MyEnv(CartPoleEnv):
    \"\"\"The docs' example of a user's env: a file in the working folder.\"\"\"
"""


def _runs() -> list[tuple[str, str]]:
    """The `gymflow run` and `gymflow show` commands of the docs that name a built-in preset."""
    from gymflow.presets import builtin_presets

    names = set(builtin_presets())
    return [(where, line) for where, line in _commands()
            if shlex.split(line)[1:2] in (["run"], ["show"]) and shlex.split(line)[2:3][0:1] and
            shlex.split(line)[2] in names]


@pytest.mark.parametrize(("where", "line"), _runs(), ids=[f"{w}:{line[:60]}" for w, line in _runs()])
def test_each_run_in_the_docs_resolves_to_an_experiment_gymflow_would_start(where, line, tmp_path, monkeypatch):
    """Its preset with its `--set` overrides checked as `gymflow run` checks them before any work
    (the fields exist, the values are allowed, the env, its spaces and the agent fit). The docs'
    own env, `my_env:MyEnv`, is a file of the working folder beside its `helpers/` package, as they say."""
    (tmp_path / "my_env.py").write_text(MY_ENV)
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from gymflow.errors import GymflowError
    from gymflow.presets import parse_assignments
    from gymflow.presets.validate import resolve_experiment

    args = _parser().parse_args(shlex.split(line)[1:])
    try:
        resolve_experiment(args.preset, parse_assignments(args.set))
    except GymflowError as error:
        pytest.fail(f"{where}: `{line}`: {error}")


def test_the_reference_page_is_the_one_the_preset_model_generates():
    """docs/reference.md is generated (presets/reference.py): a field added, renamed or described anew
    without regenerating it fails here, with the command that regenerates it."""
    from gymflow.presets.reference import reference_page

    committed = (ROOT / "docs" / "reference.md").read_text()
    assert committed == reference_page(), "docs/reference.md is stale: .venv/bin/python -m gymflow.presets.reference " \
                                          "> docs/reference.md"
    for field in ("distribution.cluster_tls", "distribution.slurm", "distribution.learners", "distribution.gpu_wait_s",
                  "storage.options_block", "agent.vtrace_rho_bar"):
        assert f"| `{field}` |" in committed, field
    assert all(f"| `{name}` |" in committed for name in builtin_presets())


def _deployments() -> list[dict]:
    return yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("deployment", _deployments(), ids=[d["name"] for d in _deployments()])
def test_each_deployment_s_parameters_are_ones_its_flow_takes_and_its_preset_resolves(deployment):
    import importlib

    from gymflow.presets.overrides import as_dotted
    from gymflow.presets.validate import resolve_experiment

    path, name = deployment["entrypoint"].split(":")
    flow = getattr(importlib.import_module("gymflow." + path.removesuffix(".py").replace("/", ".")), name)
    parameters = flow.validate_parameters(deployment.get("parameters", {}))  # what Prefect checks as a run starts
    if "preset" in parameters and flow.name != "sweep":
        resolve_experiment(parameters["preset"], as_dotted(parameters.get("overrides")))
