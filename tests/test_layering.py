"""The code's layers and its packaging: who may import what, and what an install puts where."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"prefect", "distributed", "dask", "fsspec", "s3fs", "mlflow"}
STORAGE_KEY_MARKS = ("runs/", "shards/", "checkpoints/", ".npz", ".safetensors", "manifest.json")


def _imports(folder: str) -> dict[str, set[str]]:
    """Every module each file of `folder` imports, by its full dotted name."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        found[str(path.relative_to(ROOT))] = names
    return found


def _roots(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("folder", ["agents", "envs"])
def test_agents_and_envs_import_no_orchestration_storage_or_tracking(folder):
    for path, names in _imports(folder).items():
        assert not _roots(names) & SERVICES, f"{path} imports {_roots(names) & SERVICES}"
        assert not {n for n in names if n.startswith(("gymflow.tasks", "gymflow.flows"))}, path


def test_the_storage_code_imports_no_prefect_and_no_other_role():
    for path, names in _imports("tasks/storage").items():
        assert not _roots(names) & {"prefect", "distributed", "dask", "mlflow"}, path
        others = {n for n in names if n.startswith("gymflow.tasks.") and not n.startswith("gymflow.tasks.storage")}
        assert not others, f"{path} imports {others}"


def test_the_lake_reads_storage_without_orchestration_or_tracking():
    for path, names in _imports("tasks/lake").items():
        assert not _roots(names) & {"prefect", "distributed", "dask", "mlflow", "torch"}, path


def test_flows_hold_no_storage_keys_and_no_math():
    for path, names in _imports("flows").items():
        assert not _roots(names) & {"numpy", "torch", "fsspec", "s3fs", "safetensors"}, path
        tree = ast.parse((ROOT / path).read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and id(node) not in docstrings]
        keys = [s for s in strings if any(mark in s for mark in STORAGE_KEY_MARKS)]
        assert not keys, f"{path} spells storage keys: {keys}"


def _loaded_after(imports: str, roots: set[str]) -> list[str]:
    """Which of the `roots` packages a fresh interpreter has loaded after `imports`."""
    code = (f"import json, sys, {imports}\n"
            f"print(json.dumps(sorted(set(m.split('.')[0] for m in sys.modules) & set({sorted(roots)!r}))))")
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_importing_the_agents_and_envs_loads_no_service_client():
    assert _loaded_after("gymflow.agents.algorithms, gymflow.envs, gymflow.presets.validate", SERVICES) == []


def test_presets_and_flows_load_no_torch_until_a_run_needs_it():
    # `gymflow presets`, `prefect deploy` and a worker's import of a flow pay for Prefect, not for torch
    flows = ", ".join(f"gymflow.flows.{path.stem}" for path in sorted((ROOT / "flows").glob("*.py"))
                      if path.stem != "__init__")
    assert _loaded_after(f"gymflow.presets, gymflow.agents.algorithms, {flows}", {"torch", "safetensors"}) == []
    assert _loaded_after("gymflow.flows.improve", {"torch", "mlflow", "matplotlib", "distributed"}) == []


def test_the_roles_module_holds_roles_only():
    names = _imports("agents")["agents/core.py"]
    assert not {name for name in names if name.startswith("gymflow.")} - {"gymflow.agents.batches"}
    assert not _roots(names) & {"torch", "pydantic"}
    batches = _imports("agents")["agents/batches.py"]
    assert _roots(batches) <= {"__future__", "typing", "numpy"}


def test_no_product_module_branches_on_whether_it_runs_under_a_test():
    # a task is called as a task (a test that runs the loop in-process gives it a real Prefect API), and
    # no module asks whether a flow run or a test is around it
    for folder in ("agents", "envs", "flows", "presets", "tasks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            calls_fn = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "fn"]
            assert "FlowRunContext" not in names and not calls_fn, f"{path.relative_to(ROOT)}: {calls_fn}"
            assert "PYTEST_CURRENT_TEST" not in path.read_text(), path


def test_the_wheel_installs_everything_under_the_gymflow_namespace(tmp_path):
    source = tmp_path / "source"  # a copy, so that no earlier build/ folder leaks stale modules into the wheel
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", ".devrun", "build", "*.egg-info", "__pycache__",
                                                                 "gymflow-data", "mlruns", "mlartifacts", "*.db"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("gymflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"gymflow", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                     + ".dist-info"}
    for module in ("gymflow/flows/improve.py", "gymflow/tasks/training/loop.py", "gymflow/agents/ppo.py",
                   "gymflow/envs/vector.py", "gymflow/presets/builtin/cartpole-ppo.yaml", "gymflow/testing/envs.py"):
        assert module in names, module
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "gymflow = gymflow.flows.cli:main" in entry_points


def test_product_code_stays_within_its_size_limits():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import code_figures
    finally:
        sys.path.remove(str(ROOT / "tests"))
    figures, broken = code_figures.figures()
    assert broken == [], broken
    assert figures["max_parameters"] <= 6 and figures["max_function_lines"] <= 50


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
