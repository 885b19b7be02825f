"""The results suite: gymflow's presets over seeds, at the budgets the literature publishes, held
against the published figures; writes docs/results.md and one learning-curve image per task.

    .venv/bin/python benchmarks/results_suite.py                       # the whole suite (hours on 2 cores)
    .venv/bin/python benchmarks/results_suite.py --only hopper-ppo     # some of its entries
    .venv/bin/python benchmarks/results_suite.py --report-only         # the page from what has finished

Each entry of the suite file (benchmarks/results_suite.yaml: a preset, the tasks it runs on, seeds,
an env-step budget) runs as a gymflow sweep whose one searched field is `env.id`: the crash-proof
sweep machinery, the interquartile mean of the seeds' final evaluations with a 95% stratified
bootstrap interval (Agarwal et al. 2021). A task other than the preset's own is the preset carried
over with `--set env.id=...` and nothing else. The sweep ids are derived from the entries, so a
killed suite, started again with the same command, keeps every finished run, resumes the
interrupted ones from their last checkpoint and starts the rest. Runs, MLflow store and studies
live under the suite's `root` (default ./gymflow-results).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_SUITE = REPOSITORY / "benchmarks" / "results_suite.yaml"


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str = Field(description="A built-in preset name or a preset YAML path.")
    tasks: list[str] = Field(default_factory=list, description="env ids to run it on; empty: the preset's own.")
    seeds: int = Field(default=3, ge=1, le=100)
    env_steps: int = Field(gt=0, description="The env-step budget of every run.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Preset fields set for every run.")

    @property
    def sweep_id(self) -> str:
        return f"results-{Path(self.preset).stem}-{self.env_steps}"


class Suite(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    root: str = Field(default="gymflow-results", description="Runs, MLflow store and sweep studies live here.")
    concurrency: int = Field(default=2, ge=1, le=64, description="Runs at once (one core each, on SYNC presets).")
    entries: list[Entry]


@dataclass(frozen=True)
class Published:
    """A figure from the literature at a given budget."""

    source: str  # who reports it, and where
    task: str  # the env version it was measured on
    value: float
    note: str = ""


# Final returns at 1M env steps, as DESIGN.md gathers them: rl-baselines3-zoo's benchmark.md (mean
# +- std of its evaluations), CleanRL's docs/benchmark pages (mean +- std over 3 seeds of the
# training episodes' returns), Tianshou's examples/mujoco README (the best point of its mean curve).
PUBLISHED: dict[tuple[str, str, int], list[Published]] = {
    ("ppo", "Hopper", 1_000_000): [Published("rl-zoo", "Hopper-v3", 2410), Published("CleanRL", "Hopper-v4", 2383),
                                   Published("Tianshou", "Hopper-v4", 2609, "best point of the mean curve")],
    ("ppo", "Walker2d", 1_000_000): [Published("rl-zoo", "Walker2d-v3", 3479),
                                     Published("CleanRL", "Walker2d-v4", 2288),
                                     Published("Tianshou", "Walker2d-v4", 3589, "best point of the mean curve")],
    ("ppo", "HalfCheetah", 1_000_000): [Published("rl-zoo", "HalfCheetah-v3", 5819),
                                        Published("CleanRL", "HalfCheetah-v4", 1443),
                                        Published("Tianshou", "HalfCheetah-v4", 5784, "best point of the mean curve")],
    ("sac", "Hopper", 1_000_000): [Published("rl-zoo", "Hopper-v3", 2326), Published("CleanRL", "Hopper-v4", 2310),
                                   Published("Tianshou", "Hopper-v4", 3542, "best point of the mean curve")],
    ("sac", "HalfCheetah", 1_000_000): [Published("rl-zoo", "HalfCheetah-v3", 9535),
                                        Published("CleanRL", "HalfCheetah-v4", 9635),
                                        Published("Tianshou", "HalfCheetah-v4", 12139, "best point of the mean curve")],
    ("td3", "Hopper", 1_000_000): [Published("rl-zoo", "Hopper-v3", 3606), Published("CleanRL", "Hopper-v4", 3135),
                                   Published("Tianshou", "Hopper-v4", 3472, "best point of the mean curve")],
    ("sac", "Walker2d", 1_000_000): [Published("rl-zoo", "Walker2d-v3", 3863), Published("CleanRL", "Walker2d-v4", 3592)],
    ("td3", "HalfCheetah", 1_000_000): [Published("rl-zoo", "HalfCheetah-v3", 9656),
                                        Published("CleanRL", "HalfCheetah-v4", 9018)],
    ("td3", "Walker2d", 1_000_000): [Published("rl-zoo", "Walker2d-v3", 4718), Published("CleanRL", "Walker2d-v4", 4246)],
}

# Stable-Baselines3 with the same settings on this machine, side by side with gymflow
# (benchmarks/mujoco_vs_sb3.py; the runs, dates and commands are in docs/benchmarks.md).
SIDE_BY_SIDE: dict[tuple[str, str, int], str] = {
    ("halfcheetah-sac", "HalfCheetah-v5", 100_000): "5,274 (median of 3; gymflow's median 5,373)",
    ("hopper-td3", "Hopper-v5", 300_000): "2,655 (median of 3: 3,414, 2,655, 2,643)",
}


@dataclass
class TaskResult:
    """One (preset, task) of the suite: each seed's final return and learning curve."""

    entry: Entry
    algo: str
    task: str
    finals: dict[int, float] = field(default_factory=dict)
    curves: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    failed: bool = False


class BadSuite(Exception):
    """A suite file that cannot be read or does not fit the model: one line naming the field."""


def read_suite(path: Path) -> Suite:
    try:
        with open(path, encoding="utf-8") as stream:
            return Suite.model_validate(yaml.safe_load(stream))
    except OSError as error:
        raise BadSuite(f"cannot read {str(path)!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise BadSuite(f"{str(path)!r} is not valid YAML: {str(error).splitlines()[0]}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "suite"
        raise BadSuite(f"{where}: {first['msg']}") from None


def sweep_spec(suite: Suite, entry: Entry) -> dict:
    """The entry as a sweep spec: its own one every time, so a restart continues the same sweep."""
    from gymflow.presets.load import load_preset

    root = Path(suite.root).resolve()
    tasks = entry.tasks or [load_preset(entry.preset).env.id]
    return {
        "preset": preset_reference(entry.preset),
        "overrides": {**entry.overrides, "schedule.total_env_steps": entry.env_steps,
                      "storage.root": str(root / "data"), "tracking.tracking_uri": f"sqlite:///{root / 'mlflow.db'}"},
        "space": {"env.id": {"values": tasks}},
        "sampler": "grid",
        "seeds": entry.seeds,
        "concurrency": suite.concurrency,
        "study_storage": f"sqlite:///{root / 'sweeps.db'}",
    }


def preset_reference(preset: str) -> str:
    """A built-in preset's name as it is; a preset file's path made absolute, from where the suite
    was started (its sweep runs from the suite's root)."""
    return str(Path(preset).resolve()) if preset.endswith((".yaml", ".yml")) else preset


def run_entry(suite: Suite, entry: Entry) -> int:
    """Run (or continue) the entry's sweep through gymflow's command line; its exit status."""
    from gymflow.flows.cli import main

    specs = Path(suite.root).resolve() / "specs"
    specs.mkdir(parents=True, exist_ok=True)
    path = specs / f"{entry.sweep_id}.yaml"
    path.write_text(yaml.safe_dump(sweep_spec(suite, entry), sort_keys=True))
    with contextlib.chdir(specs.parent):  # MLflow's artifacts (./mlruns) beside the suite's store
        return main(["sweep", str(path), "--id", entry.sweep_id])


def collect_results(suite: Suite, entries: list[Entry]) -> list[TaskResult]:
    """Each entry's tasks, with what its sweep has finished so far (nothing where it has not run)."""
    import optuna

    from gymflow.presets.load import load_preset
    from gymflow.tasks.sweep.study import configurations

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{Path(suite.root).resolve() / 'sweeps.db'}"
    results = []
    for entry in entries:
        preset = load_preset(entry.preset)
        tasks = {task: TaskResult(entry, algorithm_name(preset), task) for task in entry.tasks or [preset.env.id]}
        try:
            study = optuna.load_study(study_name=entry.sweep_id, storage=storage)
        except KeyError:  # not started yet
            study = None
        for configuration in configurations(study) if study is not None else []:
            task = tasks[str(configuration.params["env.id"])]
            for seed, result in sorted(configuration.results.items()):
                task.finals[seed] = result.final_return
                task.curves[seed] = result.curve
            task.failed = len(task.finals) < entry.seeds
        results += tasks.values()
    return results


def published_for(algo: str, task: str, env_steps: int) -> list[Published]:
    return PUBLISHED.get((algo, task.split("-")[0], env_steps), [])


def plot_task(result: TaskResult, path: Path) -> None:
    """Each seed's evaluation curve, their mean, and the published figures as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gymflow.tasks.sweep.aggregate import curve_band

    figure, axes = plt.subplots(figsize=(8, 4.5))
    curves = [tuple(zip(*curve)) for curve in result.curves.values() if curve]
    for steps, returns in curves:
        axes.plot(steps, returns, lw=0.8, alpha=0.45, color="tab:blue")
    if curves:
        grid, mean, low, high = curve_band(curves)
        axes.plot(grid, mean, lw=2.2, color="tab:blue", label=f"gymflow {result.entry.preset}, mean of "
                  f"{len(curves)} seeds (thin: each seed)")
        axes.fill_between(grid, low, high, color="tab:blue", alpha=0.15)
    for index, figure_ in enumerate(published_for(result.algo, result.task, result.entry.env_steps)):
        axes.axhline(figure_.value, ls="--", lw=1.2, color=plt.get_cmap("Dark2")(index),
                     label=f"{figure_.source} at {result.entry.env_steps:,} ({figure_.task}): {figure_.value:,.0f}")
    axes.set_xlabel("environment steps")
    axes.set_ylabel("greedy evaluation return (each evaluation's mean)")
    axes.set_title(f"{result.task}: {result.algo.upper()} ({result.entry.preset})")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def image_name(result: TaskResult) -> str:
    task = result.task.lower().replace("pettingzoo:", "").replace(":", "-").replace("/", "-")
    return f"results-{task}-{Path(result.entry.preset).stem}.png"  # a preset file's name without its folder


def algorithm_name(preset: Any) -> str:
    """The algorithm as the literature names it: PPO over a PettingZoo env's agents is IPPO, with
    a centralised critic MAPPO."""
    if not preset.env.id.startswith("pettingzoo:"):
        return preset.agent.algo
    return "mappo" if preset.env.global_state else "ippo"


def figure(value: float) -> str:
    """A return as a table shows it: whole numbers, but a decimal where returns are small."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def results_markdown(results: list[TaskResult], command: str, machine: str) -> str:
    from gymflow.tasks.sweep.aggregate import iqm_with_interval

    lines = [
        "# Results",
        "",
        "gymflow's presets over seeds, at the budgets the literature publishes, against the published",
        "figures. Made by `benchmarks/results_suite.py` (the suite: `benchmarks/results_suite.yaml`);",
        f"this page by `{command}` on {machine}, {time.strftime('%Y-%m-%d')}.",
        "",
        "Each cell is the greedy evaluation (10 episodes) of the version each seed's run delivered (its",
        "best-evaluated: a run's last evaluation is its curve's end below); gymflow's figure is the",
        "interquartile mean over seeds with its 95% stratified bootstrap interval, then the median",
        "and each seed (with 3 seeds the IQM trims no run: it is their mean). A task other than the",
        "preset's own is that preset with `--set env.id=...` only.",
        "Published figures are at the same budget, with their source (rl-zoo: rl-baselines3-zoo's",
        "benchmark.md; CleanRL: its docs' benchmark pages; Tianshou: examples/mujoco, the best point of",
        "its mean curve). Their env versions are older (v3/v4) than gymflow's v5.",
        "",
        "| task | algorithm | preset | env steps | seeds | gymflow IQM [95% CI] | median | each seed | "
        "SB3 side by side | published |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        finals = np.array([result.finals[seed] for seed in sorted(result.finals)])
        if len(finals):
            estimate = iqm_with_interval(finals)
            ours = f"**{figure(estimate.value)}** [{figure(estimate.low)}, {figure(estimate.high)}]"
            median, seeds = figure(float(np.median(finals))), ", ".join(figure(value) for value in finals)
        else:
            ours, median, seeds = "not run yet", "", ""
        if result.failed and len(finals):
            ours += f" ({len(finals)} of {result.entry.seeds} seeds)"
        published = "; ".join(f"{p.source} {p.value:,.0f} ({p.task})"
                              for p in published_for(result.algo, result.task, result.entry.env_steps))
        side = SIDE_BY_SIDE.get((result.entry.preset, result.task, result.entry.env_steps), "not measured")
        lines.append(f"| {result.task} | {result.algo.upper()} | `{result.entry.preset}` | "
                     f"{result.entry.env_steps:,} | {len(finals)} | {ours} | {median} | {seeds} | {side} | "
                     f"{published or 'none at this budget'} |")
    lines += ["", "## Learning curves", ""]
    for result in results:
        if result.curves:
            lines += [f"### {result.task}, {result.algo.upper()} (`{result.entry.preset}`)", "",
                      f"![{result.task} {result.algo}](img/{image_name(result)})", ""]
    return "\n".join(lines) + "\n"


def write_report(suite: Suite, entries: list[Entry], docs: Path, command: str, machine: str) -> Path:
    results = collect_results(suite, entries)
    for result in results:
        if result.curves:
            plot_task(result, docs / "img" / image_name(result))
    page = docs / "results.md"
    docs.mkdir(parents=True, exist_ok=True)
    page.write_text(results_markdown(results, command, machine))
    return page


def machine_words() -> str:
    return f"a {os.cpu_count()}-core CPU machine, no GPU" if not _has_cuda() else f"{os.cpu_count()} cores + CUDA"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", type=Path, default=DEFAULT_SUITE, help="the suite file")
    parser.add_argument("--only", nargs="+", default=None, help="run only the entries of these presets")
    parser.add_argument("--report-only", action="store_true", help="write the page from what has finished")
    parser.add_argument("--docs", type=Path, default=REPOSITORY / "docs", help="where results.md and img/ go")
    args = parser.parse_args(argv)
    try:
        suite = read_suite(args.suite)
    except BadSuite as error:
        print(f"results suite: error: {error}", file=sys.stderr)
        return 2
    chosen = [entry for entry in suite.entries if args.only is None or entry.preset in args.only]
    if not chosen:
        print(f"results suite: no entry of {args.suite} has preset {args.only}", file=sys.stderr)
        return 2
    status = 0
    if not args.report_only:
        for entry in chosen:
            print(f"results suite: {entry.preset} on {entry.tasks or 'its own task'}, {entry.seeds} seeds x "
                  f"{entry.env_steps:,} env steps (sweep {entry.sweep_id})", flush=True)
            status = run_entry(suite, entry) or status
    command = "python benchmarks/results_suite.py" + (f" --suite {args.suite}" if args.suite != DEFAULT_SUITE else "")
    page = write_report(suite, suite.entries, args.docs, command, machine_words())
    print(f"results suite: wrote {page}")
    return status


if __name__ == "__main__":
    sys.exit(main())
