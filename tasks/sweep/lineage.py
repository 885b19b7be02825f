"""What a population-based sweep reports: its members ranked by their final evaluation, the
lineage (member x interval: the values trained with, the score at the pause, who copied whom) as a
table and a plot, and the best member's schedule of values as a preset-like record that
`gymflow run` takes (its final values; the schedule in its header)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Protocol

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml
from mlflow.entities import LoggedModelOutput
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from gymflow.presets.redaction import redacted
from gymflow.presets.sweep import Range, Sweep
from gymflow.tasks.storage.layout import sweep_best_preset
from gymflow.tasks.storage.objects import StorageLocation, open_storage
from gymflow.tasks.sweep.pbt import MemberResult
from gymflow.tasks.sweep.trial import PbtMember
from gymflow.tasks.tracking.store import tracking_client
from gymflow.tasks.tracking.tracker import Tracker


class Lineage(Protocol):
    """Each interval's plan and results (flows/population.py's `Population`)."""

    plans: list[list[PbtMember]]
    results: list[dict[int, MemberResult]]

    def final(self) -> list[MemberResult]: ...


def ranking_rows(lineage: Lineage) -> list[dict[str, Any]]:
    """Members by final return (a member that failed last), with their final values and copies."""
    finals = sorted(lineage.final(), key=lambda r: (not r.finished, -_finite(r.final_return), r.member))
    settings = _settings_by_member(lineage)
    return [{"rank": rank, "member": result.member, **{key: _short(value) for key, value in
                                                       sorted(settings[result.member][-1].items())},
             "outcome": "complete" if result.finished else "failed", "final return": round(result.final_return, 3),
             "copies": sum(1 for plan in lineage.plans for m in plan if m.member == result.member and m.copy_from),
             "run": result.run_id}
            for rank, result in enumerate(finals, start=1)]


def lineage_markdown(sweep_id: str, lineage: Lineage) -> str:
    """Member x interval: the values trained with, the score at the interval's end, and the copy
    the interval began with."""
    members = sorted({m.member for plan in lineage.plans for m in plan})
    header = ["member", *[f"interval {index}" for index in range(len(lineage.plans))]]
    lines = [f"# population of sweep {sweep_id}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for member in members:
        cells = [f"m{member}"]
        for plan, results in zip(lineage.plans, lineage.results + [{}] * len(lineage.plans)):
            entry = next((m for m in plan if m.member == member), None)
            if entry is None:
                cells.append("")
                continue
            copied = f"← m{entry.copy_from.source} v{entry.copy_from.version}; " if entry.copy_from else ""
            scored = f" → {results[member].score:.4g}" if member in results else ""
            cells.append(f"{copied}{settings_in_words(entry.settings)}{scored}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_lineage(sweep: Sweep, lineage: Lineage, path: str, title: str) -> str:
    """Left: each member's evaluation return over env steps, a copy drawn as a dashed line from
    the source's point to where the copier goes on. Right: the first searched field's value per
    member over the intervals (its schedule)."""
    figure, (curves_ax, values_ax) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab10")
    finals = {result.member: result for result in lineage.final()}
    for member, result in finals.items():
        if result.curve:
            steps, values = zip(*result.curve)
            curves_ax.plot(steps, values, color=colors(member % 10), lw=1.6, label=f"m{member}")
    for plan, results in zip(lineage.plans[1:], lineage.results):
        for entry in (m for m in plan if m.copy_from):
            source, copier = results.get(entry.copy_from.source), results.get(entry.member)
            if source and copier:
                curves_ax.plot([source.clock, copier.clock], [source.score, copier.score], ls="--", lw=1,
                               color=colors(entry.copy_from.source % 10))
                curves_ax.annotate("", (copier.clock, source.score), (source.clock, source.score),
                                   arrowprops={"arrowstyle": "->", "color": colors(entry.member % 10)})
    curves_ax.set_xlabel("environment steps")
    curves_ax.set_ylabel("evaluation return")
    curves_ax.set_title(title)
    curves_ax.grid(alpha=0.3)
    curves_ax.legend(fontsize=7, loc="lower right")
    _plot_schedules(sweep, lineage, values_ax, colors)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_schedules(sweep: Sweep, lineage: Lineage, axes: Any, colors: Any) -> None:
    key, param = next(iter(sweep.spec.space.items()))
    for member, schedule in _settings_by_member(lineage).items():
        axes.step(range(len(schedule)), [values[key] for values in schedule], where="post",
                  color=colors(member % 10), label=f"m{member}")
    if isinstance(param, Range) and param.log:
        axes.set_yscale("log")
    axes.set_xlabel("interval")
    axes.set_ylabel(key)
    axes.set_title(f"{key} per member (after each copy, perturbed)")
    axes.grid(alpha=0.3)


def best_schedule_yaml(sweep: Sweep, lineage: Lineage, best: MemberResult) -> bytes:
    """The preset with the best member's final values; its values at each interval in the header."""
    schedule = _settings_by_member(lineage)[best.member]
    preset = sweep.trial_preset(schedule[-1])
    lines = [f"# the best member (m{best.member}) of a population-based sweep of {sweep.spec.preset}: final "
             f"return {best.final_return:.2f}", "# its values, interval by interval (every "
             f"{sweep.spec.pbt.interval:,} steps; a copy of another member's learner where marked):"]
    for interval, plan in enumerate(lineage.plans):
        entry = next((m for m in plan if m.member == best.member), None)
        if entry is not None:
            copied = f" (copied m{entry.copy_from.source} v{entry.copy_from.version})" if entry.copy_from else ""
            lines.append(f"#   interval {interval}: {settings_in_words(entry.settings)}{copied}")
    body = yaml.safe_dump(redacted(preset.model_dump(mode="json")), sort_keys=False)
    return ("\n".join(lines) + "\n" + body).encode()


def report_population(sweep: Sweep, sweep_id: str, lineage: Lineage, parent: Tracker,
                      location: StorageLocation) -> tuple[list[dict[str, Any]], str | None]:
    """The ranking and the lineage (Prefect table and markdown artifacts; on the MLflow parent
    run: ranking.json, lineage.md, lineage.png, the best member's model URI and schedule), and
    the schedule in storage. Returns the ranking rows and the schedule's URL."""
    rows = ranking_rows(lineage)
    client = tracking_client(sweep.base.tracking.tracking_uri)
    client.log_dict(parent.run_id, {"ranking": rows}, "ranking.json")
    markdown = lineage_markdown(sweep_id, lineage)
    client.log_text(parent.run_id, markdown, "lineage.md")
    with tempfile.TemporaryDirectory() as folder:
        parent.log_artifact(plot_lineage(sweep, lineage, str(Path(folder, "lineage.png")),
                                         f"sweep {sweep_id}: {sweep.spec.preset}, population"))
    create_table_artifact(key="sweep-ranking", table=rows, description=f"sweep {sweep_id}: members by final return")
    create_markdown_artifact(key="sweep-lineage", markdown=markdown,
                             description=f"sweep {sweep_id}: who copied whom, with which values")
    best = next((r for r in lineage.final() if rows and r.member == rows[0]["member"] and r.finished), None)
    if best is None:
        return rows, None
    parent.log_metrics({"sweep/best_final_return": best.final_return, "sweep/best_member": float(best.member)}, 0)
    client.set_tag(parent.run_id, "gymflow.sweep.best_run_ids", best.run_id)
    if best.model_uri:  # the best member's delivered policy is the sweep's logged model too
        client.set_tag(parent.run_id, "gymflow.sweep.best_model", best.model_uri)
        client.log_outputs(parent.run_id, [LoggedModelOutput(best.model_uri.removeprefix("models:/"), best.clock)])
    record = best_schedule_yaml(sweep, lineage, best)
    client.log_text(parent.run_id, record.decode(), "best-preset.yaml")
    storage = open_storage(location)
    storage.write(sweep_best_preset(sweep_id), record)
    return rows, storage.url(sweep_best_preset(sweep_id))


def _settings_by_member(lineage: Lineage) -> dict[int, list[dict[str, Any]]]:
    schedules: dict[int, list[dict[str, Any]]] = {}
    for plan in lineage.plans:
        for entry in plan:
            schedules.setdefault(entry.member, []).append(entry.settings)
    return schedules


def settings_in_words(settings: dict[str, Any]) -> str:
    """`lr=0.0003, clip_range=0.2`: a member's values, short."""
    return ", ".join(f"{key.removeprefix('agent.')}={_short(value)}" for key, value in sorted(settings.items()))


def _short(value: Any) -> Any:
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -math.inf
