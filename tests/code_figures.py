"""Figures of the product code (everything but tests/ and benchmarks/) that keep it readable.

    python tests/code_figures.py          # print them; exit 1 if a limit is broken

Function length counts the lines from `def` to the function's last line, without its docstring
(the flows' docstrings are the Prefect UI's parameter help); parameters exclude self and cls.
The line limit is ruff's own `line-length` from pyproject.toml.
"""

from __future__ import annotations

import ast
import statistics
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("gymflow", "flows", "tasks", "agents", "envs", "presets", "testing")
LIMITS = {"max_parameters": 6, "max_function_lines": 50, "median_function_lines": 12, "p90_function_lines": 40}


@dataclass(frozen=True)
class Function:
    where: str  # path:line name
    lines: int
    parameters: int


def product_files() -> list[Path]:
    return sorted(path for folder in PRODUCT if (ROOT / folder).is_dir() for path in (ROOT / folder).rglob("*.py"))


def functions_of(path: Path) -> list[Function]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(Function(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", _length(node), _parameters(node)))
    return found


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = node.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return len([name for name in names if name not in ("self", "cls")])


def line_length() -> int:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]


def figures() -> tuple[dict[str, float], list[str]]:
    """The figures, and every place that breaks a limit."""
    files = product_files()
    functions = [function for path in files for function in functions_of(path)]
    lengths = sorted(function.lines for function in functions)
    limit = line_length()
    long_lines = [f"{path.relative_to(ROOT)}:{number}" for path in files
                  for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
    markers = [f"{path.relative_to(ROOT)}:{number} {marker}" for path in files
               for number, line in enumerate(path.read_text().splitlines(), 1)
               for marker in ("nonlocal", "type: ignore") if marker in line and not line.lstrip().startswith("#")]
    result = {
        "files": len(files),
        "functions": len(functions),
        "median_function_lines": statistics.median(lengths),
        "p90_function_lines": lengths[int(0.9 * (len(lengths) - 1))],
        "max_function_lines": lengths[-1],
        "max_parameters": max(function.parameters for function in functions),
        "line_length": limit,
        "lines_over_line_length": len(long_lines),
        "nonlocal_or_type_ignore": len(markers),
    }
    broken = [f"{f.where}: {f.lines} lines" for f in functions if f.lines > LIMITS["max_function_lines"]]
    broken += [f"{f.where}: {f.parameters} parameters" for f in functions if f.parameters > LIMITS["max_parameters"]]
    broken += [f"{where}: longer than {limit}" for where in long_lines] + markers
    for name in ("median_function_lines", "p90_function_lines"):
        if result[name] > LIMITS[name]:
            broken.append(f"{name} {result[name]} > {LIMITS[name]}")
    return result, broken


def main() -> int:
    result, broken = figures()
    for name, value in result.items():
        print(f"{name:26} {value}")
    for problem in broken:
        print(f"  over a limit: {problem}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
